"""`raytrain-dt doctor`: the checks a GPU user runs on a new cluster before a long job.

Each check returns a `Check` (PASS, FAIL or SKIP with one line of detail and its figures);
`cli` runs them in order and prints them, or their JSON. The checks run the product's own
paths (its device selection, its rank actors, its engines, its elastic recovery), not copies.
"""

"""Data: text -> parquet preparation, the global sample order, and the Ray Data input pipeline."""

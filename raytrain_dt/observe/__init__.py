"""Observability: run records (metrics, ledger, events), MFU and recovery accounting, exporters
(console, TensorBoard, Ray metrics, live status), and the run report with its goodput."""

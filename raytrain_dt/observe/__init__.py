"""Observability: run records (metrics, ledger, events), logging and progress."""

"""Checkpoint discovery, train state records and retention."""

"""Logging set-up for the driver: `run.dir/train.log` gets every line the terminal gets."""

from __future__ import annotations

import logging
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_driver_logging(run_dir: Path) -> logging.Handler:
    root = logging.getLogger("raytrain_dt")
    root.setLevel(logging.INFO)
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    return handler

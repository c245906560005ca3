"""Job entrypoint for `ray job submit --working-dir . -- python jobs/pretrain.py CONFIG [k=v ...]`.

Thin on purpose: load the config, run the coordinator. Inside a Ray job RAY_ADDRESS is set, so
the coordinator joins the job's cluster instead of starting an embedded one.
"""

import sys
from pathlib import Path

# With --working-dir the package arrives as source next to this file, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raytrain_dt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

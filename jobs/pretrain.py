"""Job entrypoint for `ray job submit --working-dir . -- python jobs/pretrain.py CONFIG [k=v ...]`.

Thin on purpose: load the config, run the coordinator. Inside a Ray job RAY_ADDRESS is set, so
the coordinator joins the job's cluster instead of starting an embedded one.
"""

import sys

from raytrain_dt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

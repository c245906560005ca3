"""Job entrypoint for `ray job submit --working-dir . -- python jobs/pretrain.py CONFIG [k=v ...]`.

Thin on purpose: load the config, run the coordinator. Inside a Ray job RAY_ADDRESS is set, so
the coordinator joins the job's cluster instead of starting an embedded one. `ray job stop`
sends SIGTERM: the run checkpoints at the next step boundary and exits; submitting the same job
again (same run.dir) resumes there. Give it time with `RAY_JOB_STOP_WAIT_TIME_S` in the job's
runtime_env env_vars (Ray's default is 3 s before SIGKILL).
"""

import sys
from pathlib import Path

# With --working-dir the package arrives as source next to this file, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raytrain_dt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

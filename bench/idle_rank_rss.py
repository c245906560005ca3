"""The host memory of an idle rank actor: what `topology/host_memory.py` prices every rank
process at (`IDLE_RANK_RSS_BYTES`). Starts an embedded Ray instance, two `RankWorker` actors
that import torch and its lazy modules as every rank does, and prints their RSS, USS and PSS.

Run: python bench/idle_rank_rss.py   (not part of `make bench`: a constant's source, no target)
"""

from __future__ import annotations

import tempfile
import time

import psutil
import ray

from raytrain_dt.worker.rank_actor import RankWorker


def main() -> None:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=tempfile.mkdtemp(prefix="rss_", dir="/tmp"),
    )
    actor_cls = ray.remote(RankWorker)
    try:
        for index in range(2):
            actor = actor_cls.options(num_cpus=0.5).remote(tempfile.mkdtemp(), index)
            pid = ray.get(actor.where.remote())["pid"]
            ray.get(actor.warmed.remote())  # torch's lazy modules imported
            time.sleep(2)
            info = psutil.Process(pid).memory_full_info()
            print(
                f"actor {index}: RSS {info.rss / 1e9:.2f} GB, USS {info.uss / 1e9:.2f} GB, "
                f"PSS {info.pss / 1e9:.2f} GB"
            )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

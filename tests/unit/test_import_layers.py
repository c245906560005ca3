"""What the import contracts (pyproject.toml, `lint-imports`) promise, checked at run time in a
fresh interpreter: the planner and the simulator load neither torch nor Ray, and the control
plane loads none of the training runtime (engines, parallel plans, DeepSpeed, the rank actor)."""

from __future__ import annotations

import json
import subprocess
import sys

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
for name in {packages!r}:
    pkg = importlib.import_module(name)
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{{name}}.{{info.name}}")
print(json.dumps(sorted(sys.modules)))
"""


def _loaded_after_importing(*packages: str) -> list[str]:
    code = _IMPORT_ALL.format(packages=packages)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_planner_and_the_simulator_load_neither_torch_nor_ray():
    loaded = _loaded_after_importing("raytrain_dt.topology", "raytrain_dt.sim")
    assert [m for m in loaded if m.split(".")[0] in ("torch", "ray", "deepspeed")] == []


def test_the_control_plane_loads_no_training_runtime():
    loaded = _loaded_after_importing("raytrain_dt.control")
    runtime = (
        "deepspeed",
        "raytrain_dt.engines",
        "raytrain_dt.parallel",
        "raytrain_dt.worker.rank_actor",
    )
    assert [m for m in loaded if m.startswith(runtime)] == []

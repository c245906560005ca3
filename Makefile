# Set-up and entry points. `make demo` and `make test` each install everything they need into
# .venv first (torch before deepspeed, so deepspeed's `torch>=2.0` does not pull a CUDA build).
VENV ?= .venv
PY := $(VENV)/bin/python
# `make test` runs two pytest-xdist workers, each taking whole files (heaviest first, see
# tests/conftest.py) against its own session Ray cluster: much of a Ray test is waiting (actor
# starts, deadlines), which the other worker fills. `make test PARALLEL=` runs serially. Files
# marked `solo` (their own Ray head, whose agent must start within Ray's fixed 15 s) run after
# them, alone.
PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder
# GPU users: install the CUDA torch build for your driver instead, e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[test]"
	# The emulated accelerator (cluster.device=emulated, CPU CI's stand-in for CUDA + NCCL) is a
	# C++ torch extension: built once here (~15 s), so no test or run pays for it.
	$(PY) -m raytrain_dt.accel.emulated.build
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/raytrain-dt train conf/tiny.yaml

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	# Bytecode for the project's own modules (an editable install has none, and where
	# PYTHONDONTWRITEBYTECODE is set no process writes it): each of the suite's hundreds of
	# processes (rank actors, Ray Data workers, job drivers, rank processes) would otherwise
	# compile them from source, about 0.25 CPU-s each.
	$(PY) -m compileall -q raytrain_dt tests
	$(PY) -m pytest -q $(PARALLEL) -m "not gpu and not solo"
	$(PY) -m pytest -q -m solo

# On a GPU machine: doctor on CUDA, then the `gpu`-marked tests (deselected everywhere else).
gpu-check: install
	$(VENV)/bin/raytrain-dt doctor --device cuda
	$(PY) -m pytest -q -m gpu

lint: install
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

# A benchmark that misses its target exits non-zero; `-` lets the others run and the report render.
bench: install
	@mkdir -p runs && date +%s > runs/.bench_started
	-$(PY) bench/bench_planner.py
	-$(PY) bench/bench_memory.py
	-$(PY) bench/bench_context_parallel.py
	-$(PY) bench/bench_model_build.py
	-$(PY) bench/bench_checkpoint.py
	-$(PY) bench/bench_simulator.py
	-$(PY) bench/bench_overhead.py
	-$(PY) bench/bench_copy_cost.py
	-$(PY) bench/bench_input.py
	-$(PY) bench/bench_startup.py
	-$(PY) bench/bench_elastic.py
	-$(PY) bench/bench_gpu.py
	$(PY) bench/render.py --suite-started $$(cat runs/.bench_started)

clean:
	rm -rf $(VENV) runs data

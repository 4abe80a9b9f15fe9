# parallel_lab: `make lab` opens the lab, `make test` runs everything CI runs.
# Both set up .venv first (once). Override TORCH_SPEC / TORCH_INDEX for another torch build.
VENV        ?= .venv
PY          := $(VENV)/bin/python
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
SUDO        := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PIP         := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup lab test test-fast grade gpu-check notebooks exercises browser compiler bench lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	# torch first, pinned: a bare `torch` would let pip pick a multi-GB build it must download
	$(PIP) "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) -e ".[lab,test]"
	touch $@

lab: setup
	$(VENV)/bin/jupyter lab notebooks/00_tour.ipynb

# Headless Chromium for the browser smoke test (Debian/Ubuntu package; playwright drives it).
browser:
	@test -x /usr/bin/chromium || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

# A C++ compiler: the memory tracker builds its CPU allocator hook with it (runtime/alloc_hook.py).
compiler:
	@command -v c++ >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q g++; }

lint: setup
	$(VENV)/bin/ruff check parallel_lab tests tools benchmarks
	$(VENV)/bin/ruff format --check parallel_lab tests tools benchmarks

# The whole suite: lint, unit and multi-rank tests, exercises, browser, and every lesson and
# solution notebook executed headless by nbval (in this environment's kernel).
# PYTEST_ARGS adds pytest options, e.g. PYTEST_ARGS=--junitxml=runs/junit.xml for per-cell times.
# A figure with a glyph its font lacks (drawn as an empty box) fails the run: PYTHONWARNINGS reaches the kernels.
test: setup browser compiler lint
	PYTHONWARNINGS="error:Glyph:UserWarning" $(PY) -m pytest tests notebooks solutions --nbval-lax --nbval-current-env \
	  --nbval-cell-timeout=300 -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests -q -m "not slow and not browser"

# The one-GPU checks, a line each (a few minutes): run first whenever a GPU machine is at hand. Uses
# .venv when there is one, else the machine's python3 (a GPU image that already has torch).
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) -m pytest -m gpu tests/test_gpu_one.py -v -rs -p no:cacheprovider \
	  $(shell $(GPU_PY) -c "import pytest_timeout" 2>/dev/null && echo --timeout 300) $(PYTEST_ARGS)

# Re-execute lessons and solutions in place so they are stored with fresh outputs.
notebooks: setup
	for nb in notebooks/*.ipynb solutions/*.ipynb; do \
	  $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done

exercises: setup
	$(PY) tools/make_exercises.py

# Grade an exercise notebook: make grade NB=exercises/01_collectives.ipynb (several: NB="a.ipynb b.ipynb").
# The report's last line is the verdict; make itself stays quiet (a script wanting the exit status
# runs .venv/bin/parallel-lab grade, which exits 1 when a check did not pass).
grade: setup
	@test -n "$(NB)" || { echo "usage: make grade NB=exercises/01_collectives.ipynb"; exit 2; }
	@$(VENV)/bin/parallel-lab grade $(NB) || true

# Ratios against the torch built-ins, each measured in one run (minutes on a laptop; run it idle).
bench: setup
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/fingerprint.py
	$(PY) benchmarks/memory_overhead.py
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/zero.py
	$(PY) benchmarks/tensor_parallel.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/comm_hooks.py
	$(PY) benchmarks/summary.py

clean:
	rm -rf $(VENV) runs .pytest_cache

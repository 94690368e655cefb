# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup system demo test bench gpu-check lint protos clean

setup: $(STAMP)

# containerd, runc, FUSE, the registry, nginx (apt, as root; idempotent).
system:
	scripts/system-packages

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build that sits on disk: unpinned, pip pulls gigabytes of CUDA.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: setup system
	$(VENV)/bin/bootseer demo

# Two workers, a test file each at a time (module fixtures are built once): most tests wait on
# real servers, links and subprocesses, so CI's two cores take both (three: slower, and timing
# faults). Files in conftest's order, the longest first (xdist's own order, most tests first,
# started the 3-minute e2e file last). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: setup system
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: setup system
	$(VENV)/bin/bootseer bench $(BENCH_ARGS)

# The CUDA paths measured in one bounded run (docs/benchmarks.md, "GPU check"): needs a CUDA
# build of torch, so no `setup` here (.venv's torch is the CPU build, and the GPU machine has no
# network): GPU_PYTHON=python3 there. Without CUDA it runs its CPU form and exits 0.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) benchmarks/gpu_check.py --results bench-results $(GPU_CHECK_ARGS)

# ruff, then mypy against .mypy-baseline.json (a new error fails; scripts/mypy-baseline --update
# after fixing some lowers it). mypy cold: ~25 s, cached in .mypy_cache.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/mypy-baseline
	$(PY) -m pytest -q -p no:cacheprovider tests/test_architecture.py

# Regenerates the committed gRPC/protobuf code from prefetch/containerd/api/**/*.proto.
protos: setup
	$(PY) -m prefetch.containerd.api.generate

clean:
	rm -rf $(VENV) build *.egg-info

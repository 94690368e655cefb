# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup system demo test bench lint protos clean

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

lint: setup
	$(VENV)/bin/ruff check .

# Regenerates the committed gRPC/protobuf code from prefetch/containerd/api/**/*.proto.
protos: setup
	$(PY) -m prefetch.containerd.api.generate

clean:
	rm -rf $(VENV) build *.egg-info

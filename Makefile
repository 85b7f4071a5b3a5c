# mnn-rollout: `make demo` runs the main job, `make test` runs the tests. Both install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install system-deps demo test bench lint clean

install: $(STAMP)

# Real Prometheus and Alertmanager for the tests (Debian packages; no service is started).
system-deps:
	@command -v prometheus >/dev/null && command -v prometheus-alertmanager >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager; }
	@command -v kubectl >/dev/null || { echo "kubectl is required for the tests (install kubectl 1.28+)"; exit 1; }

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,dev]"
	touch $(STAMP)

demo: install
	$(BIN)/mnn-rollout demo

# The gRPC tests run in their own interpreter: grpc's C core beside gevent (which tritonclient.http
# loads for the REST tests) in one process crashed the gRPC server's event loop thread.
test: install system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS) --ignore=tests/runtime/test_grpc.py
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests/runtime/test_grpc.py

bench: install system-deps
	$(BIN)/python bench/runtime_overhead.py
	$(BIN)/python bench/weight_propagation.py
	$(BIN)/python bench/rollback_latency.py

clean:
	rm -rf $(VENV) build *.egg-info

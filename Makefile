# mnn-rollout: `make demo` runs the main job, `make test` runs the tests. Both install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST_ARGS ?=

.PHONY: install install-demo system-deps bench-deps demo test bench chaos lint clean

# Everything: the package with the test and dev extras (what `make test` needs).
install: $(STAMP)

# The demo needs the package and onnx (the `dev` extra builds the example models), nothing more.
install-demo: $(DEMO_STAMP)

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

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(DEMO_STAMP)

demo: install-demo
	$(BIN)/mnn-rollout demo

# The gRPC tests run in their own interpreter: grpc's C core beside gevent (which tritonclient.http
# loads for the REST tests) in one process crashed the gRPC server's event loop thread.
# The rest run in three pytest-xdist processes, a test file each at a time: run one after another
# the suite spent two thirds of its time waiting (pods starting, rollouts stepping, scrapes), and
# three at once on 2 cores took 7:47 against 17:43. PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= 3
test: install system-deps
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS) --ignore=tests/runtime/test_grpc.py
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests/runtime/test_grpc.py

# Benchmarks: wrk and h2load (Debian) drive HTTP and gRPC load; the bench extra holds the PP-OCR models and
# onnxruntime; bench/peers.py builds MLServer's own virtualenv in .bench-venv/ on first use.
bench-deps: install
	@command -v wrk >/dev/null && command -v h2load >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends wrk nghttp2-client; }
	$(BIN)/python -m pip install --quiet -e ".[test,dev,bench]"

# The chaos soak: ten minutes of operator, pod, API, watch, Prometheus and webhook faults under
# rollouts with traffic; invariants checked all along (a two-minute version runs in `make test`).
chaos: install system-deps
	$(BIN)/python bench/chaos.py --minutes 10

bench: bench-deps system-deps
	$(BIN)/python bench/serve_startup.py --before 9692ef1
	$(BIN)/python bench/runtime_overhead.py
	$(BIN)/python bench/throughput.py --seconds 3
	$(BIN)/python bench/batching.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/memory_versions.py
	$(BIN)/python bench/hot_add.py
	$(BIN)/python bench/ppocr.py
	$(BIN)/python bench/weight_propagation.py
	$(BIN)/python bench/rollback_latency.py
	$(BIN)/python bench/routing_moves.py
	$(BIN)/python bench/zero_downtime.py
	$(BIN)/python bench/operator_scale.py

clean:
	rm -rf $(VENV) .bench-venv build *.egg-info

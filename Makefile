# Two commands do all the set-up on a fresh machine:
#   make demo   the proxy in front of a simulated vLLM cluster, and a streamed request through it
#               (it installs only requirements.txt, what the proxy needs to run)
#   make test   the test suite (make check adds ruff and mypy --strict; both requirements-dev.txt)
# and, heavier: make integration   the proxy against real vLLM on the CPU with real Mooncake
#               make bench         the benchmark, ~17 minutes (make bench-quick: under a minute)
#               make bench-routing the routing benchmark (about 20 minutes)
#               make bench-routing-scale  routing's cost from 8 to 1,024 engines, in process (~2 min)
#               make chaos         requests lost while faults hit the cluster (ARGS=--quick: 1-2 min)
#               make reference     docs/reference.md from the parser, after changing a flag
#               make flow          docs/flow.md's walk of a streamed chat, after changing the module
# and, against a running proxy: make self-test PROXY=http://host:8000 [API_KEY=...]
#               which pairs of prefill engine and decode move KV over Mooncake (exit 1 if one does not)
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: demo test integration bench bench-quick bench-routing bench-routing-scale chaos reference lint check clean
.PHONY: flow self-test

# What the daemon needs to run, and no more: all that make demo installs (seconds, not minutes).
$(VENV)/.installed-run: requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

# On top of it, what the tests, the linters and the benchmarks need (the extras' heavy packages).
$(VENV)/.installed: $(VENV)/.installed-run requirements-dev.txt requirements-precise.txt requirements-tracing.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

demo: $(VENV)/.installed-run
	$(PY) tests/fake_vllm.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-bench.txt
	$(PY) bench/bench_mooncake_proxy.py --json bench.json --plot bench.png

bench-quick: $(VENV)/.installed
	$(PY) bench/bench_mooncake_proxy.py --quick

bench-routing: $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-bench.txt
	$(PY) bench/bench_routing.py --json routing.json --plot routing.png

# Simulated in process (no servers): the current router's decision time per stage, its indexes'
# memory and its hit rate against an oracle, from 8 to 1,024 prefill engines.
bench-routing-scale: $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-bench.txt
	$(PY) bench/bench_routing.py --scale --json routing-scale.json --plot routing-scale.png

# By hand, not in CI: it shows what fails, and its figures depend on timing.
chaos: $(VENV)/.installed
	$(PY) bench/bench_chaos.py $(ARGS)

integration: $(VENV)/.installed
	bash integration/run.sh

reference: $(VENV)/.installed
	$(PY) docs/reference.py

# docs/flow.md's walk of a streamed chat, after changing the module (tests/test_module_shape.py checks it).
flow: $(VENV)/.installed
	$(PY) docs/flow.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --strict mooncake_proxy.py tests bench/*.py docs/reference.py docs/flow.py \
		bench/research/request-floor/prices.py bench/research/request-floor/gc_time.py \
		bench/research/refused-prompts/measure.py bench/research/refused-prompts/gc_cost.py

check: lint test

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

# The running proxy's PD self-test (POST /admin/self-test): a line per pair, exit 1 if one fails.
PROXY ?= http://127.0.0.1:8000
API_KEY ?=
self-test:
	@curl -fsS -X POST $(if $(API_KEY),-H "Authorization: Bearer $(API_KEY)") $(PROXY)/admin/self-test \
	| python3 -c 'import json, sys; r = json.load(sys.stdin); \
	[print("ok  " if p["ok"] else "FAIL", p["prefill"], "rank", p["dp_rank"], "->", p["decode"], ":", p["why"]) for p in r["pairs"]]; \
	sys.exit(0 if r["ok"] and r["pairs"] else 1)'

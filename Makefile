# otela — the two commands a newcomer runs: `make run` and `make test`.
# Everything installs itself into .venv (project) and .cache/engine (the real tiny engine).
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt requirements-optional.txt | cksum | cut -d' ' -f1)
ENGINE := .cache/engine/.ready
PYTEST_ARGS ?=

.PHONY: run fleet test bench reliability lint venv engine sysdeps netdeps benchdeps clean

venv: $(STAMP)
$(STAMP): requirements.txt requirements-dev.txt requirements-optional.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt -r requirements-optional.txt
	rm -f $(VENV)/.installed-*; touch $@

# The real engine (llama.cpp's server from the xllamacpp wheel + SmolLM2-135M): ~15 s the first
# time; where no wheel fits, llama-cpp-python is built from source once (8-17 min).
engine: $(ENGINE)
$(ENGINE):
	tests/lab/engine_install.sh .cache/engine

# System packages the root-only tests use: headless Chromium (dashboard), and netdeps. Skipped
# without root: those tests then skip with a reason.
sysdeps: netdeps
	@if [ "$$(id -u)" = 0 ] && ! command -v chromium >/dev/null; then \
	  echo "installing chromium (dashboard test)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; \
	fi

# iproute2 and iptables: the network-namespace tests (partitions in tests/netns.py, NAT labs).
netdeps:
	@if [ "$$(id -u)" = 0 ] && ! { command -v ip >/dev/null && command -v iptables >/dev/null; }; then \
	  echo "installing iproute2 and iptables (network-namespace tests)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 iptables >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 iptables >/dev/null; }; \
	fi

lint: venv
	$(VENV)/bin/ruff check .

test: venv engine sysdeps lint
	$(VPY) -m pytest $(PYTEST_ARGS)
	@echo "--- registry and overlay tests again without the optional accelerators (orjson, uvloop)"
	OTELA_BLOCK_ACCEL=1 $(VPY) -m pytest -q tests/test_crdt.py tests/test_node_core.py tests/test_node_tunnel.py

# nginx-light: the peer the ingress is measured against in the same run (as root; without it
# the bench says nginx was skipped). netdeps: the NAT lab of the tunnel benchmarks.
benchdeps: netdeps
	@if [ "$$(id -u)" = 0 ] && ! { command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; }; then \
	  echo "installing nginx-light (the ingress benchmark's peer)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null; }; \
	fi

bench: venv benchdeps
	@mkdir -p bench-results
	@for f in tests/bench_*.py; do echo "== $$f"; $(VPY) $$f --out bench-results $(BENCH_ARGS) || exit 1; done
	@echo "figures written to bench-results/*.json"

# Fault scenarios (partition in network namespaces as root, ingress restarts, churn) against
# real processes on the fake engine: one table, and bench-results/reliability.json. A few
# minutes; RELIABILITY_ARGS=--quick for a shorter run.
reliability: venv benchdeps
	@mkdir -p bench-results
	$(VPY) tests/reliability.py --out bench-results $(RELIABILITY_ARGS)

run: venv engine
	tests/lab/local_cluster.sh

# An emulated GPU fleet (no GPU, no engine build): FLEET_N x `otela_sim.py serve` (default 8 x
# Llama-3.1-8B on H100) behind one ingress; FLEET_MODEL, FLEET_GPU, FLEET_TP choose the engines.
fleet: venv
	tests/lab/sim_fleet.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis bench-results

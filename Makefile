# The two set-up commands: `make demo` and `make test`. Both build .venv from python3 alone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test browser nats-cluster bench lint clean stack-down sim-baseline sim-sweep crash-matrix outages rehearse

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip 2>&1 | grep -v 'is ignored: it is neither' || true
	$(BIN)/pip install -q -e '.[test,embedded]' 2>&1 | grep -v 'is ignored: it is neither' || true
	$(BIN)/python -c 'import hostmove.cli, faststream, aioboto3, msgspec, pytest'
	test -x $(BIN)/nats-server -a -x $(BIN)/weed
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hostmove demo

# The suite runs on TEST_WORKERS processes (pytest-xdist): most real-stack tests wait on processes and polls, so
# four workers on two cores finish in well under half the serial time; tests/conftest.py starts the longest first.
TEST_WORKERS ?= 4
test: $(STAMP) browser
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 1

# The dashboard's browser test (tests/test_dashboard_browser.py) drives Debian's headless chromium, installed here once
# when this runs as root with apt (the CI); elsewhere it says so and the test fails. Idempotent.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver \
	      >/dev/null; }; }; } || echo "chromium is not installed (as root: apt-get install chromium chromium-driver): \
	  tests/test_dashboard_browser.py will fail"

# Each benchmark prints `RESULT <name> ratio=<x> target=<y>` last and exits non-zero below target;
# `make bench` runs them all and reports every result before failing.
BENCHES := ledger projection replication archive move sim retention readiness scale
bench: $(STAMP)
	@rc=0; for b in $(BENCHES); do $(BIN)/python -m bench.$$b || rc=1; done; exit $$rc

# Longer simulation runs, outside `make test` (which runs the gate through tests/test_sim.py: 300 seeds of the
# world with moves, 300 of the world without, the determinism check, every witness and scenario). Both use every
# core (JOBS) and are resumable: each finished run is journaled under .hostmove/sim-journal (per version of the
# code), so the same command started again after an interruption picks up where it stopped.
# `make sim-baseline SEEDS=30000`: seeds of the world with moves unmutated (and STAND_IN of the world without).
# `make sim-sweep`: each rule off alone over SWEEP_SEEDS seeds of both worlds and its witnesses; writes sim/RESULTS.md.
SEEDS ?= 3000
STAND_IN ?= 3000
SWEEP_SEEDS ?= 3000
MOVE_SEEDS ?= $(SWEEP_SEEDS)
JOBS ?= $(shell nproc)
sim-baseline: $(STAMP)
	$(BIN)/hostmove sim baseline --seeds $(SEEDS) --stand-in $(STAND_IN) --jobs $(JOBS)

sim-sweep: $(STAMP)
	$(BIN)/hostmove sim sweep --seeds $(SWEEP_SEEDS) --move-seeds $(MOVE_SEEDS) --jobs $(JOBS)

# The crash matrix at every named failpoint of a move (SIGKILL, restart, converge); `make test` runs a spread.
crash-matrix: $(STAMP)
	HOSTMOVE_CRASH_MATRIX=full $(BIN)/python -m pytest -q tests/test_crash_matrix.py

# The rehearsals of spec §14.4 on the real stack, services as processes (`hostmove rehearse --scenario ...` runs one
# on the embedded stack): a move, a clean and a dirty rollback, a stuck move retried, and §7.10's boxes that are
# gone (declare-lost, fenced-target, fenced-target-committed, fenced-source). Several minutes each.
rehearse: $(STAMP)
	HOSTMOVE_REHEARSE=1 $(BIN)/python -m pytest -q tests/test_rehearse.py

# NATS and SeaweedFS each stopped for OUTAGE_S seconds during a move (`make test` runs 15 s outages).
OUTAGE_S ?= 60
outages: $(STAMP)
	HOSTMOVE_OUTAGE_S=$(OUTAGE_S) $(BIN)/python -m pytest -q -s tests/test_outages.py -k outage_while

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy events kernel bus services projections hostmove moveprobe sim bench

stack-down: $(STAMP)
	$(BIN)/hostmove stack down

clean:
	-$(BIN)/hostmove stack down
	rm -rf $(VENV) .hostmove

# A move on the three-node JetStream cluster while its stream leader is SIGKILLed (issue 19 item 4), alone (`make
# test` runs it too).
nats-cluster: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_nats_cluster.py

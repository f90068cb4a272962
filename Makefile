# The two set-up commands: `make demo` and `make test`. Both build .venv from python3 alone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint sim-baseline sim-sweep clean stack-down

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hostmove demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.ledger
	$(BIN)/python -m bench.projection

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy events bus services projections hostmove

stack-down: $(STAMP)
	$(BIN)/hostmove stack down

clean:
	-$(BIN)/hostmove stack down
	rm -rf $(VENV) .hostmove

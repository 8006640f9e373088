# Every routine task, each one self-installing into .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench chaos serve install clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH" >&2; exit 2; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[all,dev]'
	mkdir -p /tmp/ray .ringwatch
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ringwatch demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The tests that need no Postgres, no processes, no Ray and no GPU (markers set in tests/conftest.py).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not db and not slow and not ray and not gpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check agents services api tests migrations bench
	$(BIN)/mypy agents services api

bench: $(STAMP)
	$(BIN)/python -m bench.run

chaos: $(STAMP)
	$(BIN)/python -m bench.chaos

serve: $(STAMP)
	$(BIN)/ringwatch serve

clean:
	# The embedded Postgres is stopped before its data is removed.
	if [ -x $(BIN)/ringwatch ]; then $(BIN)/ringwatch db stop; fi
	rm -rf $(VENV) .ringwatch

# Every routine task, each one self-installing into .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench chaos serve install clean lock wheel

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

# ruff, mypy, and the import contract of docs/architecture.md (which room may import which).
lint: $(STAMP)
	$(BIN)/ruff check agents services api tests migrations bench ringwatch setup.py
	$(BIN)/mypy -p ringwatch.agents -p ringwatch.services -p ringwatch.api
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_architecture.py

bench: $(STAMP)
	$(BIN)/python -m bench.run

chaos: $(STAMP)
	$(BIN)/python -m bench.chaos

serve: $(STAMP)
	$(BIN)/ringwatch serve

# ringwatch's wheel, dist/ringwatch-<version>-py3-none-any.whl: pure Python, one file for every
# role and machine (docs/install.md installs each role from it). It needs pip alone: .venv is
# made if absent (Debian's python3 may have no pip of its own), nothing is installed into it.
# build/ goes first: setuptools packs whatever an earlier build left there, a module since
# renamed or removed included.
wheel:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -rf build
	$(BIN)/python -m pip wheel -q --no-deps -w dist .
	@ls -t dist/ringwatch-*.whl | head -n 1

# The images' lock files (Dockerfile): every package a role installs, pinned with its hashes,
# for the Python and platform of the role's image. uv resolves for an interpreter other than its
# own (pip judges environment markers by the Python it runs on): the agent image's Python is
# 3.12, the api image's 3.11. constraints.txt holds torch to the version the tests run; PyPI's
# Linux wheel of it is the CUDA build. Pins already in a lock stay unless they no longer fit:
# `make lock LOCK_ARGS=--upgrade` moves every package to its newest.
lock: $(STAMP)
	$(BIN)/python -m pip install -q 'uv==0.13.9'
	$(BIN)/python -m uv pip compile pyproject.toml --extra server -c constraints.txt \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 --only-binary :all: \
		--generate-hashes --no-config --custom-compile-command 'make lock' --quiet \
		$(LOCK_ARGS) -o requirements/api.lock
	$(BIN)/python -m uv pip compile pyproject.toml --extra agent --extra ray -c constraints.txt \
		--python-version 3.12 --python-platform x86_64-manylinux_2_28 --only-binary :all: \
		--generate-hashes --no-config --custom-compile-command 'make lock' --quiet \
		$(LOCK_ARGS) -o requirements/agent.lock

clean:
	# The embedded Postgres is stopped before its data is removed.
	if [ -x $(BIN)/ringwatch ]; then $(BIN)/ringwatch db stop; fi
	rm -rf $(VENV) .ringwatch

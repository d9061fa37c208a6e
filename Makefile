# Two commands do everything on a fresh machine:  `make run`  and  `make test`.
# `make run` installs only what the app needs; `make test` adds the test extra; `make package` the packaging extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
APP_STAMP := $(VENV)/.installed-app
TEST_STAMP := $(VENV)/.installed-test
PACKAGING_STAMP := $(VENV)/.installed-packaging

.PHONY: run test test-heavy install bench package clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(APP_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

$(PACKAGING_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[packaging]'
	touch $@

install: $(APP_STAMP)

run: $(APP_STAMP)
	$(BIN)/clover-desk $(ARGS)

# the suite CI runs (under 20 minutes on 2 cores); the few tests marked heavy (a minute or more each) run with test-heavy
test: $(TEST_STAMP)
	QT_QPA_PLATFORM=offscreen QTWEBENGINE_DISABLE_SANDBOX=1 $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile -m "not heavy" $(PYTEST_ARGS)

test-heavy: $(TEST_STAMP)
	QT_QPA_PLATFORM=offscreen QTWEBENGINE_DISABLE_SANDBOX=1 $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile -m heavy $(PYTEST_ARGS)

# make bench SUITE=speed ARGS="--shape tiny"; without SUITE it lists the suites and fails (exit 2)
bench: $(APP_STAMP)
	$(BIN)/clover-desk bench $(SUITE) $(ARGS)

# the one-folder desktop bundle in dist/clover-desk (packaging/README.md); packaging/smoke_test.sh checks it
package: $(PACKAGING_STAMP)
	PYTHON=$(BIN)/python bash packaging/build.sh

clean:
	rm -rf $(VENV) build dist *.egg-info

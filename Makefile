# Two commands for a new user: `make demo` and `make test`. Both set everything up themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test dev-server worker down clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.devstack up
	$(PY) -m examples.demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The embedded Temporal dev server (SQLite under .tether/, Web UI on :8233) and the billing service.
dev-server: $(STAMP)
	$(PY) -m examples.devstack up dev-server billing

# A worker in the foreground (Ctrl-C stops it cleanly).
worker: $(STAMP)
	TEMPORAL_ADDRESS=$${TEMPORAL_ADDRESS:-127.0.0.1:7233} $(PY) worker.py

down:
	@test -x $(PY) && $(PY) -m examples.devstack down || true

clean: down
	rm -rf $(VENV) .tether *.egg-info

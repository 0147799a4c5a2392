# Two commands for a new user: `make demo` and `make test`. Both set everything up themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PYTEST_ARGS ?=
# The suite in parallel (pytest-xdist): worker processes, each with its own Temporal servers;
# most of a test's time is waiting on servers, so more processes than cores. PYTEST_ARGS comes
# after and wins: PYTEST_ARGS="-n0" runs it serially.
PYTEST_PARALLEL ?= -n 4 --dist worksteal
PLANNER ?= playbook
BENCH_ARGS ?=
REPRO_ARGS ?=

.PHONY: install demo demo-order demo-mcp test test-replay test-busy dev-server worker inbox down clean screenshots record-histories chaos bench bench-waiting bench-peer bench-scaling bench-policy bench-agentdojo

# Editable in setuptools' compat mode: the checkout's folder on the venv's path, so what runs from
# the checkout but is not installed (examples/, tests/, bench/) imports in every process
# of the venv, `.venv/bin/tether` included; `pip install .` installs only the package (pyproject.toml).
EDITABLE := --config-settings editable_mode=compat

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# agentdojo: tests/examples/test_agentdojo.py runs AgentDojo's suites through Tether.
	$(PY) -m pip install --quiet --disable-pip-version-check $(EDITABLE) -e '.[dev,agentdojo]'
	@# Bytecode up front: the workflow sandbox re-imports the workflow modules for every run,
	@# and with PYTHONDONTWRITEBYTECODE set nothing would cache them (docs/performance.md).
	$(PY) -m compileall -q workflows activities examples
	touch $(STAMP)

install: $(STAMP)

# The optional extra `bench` (pydantic-ai on Temporal, for `make bench-peer`), on top of dev.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet --disable-pip-version-check $(EDITABLE) -e '.[dev,bench]'
	touch $(BENCH_STAMP)

# PLANNER=model: the configured model plans (TETHER_MODEL, OPENAI_BASE_URL / OPENAI_API_KEY
# must be set here, since this starts the worker; `make down` first if one is running).
demo: $(STAMP)
	$(PY) -m examples.devstack up
	PLANNER=$(PLANNER) $(PY) -m examples.demo

# A new order in the dev stack's billing service, and a refund playbook for it: prints the
# playbook's path (the README's examples each refund an order of their own).
demo-order: $(STAMP)
	@$(PY) -m examples.demo order

# Tools from an MCP server (the reference git server) under approval, on a scratch repository
# under .tether/ (examples/git/, docs/mcp.md).
demo-mcp: $(STAMP)
	$(PY) -m examples.git.demo

# --durations=15: the 15 slowest tests at the end, so a test that grew slow shows in every run.
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=15 $(PYTEST_ARGS)

# The whole suite with the workflow cache off (issue 55): no worker keeps a run between its
# workflow tasks, so every task and every query of every test rebuilds its run from history.
test-replay: $(STAMP)
	TETHER_MAX_CACHED_WORKFLOWS=0 $(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The suite on a busy machine: two CPU-bound processes run beside it, stopped at the end
# whatever the result (and on Ctrl-C).
test-busy: $(STAMP)
	@pids=""; trap 'kill $$pids 2>/dev/null' EXIT INT TERM; \
	for i in 1 2; do $(PYTHON) -c 'while 1: pass' & pids="$$pids $$!"; done; \
	echo "busy loops: $$pids"; $(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The embedded Temporal dev server (SQLite under .tether/, Web UI on :8233) and the billing
# service; with TETHER_ENCRYPTION_KEY_FILE set, also the codec server the UI decodes through.
dev-server: $(STAMP)
	$(PY) -m examples.devstack up dev-server billing codec

# A worker in the foreground (Ctrl-C stops it cleanly).
worker: $(STAMP)
	$(PY) -m tether.store.keys genkey --if-missing $${TETHER_STATE_KEY_FILE:-.tether/state.key} >/dev/null
	TEMPORAL_ADDRESS=$${TEMPORAL_ADDRESS:-127.0.0.1:7233} $(PY) worker.py --policy $${TETHER_POLICY:-examples/billing/policy.toml}

# The approvers' web inbox in the foreground, with the dev sign-in on 127.0.0.1 (docs/inbox.md);
# for production give --jwks, --issuer and --audience instead (`tether inbox --help`).
inbox: $(STAMP)
	$(PY) -m examples.devstack up dev-server billing worker
	TEMPORAL_ADDRESS=$${TEMPORAL_ADDRESS:-127.0.0.1:7233} $(VENV)/bin/tether inbox --port $${TETHER_INBOX_PORT:-8900} --dev-login \
		--policy $${TETHER_POLICY:-examples/billing/policy.toml} --key .tether/keys/inbox.pem

# Refresh the screenshots from the browser tests (needs chromium; not part of `make test`):
# docs/webui-*.png and inbox-*.png (docs/web-ui.md, docs/inbox.md), and docs/screenshots/approval-*.png
# (docs/approving.md: the demo refund and a tool of one's own waiting on bob in the inbox, the CLI
# and the Web UI, and that tool's compensation page).
screenshots: $(STAMP)
	CI=true TETHER_SCREENSHOT_DIR=docs $(PY) -m pytest tests/e2e -q -p no:randomly

# Governed vs bare Temporal loop, side by side on one dev server + one worker (bench/).
bench: $(STAMP)
	$(PY) -m compileall -q workflows activities
	$(PY) -m bench.overhead $(BENCH_ARGS)
	$(PY) -m bench.parallel

# Tether governed, the bare loop and pydantic-ai on Temporal (one planning request / one request
# per call), side by side on one dev server; installs the extra `bench` (bench/peer.py).
bench-peer: $(BENCH_STAMP)
	$(PY) -m compileall -q workflows activities
	$(PY) -m bench.peer $(BENCH_ARGS)

# Cost as work grows: 5, 50 and 200 steps (continue-as-new included) and 1, 10, 100 concurrent
# runs; per-step time, events, bytes, worker CPU, snapshot/timeline query latency and size.
bench-scaling: $(STAMP)
	$(PY) -m compileall -q workflows activities
	$(PY) -m bench.scaling $(BENCH_ARGS)

# AgentDojo's v1 suites (97 user tasks, 629 security cases) as governed Tether runs, for each
# governance configuration (examples/agentdojo/policy.*.toml), judged by AgentDojo's own checks;
# the report goes to .tether/agentdojo/report.md (BENCH_ARGS="--user-tasks 3" for a part;
# "--driver pipeline": AgentDojo's own agent pipeline plans; "--faults": then again with the
# worker SIGKILLed at random and every run reset, compared with the fault-free run).
bench-agentdojo: $(STAMP)
	$(PY) -m compileall -q workflows activities examples
	$(PY) -m bench.agentdojo $(BENCH_ARGS)

# Policy decisions per second and p50/p99, the TOML rules against Cedar (no Temporal; bench/policy.py).
bench-policy: $(STAMP)
	$(PY) -m bench.policy $(BENCH_ARGS)

# 10,000 runs waiting for approval (BENCH_ARGS="--runs 2000" for fewer), then drained.
bench-waiting: $(STAMP)
	$(PY) -m compileall -q workflows activities
	$(PY) -m bench.waiting $(BENCH_ARGS)

# The long, randomized chaos run: >= 200 worker SIGKILLs at the dangerous points, summary table.
chaos: $(STAMP)
	$(PY) -m tests.chaos.run_chaos --kills 200

# 5,000 refused approvals with 2 KB comments, 1,600 decide Updates (the run continues as new
# before Temporal's 2,000-per-run limit), and a 1,000-step read-only run on the default
# continue-as-new settings, and the query storm (20 runs flooded until they continue as new, four
# timeline query loops on each); prints the figures (the short versions run in `make test`).
soak: $(STAMP)
	TETHER_SOAK=1 $(PY) -m pytest -s -q tests/workflows/test_bounded_runs.py -k "flood or long_read_only or storm"

# sdk-core reorders a local activity's result after signals when a query came in between
# (docs/known-issues.md): plain temporalio, 20 runs; exit 1 if any broke. Not in `make test`: it
# breaks some runs, not all.
.PHONY: sdk-core-repro
sdk-core-repro: $(STAMP)
	$(PY) -m tests.helpers.sdk_core_repro $(REPRO_ARGS)

# Re-record tests/histories/*.json (the replay suite's reference runs). Only for a workflow
# change that is compatible by design: see docs/changing-workflows.md.
record-histories: $(STAMP)
	$(PY) -m tests.histories.record

down:
	@test -x $(PY) && $(PY) -m examples.devstack down || true

clean: down
	rm -rf $(VENV) .tether *.egg-info

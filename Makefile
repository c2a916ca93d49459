# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-e2e ui ui-stop bench soak scale clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pipelines.demo

# Lint, types, the import contracts (pyproject.toml, docs/design.md) and the suite without the `slow` tests, on 2 workers (pytest-xdist); a file's
# tests stay on one worker (--dist loadfile), so a module's fixtures (spawned ranks) start once.
# No test here reaches a package index. About 3 to 4 minutes on 2 quiet cores.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

# The `slow` tests, end to end: the real dagster-daemon on SQLite and on PostgreSQL
# (+ dagster-webserver), the browser test (headless Chromium against `dagster dev` after the
# demo), `make ui` stopped by signals, the demo and the lifecycle in-process (local and S3 archive),
# savers killed with SIGKILL, Lightning's two-process DDP, the HF Trainer, four gloo ranks on S3,
# the MLflow server, peak-RSS measurements of restores, every flipped bit of the zstd frames, a
# crash at every S3 operation, and pip installs into fresh virtual environments (these reach the
# package index). .ci/run runs `make test` and then this.
test-e2e: $(STAMP)
	$(PY) -m pytest -q -m slow

# The Dagster UI (webserver + daemon) on http://127.0.0.1:$(UI_PORT). Stop it with Ctrl-C, or
# `make ui-stop` (or a SIGTERM to make) when it was started in the background.
UI_HOME ?= $(CURDIR)/.dagster_home
UI_PORT ?= 3000
ui: $(STAMP)
	mkdir -p $(UI_HOME)
	test -f $(UI_HOME)/dagster.yaml || cp pipelines/instance/local.yaml $(UI_HOME)/dagster.yaml
	DAGSTER_HOME=$(UI_HOME) exec $(PY) -m pipelines.ui --port $(UI_PORT)

ui-stop:
	@if [ -f $(UI_HOME)/ui.pid ]; then kill $$(cat $(UI_HOME)/ui.pid) && echo "asked the Dagster UI to stop"; \
	else echo "no Dagster UI started by make ui is running ($(UI_HOME)/ui.pid is absent)"; fi

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/save_restore.py --size-mb 256
	$(PY) benchmarks/save_restore.py --real
	$(PY) benchmarks/codecs_motion.py --steps 100
	$(PY) benchmarks/small_tensors.py --steps 12

scale: $(STAMP)
	$(PY) benchmarks/scale.py --checkpoints 10000 --partitions 40000 --expire 10000
	$(PY) benchmarks/ranks_s3.py

soak: $(STAMP)
	$(PY) tests/soak/soak.py --kills 200

clean:
	rm -rf $(VENV) .demo .bench .pytest_cache .ci/artifacts

# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-e2e ui bench soak scale clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pipelines.demo

# Lint, types, the import contracts (pyproject.toml, docs/design.md) and the suite without the `slow` tests, on 2 workers (pytest-xdist); a file's
# tests stay on one worker (--dist loadfile), so a module's fixtures (spawned ranks) start once.
# No test here reaches a package index. About 3 minutes on 2 quiet cores.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

# The `slow` tests, end to end: the real dagster-daemon on SQLite and on PostgreSQL
# (+ dagster-webserver), the browser test (headless Chromium against `dagster dev` after the
# demo), the demo and the lifecycle with an S3 archive in-process, savers killed with SIGKILL,
# Lightning's two-process DDP, and pip installs into fresh virtual environments (these reach
# the package index). .ci/run runs `make test` and then this.
test-e2e: $(STAMP)
	$(PY) -m pytest -q -m slow

ui: $(STAMP)
	mkdir -p .dagster_home
	test -f .dagster_home/dagster.yaml || cp pipelines/instance/local.yaml .dagster_home/dagster.yaml
	DAGSTER_HOME=$(CURDIR)/.dagster_home $(VENV)/bin/dagster dev -w workspace.yaml

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/save_restore.py --size-mb 256
	$(PY) benchmarks/save_restore.py --real
	$(PY) benchmarks/codecs_motion.py --steps 100

scale: $(STAMP)
	$(PY) benchmarks/scale.py --checkpoints 10000 --partitions 40000 --expire 10000
	$(PY) benchmarks/ranks_s3.py

soak: $(STAMP)
	$(PY) tests/soak/soak.py --kills 200

clean:
	rm -rf $(VENV) .demo .bench .pytest_cache .ci/artifacts

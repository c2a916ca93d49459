# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test ui bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pipelines.demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

ui: $(STAMP)
	mkdir -p .dagster_home
	DAGSTER_HOME=$(CURDIR)/.dagster_home $(VENV)/bin/dagster dev -w workspace.yaml

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/save_restore.py --size-mb 256
	$(PY) benchmarks/save_restore.py --real
	$(PY) benchmarks/codecs_motion.py --steps 100

clean:
	rm -rf $(VENV) .demo .bench .pytest_cache

# The two commands: `make run` and `make test` (README). Each does its own set-up, idempotently.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: run test install services migrate demo-models bench

install:
	@scripts/bootstrap.sh

services:
	@scripts/services.sh up

migrate: install services
	@$(PY) manage.py migrate --no-input -v0

run: install services
	@scripts/run.sh

# The suite in TEST_WORKERS processes (pytest-xdist), whole test files to each; the 30 slowest tests printed.
TEST_WORKERS ?= 4
test: install services
	@scripts/test.sh -n $(TEST_WORKERS) --dist loadfile --durations=30

demo-models: migrate
	@$(PY) manage.py build_demo_models

bench: install services
	@$(PY) bench/engine.py && $(PY) bench/metadata.py && $(PY) bench/read_path.py

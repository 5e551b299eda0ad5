# The two commands: `make run` and `make test` (README). Each does its own set-up, idempotently.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: run test install services secret-key migrate demo-models bench

install:
	@scripts/bootstrap.sh

services:
	@scripts/services.sh up

# The checkout's SECRET_KEY, made once as run.sh makes it, so manage.py runs before a first `make run`.
secret-key: install
	@mkdir -p var; if [[ -z "$${SECRET_KEY:-}" && ! -s var/secret_key ]]; then \
	  (umask 077 && $(PY) -c "import secrets; print(secrets.token_urlsafe(50))" >var/secret_key); fi

migrate: install services secret-key
	@$(PY) manage.py migrate --no-input -v0

# In a terminal, run.sh gets a process group of its own (set -m), which the terminal's Ctrl-C goes to:
# make, left out of it, does not die of the SIGINT, and ends with run.sh's exit status (0 on Ctrl-C).
# run.sh is not the recipe's last command: bash would exec it in the shell's place, in make's group.
run: install services
	@if [[ -t 0 ]]; then set -m; fi; scripts/run.sh; status=$$?; exit $$status

# The suite in TEST_WORKERS processes (pytest-xdist), whole test files to each; the 30 slowest tests printed.
TEST_WORKERS ?= 4
test: install services
	@scripts/test.sh -n $(TEST_WORKERS) --dist loadfile --durations=30

demo-models: migrate
	@$(PY) manage.py build_demo_models

bench: install services
	@$(PY) bench/engine.py && $(PY) bench/metadata.py && $(PY) bench/read_path.py

#!/usr/bin/env bash
# Run the suite (slow tests included) against the real services. Called by `make test`, which adds
# `-n N` (pytest-xdist: N worker processes, each with a test database, a Redis database and an
# archive folder of its own: tests/worker_isolation.py). Without -n the suite runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Tests use their own Redis databases (8-15; a worker gwN uses the first + N) and archive folder,
# apart from a running `make run` (0), the benches (1) and other isolated runs.
export REDIS_URL=${TEST_REDIS_URL:-redis://127.0.0.1:6379/8}
export SPECOPS_ARCHIVE_DIR=${TEST_ARCHIVE_DIR:-$PWD/var/test-archive}
export SPECOPS_MODEL_DIR=${TEST_MODEL_DIR:-$PWD/var/test-models}
# Workers run the static forward path but build no compiled forward in the background (a build is
# minutes of both cores); the compile tests build their own packages.
export SPECOPS_COMPILE_BACKGROUND=${TEST_COMPILE_BACKGROUND:-false}
export SPECOPS_COMPILE_DIR=${TEST_COMPILE_DIR:-$PWD/var/test-compiled}
# DEBUG stays off (the default, as in production); a key of the tests' own lets Django start,
# and var/secret_key (a `make run` of this checkout) is not read.
export SECRET_KEY=${TEST_SECRET_KEY:-test-only-secret-key-not-for-production-0123456789} SECRET_KEY_FILE=
# Rate limits of the tests' own: the suite makes many requests from few tokens. The throttling
# tests set theirs.
export SPECOPS_THROTTLE_USER_RATE=${TEST_THROTTLE_RATE:-100000/min}
export SPECOPS_THROTTLE_TENANT_RATE=${TEST_THROTTLE_RATE:-100000/min}
export SPECOPS_THROTTLE_GENERATION_RATE=${TEST_THROTTLE_RATE:-100000/min}
# pytest's temporary folders under a root of this run's database name: runs of other checkouts
# or databases on this machine share /tmp/pytest-of-$USER otherwise, and one run's clean-up of
# "old" numbered folders took another run's folder away mid-run (its workers' logs with it).
url_db=${DATABASE_URL:-specops}; url_db=${url_db%%\?*}; url_db=${url_db##*/}
export PYTEST_DEBUG_TEMPROOT=${TEST_TMP_ROOT:-/tmp/specops-pytest-$url_db}
mkdir -p "$PYTEST_DEBUG_TEMPROOT"
# The plugin must be importable before pytest-django reads the settings (it sets each xdist
# worker's environment), so the checkout goes on the path.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec .venv/bin/pytest -p tests.worker_isolation "$@"

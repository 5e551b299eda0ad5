#!/usr/bin/env bash
# Run the whole suite (slow tests included) against the real services. Called by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Tests use their own Redis database and archive folder, apart from a running `make run`.
export REDIS_URL=${TEST_REDIS_URL:-redis://127.0.0.1:6379/14}
export SPECOPS_ARCHIVE_DIR=${TEST_ARCHIVE_DIR:-$PWD/var/test-archive}
export SPECOPS_MODEL_DIR=${TEST_MODEL_DIR:-$PWD/var/test-models}
# DEBUG stays off (the default, as in production); a key of the tests' own lets Django start,
# and var/secret_key (a `make run` of this checkout) is not read.
export SECRET_KEY=${TEST_SECRET_KEY:-test-only-secret-key-not-for-production-0123456789} SECRET_KEY_FILE=
# Rate limits of the tests' own: the suite makes many requests from few tokens. The throttling
# tests set theirs.
export SPECOPS_THROTTLE_USER_RATE=${TEST_THROTTLE_RATE:-100000/min}
export SPECOPS_THROTTLE_TENANT_RATE=${TEST_THROTTLE_RATE:-100000/min}
export SPECOPS_THROTTLE_GENERATION_RATE=${TEST_THROTTLE_RATE:-100000/min}
exec .venv/bin/pytest "$@"

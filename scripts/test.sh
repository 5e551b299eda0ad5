#!/usr/bin/env bash
# Run the whole suite (slow tests included) against the real services. Called by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Tests use their own Redis database and archive folder, apart from a running `make run`.
export REDIS_URL=${TEST_REDIS_URL:-redis://127.0.0.1:6379/14}
export SPECOPS_ARCHIVE_DIR=${TEST_ARCHIVE_DIR:-$PWD/var/test-archive}
export SPECOPS_MODEL_DIR=${TEST_MODEL_DIR:-$PWD/var/test-models}
exec .venv/bin/pytest "$@"

"""What each pytest-xdist worker has of its own, set before Django reads its settings.

``make test`` runs the suite in several worker processes (pytest-xdist); scripts/test.sh loads
this plugin with ``-p tests.worker_isolation`` because a conftest.py is read only after
pytest-django has imported the settings, which read the environment once. In worker ``gwN``:

- ``REDIS_URL`` (Django's cache, the two-tier cache, and the Celery broker of the workers the
  tests start, which defaults to it) names Redis database base + N, where base is the database
  of the URL scripts/test.sh exported (TEST_REDIS_URL, 8 by default); the suite's databases are
  8-15, so a run has at most 8 workers. The worker empties its database when it starts: a killed
  run's queued tasks must not reach this run's workers.
- ``SPECOPS_ARCHIVE_DIR`` is a folder of the worker's own.

The rest needs nothing here: pytest-django names each worker's test database ``..._gwN`` (the
replica and direct aliases mirror it), the AMQP vhost is named after that database
(tests/helpers.py ``amqp_url``), the processes tests start listen on free ports, and the tiny
models are built once under a file lock (tests/conftest.py). Outside xdist this does nothing.
"""
from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import pytest

SUITE_REDIS_DATABASES = range(8, 16)


def worker_number() -> int | None:
    """N of this xdist worker ``gwN`` (xdist sets the variable before the worker reads its
    configuration), or None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return int(worker.removeprefix("gw")) if worker else None


def redis_url_of_worker(base_url: str, number: int) -> str:
    """``base_url`` with database base + ``number``; refused outside the suite's databases."""
    parts = urlsplit(base_url)
    database = int(parts.path.strip("/") or 0) + number
    if database not in SUITE_REDIS_DATABASES:
        raise pytest.UsageError(
            f"xdist worker gw{number} would use Redis database {database} of {base_url}: the suite's workers use "
            f"{SUITE_REDIS_DATABASES.start}-{SUITE_REDIS_DATABASES.stop - 1} (TEST_REDIS_URL names the first; "
            "fewer workers with -n)")
    return urlunsplit(parts._replace(path=f"/{database}"))


_number = worker_number()
if _number is not None:
    os.environ["REDIS_URL"] = redis_url_of_worker(os.environ["REDIS_URL"], _number)
    os.environ["SPECOPS_ARCHIVE_DIR"] = os.path.join(os.environ["SPECOPS_ARCHIVE_DIR"], f"gw{_number}")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _number is None:
        return
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        client.flushdb()
    finally:
        client.close()

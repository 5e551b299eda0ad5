"""Gunicorn settings used by `make run` and the systemd unit: ASGI workers (uvicorn).

Each worker process runs one uvicorn event loop: an open SSE stream is a coroutine waiting on
Redis, not a thread, so streams cannot stall the rest of the API (under gthread, 2 workers x 4
threads meant 8 open streams stopped every other request). Sync views (the DRF API, the admin)
run in Django's thread pool. ``uvicorn_worker`` is the maintained home of ``UvicornWorker``
(``uvicorn.workers`` is deprecated).
"""
import os

from prometheus_client import multiprocess

worker_class = "uvicorn_worker.UvicornWorker"
# A long generation's stream is not a hung worker: uvicorn workers notify the arbiter on their
# own; timeout only bounds a worker that stopped doing so.
timeout = 120
graceful_timeout = 30  # streams still open after this are cut at shutdown


def child_exit(server, worker) -> None:
    """Drop a dead worker's live gauges from the shared PROMETHEUS_MULTIPROC_DIR (when there is one)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(worker.pid)

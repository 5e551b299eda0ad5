"""Gunicorn settings used by `make run` and the systemd unit."""
from prometheus_client import multiprocess


def child_exit(server, worker) -> None:
    """Drop a dead worker's live gauges from the shared PROMETHEUS_MULTIPROC_DIR."""
    multiprocess.mark_process_dead(worker.pid)

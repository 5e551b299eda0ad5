"""The Celery app: per-device queues for models, a maintenance queue for beat jobs.

Queues: ``cpu``, one ``gpu.N`` per visible CUDA device, and ``maintenance``. An inference task is
sent to its target model version's queue (``ModelVersion.queue``, from the version's device) by
``inference.submission.submit_generation``; beat jobs go to ``maintenance`` by task name.
"""
from __future__ import annotations

import os

from celery import Celery
from celery.signals import worker_process_shutdown, worker_shutdown
from kombu import Queue

from specops.conf import cuda_visible_devices, prometheus_multiproc_dir

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")

app = Celery("specops")
app.config_from_object("django.conf:settings", namespace="CELERY")

CPU_QUEUE = "cpu"
MAINTENANCE_QUEUE = "maintenance"


def gpu_queue(index: int) -> str:
    return f"gpu.{index}"


def visible_gpu_count() -> int:
    """Count CUDA devices without importing torch in processes that never run a model."""
    visible = cuda_visible_devices()
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() not in ("", "-1")])
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch or no driver: a CPU host
        return 0


app.conf.update(
    # gpu.N queues are declared on demand (task_create_missing_queues) by the workers that own them.
    task_queues=[Queue(CPU_QUEUE), Queue(MAINTENANCE_QUEUE)],
    task_create_missing_queues=True,
    task_default_queue=CPU_QUEUE,
    # Beat jobs (partition rotation, index rotation, cache snapshots, gauges) never wait behind
    # a generation on a model queue.
    task_routes={
        "metadata.*": {"queue": MAINTENANCE_QUEUE},
        "specops.*": {"queue": MAINTENANCE_QUEUE},
    },
    # Model queues: a worker reserves one message per execution slot (--concurrency x prefetch 1;
    # with the threads pool, the sessions its batching loop holds), each acknowledged after it ran
    # and redelivered when the worker dies (writes are idempotent: a redelivery duplicates nothing).
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_proc_alive_timeout=120,
    task_track_started=True,
    broker_connection_retry_on_startup=True,
    timezone="UTC",
)
app.autodiscover_tasks()


@worker_shutdown.connect
@worker_process_shutdown.connect
def forget_metrics_of_this_process(pid: int | None = None, **kwargs) -> None:
    """Drop this process's live gauges from the shared metrics directory when it exits
    (worker_shutdown: the threads pool's worker itself; worker_process_shutdown: a prefork child)."""
    if prometheus_multiproc_dir():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid())

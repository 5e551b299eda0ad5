"""The Celery app: per-device queues for models, a maintenance queue for beat jobs.

Queues: ``cpu``, one ``gpu.N`` per visible CUDA device, and ``maintenance``. A session's task
(``sessions.generate``) is sent to its target model version's queue (``ModelVersion.queue``, from
the version's device) by ``sessions.submission``; beat jobs go to ``maintenance`` by task name.
"""
from __future__ import annotations

import importlib
import os

from celery import Celery
from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_shutdown
from kombu import Queue

from core.conf import prometheus_multiproc_dir
from core.queues import CPU_QUEUE, MAINTENANCE_QUEUE, gpu_queue, visible_gpu_count  # noqa: F401  (re-exported)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")

app = Celery("specops")
app.config_from_object("django.conf:settings", namespace="CELERY")

app.conf.update(
    # gpu.N queues are declared on demand (task_create_missing_queues) by the workers that own them.
    task_queues=[Queue(CPU_QUEUE), Queue(MAINTENANCE_QUEUE)],
    task_create_missing_queues=True,
    # every worker also consumes a queue of its own (<node>.dq2): conversation affinity sends a
    # prompt extending a recent one to the worker whose prefix cache holds it (inference/affinity.py)
    worker_direct=True,
    task_default_queue=CPU_QUEUE,
    # Beat jobs (partition rotation, index rotation, cache snapshots, gauges) never wait behind
    # a generation on a model queue.
    task_routes={
        "metadata.*": {"queue": MAINTENANCE_QUEUE},
        "ops.*": {"queue": MAINTENANCE_QUEUE},
        "inference.reconcile_sessions": {"queue": MAINTENANCE_QUEUE},
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

# Task modules that no import chain of a web or beat process may reach (autodiscovery runs in
# workers only): beat schedules ``inference.reconcile_sessions`` by name, and a web process sends
# ``sessions.generate`` through its task object. Registered once the app is finalized.
EAGER_TASK_MODULES = ("sessions.tasks", "inference.tasks")


@app.on_after_finalize.connect
def register_task_modules(sender: Celery, **kwargs) -> None:
    for module in EAGER_TASK_MODULES:
        importlib.import_module(module)


# How much longer than the longest generation task the Redis broker waits before it gives an
# unacknowledged task back (the task thread waits GENERATION_TIMEOUT_S + 60 s at most:
# inference.worker.lifecycle.WAIT_MARGIN_S).
VISIBILITY_MARGIN_S = 120


def visibility_timeout_s(generation_timeout_s: float, task_time_limit_s: float | None) -> int:
    """The Redis transport's ``visibility_timeout``: past the longest a generation task may hold
    its message, so a live worker's task is never handed to a second worker while it runs.

    Celery's default (1 hour) would leave a dead worker's message unacknowledged for an hour; the
    reconciler (``inference.reconcile_sessions``) re-enqueues such a session once its lease lapses,
    and the redelivery that follows after this timeout finds it claimed or finished and does nothing.
    """
    longest = max(generation_timeout_s + 60, task_time_limit_s or 0)
    return int(longest + VISIBILITY_MARGIN_S)


# Message priorities, 0-9 (``sessions.submission.broker_priority``: a tenant with fewer sessions
# in flight is ahead): one Redis list per level, so the broker hands out the most urgent first.
PRIORITY_STEPS = list(range(10))


@app.on_after_configure.connect
def set_visibility_timeout(sender: Celery, **kwargs) -> None:
    """Derive the visibility timeout from the settings once they are read (an explicit
    CELERY_BROKER_TRANSPORT_OPTIONS visibility_timeout wins; RabbitMQ ignores it), and the
    priority levels: the Redis transport's ``priority_steps`` (its default, 0/3/6/9, would fold
    the levels into four), RabbitMQ's ``x-max-priority`` on the queues when
    ``SPECOPS_AMQP_QUEUE_MAX_PRIORITY`` asks for it (RabbitMQ refuses to redeclare a queue with
    other arguments, so an existing queue must be deleted first: docs/operations.md)."""
    from django.conf import settings

    options = dict(sender.conf.broker_transport_options or {})
    options.setdefault("visibility_timeout", visibility_timeout_s(
        float(settings.SPECOPS_GENERATION_TIMEOUT_S), sender.conf.task_time_limit))
    options.setdefault("priority_steps", PRIORITY_STEPS)
    sender.conf.broker_transport_options = options
    if settings.SPECOPS_AMQP_QUEUE_MAX_PRIORITY and sender.conf.task_queue_max_priority is None:
        sender.conf.task_queue_max_priority = settings.SPECOPS_AMQP_QUEUE_MAX_PRIORITY


@worker_init.connect
@worker_process_init.connect
def start_tracing(**kwargs) -> None:
    """Tracing per worker process (SPECOPS_TRACING; nothing when off): worker_init for the threads
    and solo pools, worker_process_init in each prefork child. Idempotent."""
    from core.tracing import configure_tracing

    configure_tracing("specops-worker")


@worker_shutdown.connect
@worker_process_shutdown.connect
def forget_metrics_of_this_process(pid: int | None = None, **kwargs) -> None:
    """Drop this process's live gauges from the shared metrics directory when it exits
    (worker_shutdown: the threads pool's worker itself; worker_process_shutdown: a prefork child)."""
    if prometheus_multiproc_dir():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid())

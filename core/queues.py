"""The Celery queue names, in one place: every task, route and beat job names its queue from here.

Queues: ``cpu``, one ``gpu.N`` per visible CUDA device, and ``maintenance`` (beat jobs, the
reconciler). Kept apart from the Celery app (``specops.celery``) so the apps can name a queue
without importing the project shell.
"""
from __future__ import annotations

from core.conf import cuda_visible_devices

CPU_QUEUE = "cpu"
MAINTENANCE_QUEUE = "maintenance"


def gpu_queue(index: int) -> str:
    return f"gpu.{index}"


def is_device_queue(name: str) -> bool:
    """Whether ``name`` is a device's queue (its worker runs models): ``cpu`` or ``gpu.N``."""
    return name == CPU_QUEUE or name.startswith("gpu.")


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

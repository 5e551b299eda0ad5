"""The message that runs a session on its model's device queue, and who runs it.

Submission and the reconciler send ``generate`` (``send_generation``) to a device queue; a device
worker runs it with the runner serving registers when its app is ready (``run_with``:
``inference.apps``), so this package defines and sends the message without importing a worker.
"""
from __future__ import annotations

from collections.abc import Callable

from celery import shared_task

GENERATE_TASK = "sessions.generate"

# (task, session id, tenant id or None, deferrals so far) -> the session's status when the run ends
Runner = Callable[..., str]
_runner: Runner | None = None


def run_with(runner: Runner) -> None:
    """The function this process runs ``generate`` with (a device worker's)."""
    global _runner
    _runner = runner


# ignore_result: nothing reads a generation task's result (the session row is the outcome)
@shared_task(name=GENERATE_TASK, acks_late=True, reject_on_worker_lost=True, bind=True, ignore_result=True)
def generate(self, session_id: str, tenant=None, deferrals: int = 0) -> str:
    """Run one session (idempotent: the claim lets one delivery run it).

    ``tenant`` (the session's tenant id, sent by submission) lets the worker decide its threads'
    share across tenants without a query; ``deferrals`` counts how often the worker put the
    message back over its tenant's share.
    """
    if _runner is None:
        raise RuntimeError(f"{GENERATE_TASK}: this process registered no runner (sessions.tasks.run_with)")
    return _runner(self, session_id, tenant, deferrals)


def send_generation(session_id, queue: str, *, tenant=None, priority: int | None = None) -> None:
    """Send the session's ``generate`` to ``queue``; the broker's error, if any, is raised.

    ``ignore_result``: the session row is the outcome, and without it the Redis result backend
    subscribed the sending process to each task's result channel, a SUBSCRIBE round trip per
    request (a sixth of a POST's time, bench/README.md "Generation POST") and subscriptions that
    were never dropped.
    """
    kwargs = {"tenant": tenant} if tenant is not None else {}
    generate.apply_async(args=[str(session_id)], kwargs=kwargs, queue=queue, priority=priority, ignore_result=True)

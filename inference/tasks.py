"""Celery tasks of the inference app: ``generate`` runs on its model's device queue, the
reconciler (a beat job) on the ``maintenance`` queue."""
from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import celeryd_after_setup

from core.queues import MAINTENANCE_QUEUE
from inference import affinity

logger = logging.getLogger(__name__)


@celeryd_after_setup.connect
def remember_node(sender: str, instance=None, **kwargs) -> None:
    """This worker's node name, which conversation affinity records and routes to (affinity.py)."""
    affinity.set_node(sender)


# ignore_result: nothing reads a generation task's result (the session row is the outcome)
@shared_task(name="inference.generate", acks_late=True, reject_on_worker_lost=True, bind=True, ignore_result=True)
def generate(self, session_id: str) -> str:
    """Run the speculative generation of one session (idempotent: see lifecycle.run_session)."""
    affinity.set_node(self.request.hostname or None)  # where the signal did not reach (a test's worker)
    # Imported here so the web process, which only enqueues, never loads torch and the engine.
    from inference.worker.batching_loop import device_loop
    from inference.worker.lifecycle import run_session
    from metadata.replicas.lsn import primary_only

    # The session was written a moment ago by the API: a replica may not have replayed it yet.
    with primary_only():
        return run_session(session_id, submit=lambda job: device_loop().submit(job))


@shared_task(name="inference.canary_replay", ignore_result=True, acks_late=True)
def canary_replay(session_id: str) -> str:
    """Replay a finished generation target-only and compare (inference/worker/canary.py); on its device queue."""
    from inference.worker.batching_loop import device_loop
    from inference.worker.canary import replay
    from metadata.replicas.lsn import primary_only

    with primary_only():  # the session ended a moment ago: a replica may not have replayed its rows
        return replay(session_id, generate=device_loop().replay)


@shared_task(name="inference.reconcile_sessions", queue=MAINTENANCE_QUEUE, ignore_result=True,
             soft_time_limit=60, time_limit=90)
def reconcile_sessions() -> dict:
    """Re-enqueue or fail the sessions whose worker died or whose task was lost (beat, every 15 s)."""
    from inference.worker.reconciler import reconcile_sessions as reconcile
    from metadata.partitions import MaintenanceLockBusy

    try:
        return reconcile().as_dict()
    except MaintenanceLockBusy as exc:
        logger.info("reconcile_sessions skipped: %s", exc)
        return {"skipped": str(exc)}

"""Celery tasks of the inference app; each runs on the queue of its model's device."""
from __future__ import annotations

from celery import shared_task


@shared_task(name="inference.generate", acks_late=True, reject_on_worker_lost=True)
def generate(session_id: str) -> str:
    """Run the speculative generation of one session (idempotent: see generation.run_session)."""
    # Imported here so the web process, which only enqueues, never loads torch and the engine.
    from inference.worker.session_run import run_session
    from metadata.replicas.lsn import primary_only

    # The session was written a moment ago by the API: a replica may not have replayed it yet.
    with primary_only():
        return run_session(session_id)

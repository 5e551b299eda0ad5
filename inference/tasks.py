"""Celery tasks of the inference app; each runs on the queue of its model's device."""
from __future__ import annotations

from celery import shared_task


@shared_task(name="inference.generate", acks_late=True, reject_on_worker_lost=True)
def generate(session_id: str) -> str:
    """Run the speculative generation of one session (idempotent: see generation.run_session)."""
    # Imported here so the web process, which only enqueues, never loads torch and the engine.
    from inference.generation import run_session

    return run_session(session_id)

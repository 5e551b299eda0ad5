"""Celery tasks of the inference app, and how a device worker runs a session's task.

``run_generation`` is what a device worker does with ``sessions.generate`` (registered as its
runner by ``InferenceConfig.ready``): its threads' share across tenants, then the session's run
in the device's batch. ``canary_replay`` runs on a device queue, ``reconcile_sessions`` (a beat
job) on the ``maintenance`` queue.
"""
from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import celeryd_after_setup
from celery.utils.nodenames import WORKER_DIRECT_EXCHANGE, worker_direct

from core.beat_jobs import PeriodicJob
from core.queues import MAINTENANCE_QUEUE
from inference import affinity
from sessions.tasks import generate

logger = logging.getLogger(__name__)


@celeryd_after_setup.connect
def remember_node(sender: str, instance=None, **kwargs) -> None:
    """This worker's node name, which conversation affinity records and routes to (affinity.py),
    and its threads' share across tenants (inference/worker/claim_share.py)."""
    affinity.set_node(sender)
    threads = getattr(instance, "concurrency", None)
    if isinstance(threads, int) and threads > 0 and getattr(instance, "pool_cls", None) is not None:
        from inference.conf import conf
        from inference.worker import claim_share

        share = claim_share.configure(threads, conf.MAX_BATCH, conf.CLAIM_RESERVE)
        if share is not None:
            logger.info("claim share: %d threads, %d kept for tenants under their floor, %d rows",
                        share.threads, share.reserve, share.rows)


def run_generation(task, session_id: str, tenant=None, deferrals: int = 0) -> str:
    """Run the speculative generation of one session (idempotent: see lifecycle.run_session).

    ``tenant`` (the session's tenant id, sent by submission) lets the worker's claim share decide
    without a query; a message over its tenant's share goes back to the broker with a countdown
    (``deferrals`` counts how often it did) and the task returns "deferred".
    """
    affinity.set_node(task.request.hostname or None)  # where the signal did not reach (a test's worker)
    # Imported here so the web process, which only enqueues, never loads torch and the engine.
    from inference.worker import claim_share
    from inference.worker.batching_loop import device_loop
    from inference.worker.lifecycle import run_session
    from metadata.replicas.lsn import primary_only

    # The session was written a moment ago by the API: a replica may not have replayed it yet.
    with primary_only():
        share, holds = claim_share.current(), False
        if share is not None:
            tenant = tenant if tenant is not None else session_tenant(session_id)
            holds = share.try_take(tenant)
            # over its share: back to the broker (if the broker refuses it, it runs over the share)
            if not holds and defer(task, session_id, tenant, deferrals):
                return DEFERRED
        try:
            return run_session(session_id, submit=lambda job: device_loop().submit(job))
        finally:
            if holds:
                share.give_back(tenant)


DEFERRED = "deferred"


def session_tenant(session_id: str):
    """The session's tenant id (a message without one: the reconciler's, or an older API's)."""
    from metadata.models import Session

    return Session.objects.filter(pk=session_id).values_list("tenant_id", flat=True).first()


def defer(task, session_id: str, tenant, deferrals: int) -> bool:
    """Send the session's message back to its queue with a countdown; False if the broker refused.

    The new message is published before this one is acknowledged (acks_late): a crash between the
    two leaves a duplicate, which the claim makes harmless, never a lost session.
    """
    from inference.worker import metrics
    from inference.worker.claim_share import deferral_countdown_s

    delivery = task.request.delivery_info or {}
    queue = delivery.get("routing_key") or None
    if queue and delivery.get("exchange") == WORKER_DIRECT_EXCHANGE.name:  # an affinity route: the same node
        queue = worker_direct(queue)
    try:
        generate.apply_async(args=[session_id], kwargs={"tenant": tenant, "deferrals": deferrals + 1},
                             queue=queue, priority=delivery.get("priority"),
                             countdown=deferral_countdown_s(deferrals), ignore_result=True)
    except Exception:
        logger.exception("session %s: its deferral could not be sent; it runs over its tenant's share", session_id)
        return False
    metrics.CLAIM_DEFERRALS.inc()
    return True


@shared_task(name="inference.canary_replay", ignore_result=True, acks_late=True)
def canary_replay(session_id: str) -> str:
    """Replay a finished generation target-only and compare (inference/worker/canary.py); on its device queue."""
    from inference.worker.batching_loop import device_loop
    from inference.worker.canary import replay
    from metadata.replicas.lsn import primary_only

    with primary_only():  # the session ended a moment ago: a replica may not have replayed its rows
        return replay(session_id, generate=device_loop().replay)


def periodic_jobs() -> list[PeriodicJob]:
    """Registered by inference migration 0008: with the 30 s lease, a dead worker's session is back
    on its queue within ~45 s."""
    return [PeriodicJob("specops: reconcile sessions", "inference.reconcile_sessions", 0, every_seconds=15)]


@shared_task(name="inference.reconcile_sessions", queue=MAINTENANCE_QUEUE, ignore_result=True,
             soft_time_limit=60, time_limit=90)
def reconcile_sessions() -> dict:
    """Re-enqueue or fail the sessions whose worker died or whose task was lost
    (``sessions.runs.reconciler``), then delete expired ``Idempotency-Key`` rows (beat, every 15 s)."""
    from inference import idempotency
    from metadata.partitions import MaintenanceLockBusy
    from sessions.runs import reconcile_sessions as reconcile

    try:
        report = reconcile().as_dict()
    except MaintenanceLockBusy as exc:
        logger.info("reconcile_sessions skipped: %s", exc)
        return {"skipped": str(exc)}
    report["keys_expired"] = idempotency.purge_expired()
    return report

"""A device worker's threads shared across tenants (inference/worker/claim_share.py, issue 29).

The rule on its own, then the generate task on the real broker (Redis): a session over its
tenant's share goes back to its queue with a countdown, claims nothing and holds no thread; one
under its floor takes a thread and gives it back when its run returns.
"""
from __future__ import annotations

import threading

import pytest
from kombu import Queue

from inference.tasks import DEFERRED, generate
from inference.worker import claim_share
from inference.worker.claim_share import ClaimShare, automatic_reserve, deferral_countdown_s
from metadata.models import Session, SessionStatus


def test_a_tenant_alone_leaves_the_reserve_free():
    share = ClaimShare(threads=16, reserve=4, rows=8)
    taken = sum(share.try_take("noisy") for _ in range(20))
    assert taken == 12  # the batch's 8 rows and 4 waiting for them; 4 threads stay free
    assert share.state().held == {"noisy": 12}


def test_the_reserve_goes_to_tenants_under_their_floor():
    share = ClaimShare(threads=16, reserve=4, rows=8)
    while share.try_take("noisy"):
        pass
    # two tenants hold threads: each one's floor is 8 // 2 = 4 (the quiet tenant's, with it counted)
    assert [share.try_take("quiet") for _ in range(5)] == [True, True, True, True, False]
    assert share.state().held == {"noisy": 12, "quiet": 4}
    assert not share.try_take("noisy")
    # a third tenant's floor is 8 // 3 = 2, but no thread is left
    assert not share.try_take("third")
    share.give_back("quiet")
    assert share.try_take("third") and not share.try_take("third")  # the last thread, then none
    share.give_back("noisy")
    assert share.try_take("third")  # 1 < 2: its floor
    assert share.state().held == {"noisy": 11, "quiet": 3, "third": 2}


def test_threads_given_back_are_taken_again_and_counts_never_go_negative():
    share = ClaimShare(threads=4, reserve=1, rows=2)
    assert [share.try_take("a") for _ in range(4)] == [True, True, True, False]
    for _ in range(3):
        share.give_back("a")
    assert share.state().held == {}
    share.give_back("a")  # a stray give-back leaves nothing behind
    assert share.state().held == {}
    assert [share.try_take("a") for _ in range(4)] == [True, True, True, False]


def test_concurrent_takes_never_pass_the_threads():
    share = ClaimShare(threads=8, reserve=2, rows=4)
    results: list[bool] = []
    lock = threading.Lock()

    def take(tenant):
        for _ in range(50):
            ok = share.try_take(tenant)
            with lock:
                results.append(ok)

    threads = [threading.Thread(target=take, args=(f"t{n % 3}",)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(results) == sum(share.state().held.values()) <= 8


def test_the_reserve_and_the_countdown():
    assert automatic_reserve(16, 8) == 4
    assert automatic_reserve(8, 8) == 0  # threads = rows: no reserve, the rule is off
    assert automatic_reserve(10, 8) == 2
    assert automatic_reserve(2, 8) == 0
    assert [deferral_countdown_s(n) for n in range(6)] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="reserve"):
        ClaimShare(threads=4, reserve=4, rows=2)
    assert claim_share.configure(8, 8) is None and claim_share.current() is None
    share = claim_share.configure(16, 8)
    assert claim_share.current() is share and share.reserve == 4
    assert claim_share.configure(16, 8, reserve=0) is None
    assert claim_share.configure(16, 8, reserve=40).reserve == 15
    claim_share.reset()


@pytest.fixture
def share():
    yield claim_share.configure(threads=3, rows=2, reserve=1)
    claim_share.reset()


@pytest.fixture
def test_queue():
    """A queue of this test's own on the real broker, empty before and after."""
    name = "specops-test-claim-share"
    with generate.app.connection_for_write() as connection:
        bound = Queue(name)(connection.default_channel)
        bound.declare()
        bound.purge()
        yield name
        bound.purge()


def messages(queue: str) -> list:
    with generate.app.connection_for_read() as connection:
        bound = Queue(queue)(connection.default_channel)
        taken = []
        while (message := bound.get(no_ack=True)) is not None:
            args, kwargs, _embed = message.decode()
            taken.append((args, kwargs, message.headers.get("eta")))
        return taken


@pytest.mark.django_db(transaction=True)
def test_a_session_over_its_tenants_share_goes_back_to_its_queue(share, test_queue, tenant, tiny_model):
    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue=test_queue,
                                     prompt="x", prompt_tokens=1)
    from prometheus_client import REGISTRY

    deferrals = lambda: REGISTRY.get_sample_value("specops_claim_deferrals_total") or 0.0
    before = deferrals()
    assert share.try_take(tenant.pk) and share.try_take(tenant.pk)  # the tenant holds its 2, 1 thread free
    result = generate.apply(args=[str(session.pk)], kwargs={"tenant": tenant.pk, "deferrals": 2},
                            routing_key=test_queue, priority=3)
    assert result.get() == DEFERRED
    [(args, kwargs, eta)] = messages(test_queue)
    assert args == [str(session.pk)] and kwargs == {"tenant": tenant.pk, "deferrals": 3}
    assert eta is not None  # a countdown: deferral_countdown_s(2)
    session.refresh_from_db()
    assert session.status == SessionStatus.QUEUED and session.attempts == 0  # nothing claimed
    assert share.state().held == {tenant.pk: 2}  # the deferred session holds no thread
    assert deferrals() == before + 1


@pytest.mark.django_db(transaction=True)
def test_a_session_under_its_floor_takes_a_thread_and_gives_it_back(share, test_queue, tenant, tiny_model):
    from metadata.models import Tenant

    other = Tenant.objects.create(name="claim-share-other")
    # a finished session: its run returns at once (a redelivery of a finished task does nothing)
    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue=test_queue,
                                     prompt="x", prompt_tokens=1, status=SessionStatus.SUCCEEDED)
    assert share.try_take(other.pk) and share.try_take(other.pk)
    # no tenant in the message (the reconciler's): the task looks it up; 0 held < floor 1
    result = generate.apply(args=[str(session.pk)], routing_key=test_queue)
    assert result.get() == SessionStatus.SUCCEEDED
    assert messages(test_queue) == []
    assert share.state().held == {other.pk: 2}


# ---- through a real worker ----------------------------------------------------------------------

NOISY_TOKENS = 1000  # far more than the tiny model makes before the test ends them


@pytest.fixture
def small_batch_worker(django_db_setup, tmp_path):
    """A worker of 4 threads for a batch of 2 rows: 1 thread kept for tenants under their floor."""
    from specops.celery import app
    from tests.worker_process import start_worker, stop_worker

    app.control.purge()  # the tests' own broker database: nothing left from an earlier run runs here
    log = tmp_path / "worker.log"
    process = start_worker("cpu", "claim-share", log, extra_env={"SPECOPS_MAX_BATCH": "2", "OMP_NUM_THREADS": "1"})
    yield process, log
    stop_worker(process)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_quiet_tenant_is_claimed_at_once_while_a_noisy_one_holds_its_share(tiny_model, small_batch_worker):
    from tests.helpers import wait_for
    from tests.inference.api.test_tenant_quotas import client_of

    _, log = small_batch_worker
    noisy, quiet = client_of("noisy"), client_of("quiet")

    def submit(client, tokens):
        response = client.post("/api/v1/generations/", {"prompt": "def parse(text):\n    ", "drafter": "none",
                                                        "max_new_tokens": tokens}, format="json")
        assert response.status_code == 202, response.content
        return response.json()["id"]

    noisy_ids = [submit(noisy, NOISY_TOKENS) for _ in range(6)]
    started = lambda ids: Session.objects.filter(pk__in=ids, started_at__isnull=False).count()
    # the noisy tenant takes 3 threads (2 rows, 1 waiting); its next messages are deferred
    wait_for(lambda: started(noisy_ids) == 3 and "'deferred'" in log.read_text(), timeout=120,
             what="the noisy tenant at its share, its next session deferred")
    quiet_id = submit(quiet, 8)
    wait_for(lambda: Session.objects.get(pk=quiet_id).status == SessionStatus.SUCCEEDED, timeout=60,
             what="the quiet session to run beside the noisy tenant's")
    assert started(noisy_ids) == 3  # it ran on the reserve, not on a noisy session's thread
    # a deferred session is tried again and runs once a noisy thread is free
    first = Session.objects.filter(pk__in=noisy_ids, started_at__isnull=False).order_by("started_at")[0]
    assert noisy.post(f"/api/v1/sessions/{first.pk}/cancel/").status_code == 200
    wait_for(lambda: started(noisy_ids) == 4, timeout=60, what="a deferred noisy session to take the thread")
    for session_id in noisy_ids:
        noisy.post(f"/api/v1/sessions/{session_id}/cancel/")
    wait_for(lambda: not Session.objects.filter(pk__in=noisy_ids, finished_at__isnull=True).exists(), timeout=60,
             what="every noisy session to end")
    from tests.inference.worker.test_cancel import stream_events

    for session_id in [*noisy_ids, quiet_id]:
        assert [event for _, event, _ in stream_events(session_id)].count("done") == 1

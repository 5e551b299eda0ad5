"""Maintenance from the admin's Partitions page: rotate now, archive a partition, restore an archive.

On the real services: the admin in process, the runs executed by a real Celery worker (threads
pool) consuming a maintenance queue of this module's own, real partitions in the test database.
Partitions past the retention are made for real dates (the retention of the settings before now),
since the page and the worker both judge age against the clock.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils import timezone

from metadata.maintenance import FINISHED, requests
from metadata.models import PARTITIONED_TABLES, ArchivalStep, MaintenanceRun, PartitionArchivalJob
from metadata.partitions import PARTITION_MAINTENANCE_LOCK, PartitionPolicy, TimeRange, advisory_lock, bin_start, catalog
from metadata.partitions.maker import PartitionMaker
from tests.helpers import wait_for
from tests.metadata.partition_helpers import insert_tokens, reset_partitions, token_keys
from tests.worker_process import start_worker, stop_worker

QUEUE = "maintenance.test-admin-actions"  # this module's own: no other suite's worker takes its tasks
TOKENS = "metadata_token"
PAGE = "admin:metadata_partitions"


@pytest.fixture(scope="module")
def worker_archive_dir(django_db_setup, tmp_path_factory) -> Path:
    """A real worker on this module's queue; its archives go to the folder it yields."""
    archive = tmp_path_factory.mktemp("worker-archive")
    process = start_worker(QUEUE, "maintenance-actions", tmp_path_factory.mktemp("worker") / "worker.log",
                           extra_env={"SPECOPS_ARCHIVE_DIR": str(archive), "SPECOPS_MAINTENANCE_PAUSE_RATIO": "0",
                                      "OMP_NUM_THREADS": "1"})
    yield archive
    stop_worker(process)


@pytest.fixture(autouse=True)
def runs_go_to_this_modules_queue(monkeypatch):
    monkeypatch.setattr(requests, "QUEUE", QUEUE)


@pytest.fixture
def partitioned(transactional_db, settings, tmp_path):
    """DEFAULT partitions only, before and after (as tests/metadata's); committed, for the worker."""
    settings.SPECOPS_ARCHIVE_DIR = tmp_path / "archive"
    settings.SPECOPS_MAINTENANCE_PAUSE_RATIO = 0
    reset_partitions()
    yield
    reset_partitions()


def finished(run_id: int, timeout: float = 90) -> MaintenanceRun:
    def ended() -> MaintenanceRun | None:
        run = MaintenanceRun.objects.get(pk=run_id)
        return run if run.status in FINISHED else None

    return wait_for(ended, timeout=timeout, interval=0.2, what=f"maintenance run {run_id} to end")


def post(client, name: str, data: dict | None = None):
    return client.post(reverse(f"admin:metadata_partitions_{name}"), data or {}, follow=True)


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def expired_partition(rows: int) -> tuple[str, set]:
    """A token partition that ended 5 days before the retention cutoff, holding ``rows`` rows."""
    policy = PartitionPolicy.from_settings()
    start = bin_start(timezone.now() - policy.retention - dt.timedelta(days=5), policy.interval)
    bounds = TimeRange(start, start + policy.interval)
    (name,), _ = PartitionMaker(TOKENS, PARTITIONED_TABLES[TOKENS], policy, lambda _: None).make(bounds)
    insert_tokens(start + dt.timedelta(minutes=30), rows)
    return name, token_keys()


def staff(username: str, *permissions: str):
    user = get_user_model().objects.create_user(username, password=f"pw-{username}-123", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="metadata", codename__in=permissions))
    return user


# ---- permissions and refusals (no worker needed: nothing may be queued) ---------------------------

def test_without_the_permission_no_button_shows_and_a_forged_post_is_a_403(partitioned, client) -> None:
    name, _ = expired_partition(5)
    client.force_login(staff("viewer"))

    page = client.get(reverse(PAGE)).content.decode()

    assert name in page and "past retention" in page
    for button in ("Rotate now", "Archive this partition", "Restore this archive"):
        assert f'value="{button}"' not in page
    assert post(client, "rotate").status_code == 403
    assert post(client, "archive", {"partition": name}).status_code == 403
    assert post(client, "restore", {"job": "1"}).status_code == 403
    assert MaintenanceRun.objects.count() == 0
    assert catalog.attachment(name) == (TOKENS, False)

    client.force_login(staff("archivist", "run_archival"))
    page = client.get(reverse(PAGE)).content.decode()
    assert 'value="Archive this partition"' in page and 'value="Rotate now"' not in page
    assert post(client, "rotate").status_code == 403
    assert client.get(reverse("admin:metadata_partitions_archive")).status_code == 405
    assert MaintenanceRun.objects.count() == 0


@pytest.mark.parametrize(("action", "data", "reason"), [
    ("archive", {"partition": "metadata_token_p19990101"}, "no partition named metadata_token_p19990101 is attached"),
    ("archive", {"partition": "metadata_token_default"}, "is the DEFAULT partition of metadata_token"),
    ("archive", {"partition": "x; DROP TABLE metadata_token"}, "is not a partition name"),
    ("archive", {"partition": "current"}, "inside the retention"),
    ("restore", {"job": "424242"}, "no archival job 424242"),
    ("restore", {"job": "abc"}, "'abc' is not an archival job id"),
])
def test_bad_input_is_refused_with_a_message_and_records_nothing(partitioned, admin_client, action, data,
                                                                 reason) -> None:
    if data.get("partition") == "current":
        policy = PartitionPolicy.from_settings()
        start = bin_start(timezone.now(), policy.interval)
        (data["partition"],), _ = PartitionMaker(TOKENS, PARTITIONED_TABLES[TOKENS], policy,
                                                 lambda _: None).make(TimeRange(start, start + policy.interval))

    response = post(admin_client, action, data)

    assert response.status_code == 200  # back on the page
    assert any(m.startswith("Refused, nothing was started: ") and reason in m for m in messages_of(response)), \
        messages_of(response)
    assert MaintenanceRun.objects.count() == 0


def test_progress_shows_while_the_action_is_inside_its_own_transaction(partitioned, admin_user) -> None:
    """An export or a restore reports from inside its transaction; the page must see it now."""
    from django.db import connections, transaction

    from metadata.maintenance.runner import RunProgress

    run = MaintenanceRun.objects.create(action="restore", target="x", requested_by=admin_user)
    progress = RunProgress(run, lambda line, done: done + 1)
    other = connections.create_connection("default")
    try:
        with transaction.atomic():
            progress.start(2, "metadata_token_p1: restoring")
            progress("metadata_token_p1: imported 1000 rows")
            with other.cursor() as cursor:
                cursor.execute("SELECT progress_done, progress_total, progress_line FROM metadata_maintenance_run "
                               "WHERE id = %s", [run.pk])
                assert cursor.fetchone() == (1, 2, "metadata_token_p1: imported 1000 rows")
            transaction.set_rollback(True)  # the action fails: its progress lines stay
    finally:
        other.close()
        progress.close()
    assert MaintenanceRun.objects.get(pk=run.pk).progress_line == "metadata_token_p1: imported 1000 rows"


# ---- through a real worker ----------------------------------------------------------------------

def test_rotate_now_runs_on_a_worker_with_progress_and_outcome(partitioned, admin_client, worker_archive_dir) -> None:
    insert_tokens(timezone.now(), 40)  # no partition for today yet: stranded in DEFAULT
    page = admin_client.get(reverse(PAGE)).content.decode()
    assert "Rotation plan as of" in page and "drain    40 row(s) from DEFAULT into metadata_token_p" in page
    assert 'value="Rotate now"' in page
    assert page.count("<script>") == 1  # the poll, after the table it reads
    assert page.index('<table id="maintenance-runs"') < page.index('getElementById("maintenance-runs")')

    response = post(admin_client, "rotate")

    run = MaintenanceRun.objects.get()
    assert f"Run {run.pk} (rotate now all partitioned tables) is queued" in messages_of(response)[0]
    assert run.requested_by.username == "admin" and run.task_id
    run = finished(run.pk)
    assert run.status == "succeeded", (run.error, run.outcome)
    assert run.started_at and run.finished_at and run.requested_at <= run.started_at <= run.finished_at
    premade = PartitionPolicy.from_settings().premake + 1
    assert run.progress_total == run.progress_done == premade * len(PARTITIONED_TABLES)  # one per partition made
    assert run.progress_line  # the last line the rotation reported
    assert run.outcome["drained_rows"] == 40 and len(run.outcome["created"]) == run.progress_total
    assert run.outcome["summary"].startswith(f"created {run.progress_total} partition(s), drained 40 row(s)")
    assert catalog.default_state(TOKENS, PARTITIONED_TABLES[TOKENS]).rows == 0
    assert catalog.partition_covering(TOKENS, timezone.now()) is not None

    polled = admin_client.get(reverse("admin:metadata_maintenance_runs")).json()
    assert polled["active"] is False
    first = polled["runs"][0]
    assert {key: first[key] for key in ("id", "action", "status", "requested_by", "error", "summary")} == {
        "id": run.pk, "action": "rotate", "status": "succeeded", "requested_by": "admin", "error": "",
        "summary": run.outcome["summary"]}
    assert first["progress"] == {"done": run.progress_done, "total": run.progress_total, "line": run.progress_line}
    listing = admin_client.get(reverse("admin:metadata_maintenancerun_changelist")).content.decode()
    assert "rotate now" in listing and run.outcome["summary"] in listing
    assert admin_client.get(reverse("admin:metadata_maintenancerun_add")).status_code == 403
    detail = admin_client.get(reverse("admin:metadata_maintenancerun_change", args=[run.pk])).content.decode()
    assert 'name="_save"' not in detail  # read-only


def test_archive_then_restore_through_the_page_keeps_every_row(partitioned, admin_client, worker_archive_dir) -> None:
    name, keys = expired_partition(300)
    page = admin_client.get(reverse(PAGE)).content.decode()
    assert f'name="partition" value="{name}"><input type="submit" value="Archive this partition">' in page

    archived = finished(_started(post(admin_client, "archive", {"partition": name})))

    assert archived.status == "succeeded", (archived.error, archived.outcome)
    assert (archived.progress_done, archived.progress_total) == (4, 4)  # detached, exported, verified, dropped
    assert archived.progress_line == f"{name}: dropped (4/4)"
    job = PartitionArchivalJob.objects.get(pk=archived.archival_job_id)
    assert job.step == ArchivalStep.DROPPED and job.row_count == 300 and archived.outcome["rows"] == 300
    assert Path(job.archive_path).is_relative_to(worker_archive_dir) and Path(job.archive_path).is_file()
    assert not catalog.relation_exists(name) and token_keys() == set()
    page = admin_client.get(reverse(PAGE)).content.decode()
    assert f'name="job" value="{job.pk}">' in page and 'value="Restore this archive"' in page

    restored = finished(_started(post(admin_client, "restore", {"job": job.pk, "attach": "1"})))

    assert restored.status == "succeeded", (restored.error, restored.outcome)
    assert (restored.progress_done, restored.progress_total) == (3, 3)  # imported and verified, attached, done
    assert restored.archival_job_id == job.pk and restored.target == job.archive_path
    assert restored.outcome["summary"] == f"300 row(s) restored into {name} attached to its parent"
    assert catalog.attachment(name) == (TOKENS, False)
    assert token_keys() == keys  # every row back, through the parent

    again = post(admin_client, "restore", {"job": job.pk})
    assert any(f"is already restored: restored by run {restored.pk}" in m for m in messages_of(again))
    assert MaintenanceRun.objects.count() == 2
    page = again.content.decode()
    assert f"restored (restored by run {restored.pk})" in page
    assert f"300 row(s) of {name} archived to {job.archive_path}" in page and restored.outcome["summary"] in page
    assert page.count('<td class="run-status">succeeded</td>') == 2


def test_a_run_that_finds_the_lock_busy_ends_skipped_and_changes_nothing(partitioned, admin_client,
                                                                        worker_archive_dir) -> None:
    insert_tokens(timezone.now(), 3)
    with advisory_lock(PARTITION_MAINTENANCE_LOCK):  # as if another rotation were running
        run = finished(_started(post(admin_client, "rotate")))

    assert run.status == "skipped"
    assert run.error == "skipped, nothing done: another maintenance run holds the lock; try again later"
    assert run.progress_done == 0 and run.finished_at is not None
    assert catalog.range_partitions(TOKENS) == []
    assert catalog.default_state(TOKENS, PARTITIONED_TABLES[TOKENS]).rows == 3
    page = admin_client.get(reverse(PAGE)).content.decode()
    assert '<td class="run-status">skipped</td>' in page and "another maintenance run holds the lock" in page


def _started(response) -> int:
    """The run a successful POST queued (the newest), checked against the page's message."""
    run = MaintenanceRun.objects.order_by("-pk").first()
    assert run is not None and any(f"Run {run.pk} (" in m and "is queued" in m for m in messages_of(response)), \
        messages_of(response)
    return run.pk


def test_a_day_of_sessions_is_shown_and_restored_as_one_unit(partitioned, admin_client, worker_archive_dir) -> None:
    from metadata.models import ModelVersion
    from metadata.models import Session, SessionStatus, Tenant

    policy = PartitionPolicy.from_settings()
    start = bin_start(timezone.now() - policy.retention - dt.timedelta(days=5), policy.interval)
    bounds = TimeRange(start, start + policy.interval)
    family = ("metadata_session", TOKENS, "metadata_candidate")
    names = {table: PartitionMaker(table, PARTITIONED_TABLES[table], policy, lambda _: None).make(bounds)[0][0]
             for table in family}
    target = ModelVersion.objects.create(name="m", version="1", role="target", path="/nonexistent", context_length=64)
    session = Session.objects.create(tenant=Tenant.objects.create(name="t"), target=target, drafter="none",
                                     queue="cpu", prompt="p", prompt_tokens=1, status=SessionStatus.SUCCEEDED,
                                     created_at=start + dt.timedelta(hours=2))
    insert_tokens(session.created_at, 30, session_id=session.pk)
    for table in family:  # what a rotation past the retention does, one table after the other
        assert finished(_started(post(admin_client, "archive", {"partition": names[table]}))).status == "succeeded"
    assert not Session.objects.filter(pk=session.pk).exists() and token_keys() == set()

    page = admin_client.get(reverse(PAGE)).content.decode()
    day_row = page.split('id="archived-days"')[1].split("</table>")[0]
    assert f"{start:%Y-%m-%d %H:%M}" in day_row and 'value="Restore this day"' in day_row
    assert "<code>metadata_session</code> 1" in day_row and "<code>metadata_token</code> 30" in day_row
    session_job = PartitionArchivalJob.objects.get(parent_table="metadata_session", step=ArchivalStep.DROPPED)
    assert f'name="job" value="{session_job.pk}">' in day_row

    restored = finished(_started(post(admin_client, "restore", {"job": session_job.pk, "attach": "1"})))

    assert restored.status == "succeeded", (restored.error, restored.outcome)
    assert restored.outcome["tables"] == [names[t] for t in family] and restored.outcome["rows"] == 31
    assert Session.objects.get(pk=session.pk).status == SessionStatus.SUCCEEDED
    assert len(token_keys()) == 30 and all(catalog.attachment(names[t]) == (t, False) for t in family)
    day_row = admin_client.get(reverse(PAGE)).content.decode().split('id="archived-days"')[1].split("</table>")[0]
    assert 'value="Restore this day"' not in day_row and "restored" in day_row

"""pg_stat_statements snapshots (deltas per interval), SQL tags, hot queries, the heatmap, EXPLAIN flags,
and the two admin pages, against the real primary and replica (pg_stat_statements loaded by
``scripts/services.sh``)."""
from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection, connections
from django.urls import reverse
from django.utils import timezone

from metadata.insights import (
    SNAPSHOT_TASK,
    StatementSnapshotter,
    Window,
    describe,
    heatmap_svg,
    hot_queries,
    latency_heatmap,
    read_counters,
    sql_tag,
    with_plans,
)
from metadata.models import StatementBaseline, StatementSnapshot, Tenant

PROBE = "SELECT count(*) FROM metadata_tenant WHERE name = %s AND id > %s"  # a statement of this test's own


def run_probe(times: int, alias: str = "default") -> None:
    with connections[alias].cursor() as cursor:
        for i in range(times):
            cursor.execute(PROBE, [f"probe-{i}", -1])


def probe_rows(taken_at: dt.datetime, database: str = "default") -> list[StatementSnapshot]:
    return [row for row in StatementSnapshot.objects.filter(taken_at=taken_at, database=database)
            if "metadata_tenant" in row.query and "id >" in row.query]


def probe_queryid(alias: str = "default") -> int:
    counters, _ = read_counters(alias)
    return next(q for q, c in counters.items() if "metadata_tenant" in c.query and "id >" in c.query)


@pytest.mark.django_db
def test_a_snapshot_stores_the_delta_of_each_interval_not_the_running_total():
    snapshotter = StatementSnapshotter(["default"])
    t0 = timezone.now()
    first = snapshotter.run(now=t0)
    assert first.databases[0].interval_s is None  # the first snapshot records the baseline only
    assert not StatementSnapshot.objects.filter(taken_at=t0).exists()
    Tenant.objects.create(name="probe-3")

    run_probe(7)
    second = snapshotter.run(now=t0 + dt.timedelta(seconds=60))
    assert second.databases[0].interval_s == pytest.approx(60)
    [row] = probe_rows(t0 + dt.timedelta(seconds=60))
    assert (row.calls, row.rows, row.interval_s) == (7, 7, pytest.approx(60))  # count(*) returns one row a call
    assert row.family == "select metadata_tenant" and row.total_time_ms > 0
    assert row.max_time_ms >= row.mean_time_ms > 0

    run_probe(3)
    snapshotter.run(now=t0 + dt.timedelta(seconds=120))
    [row] = probe_rows(t0 + dt.timedelta(seconds=120))
    assert row.calls == 3  # 10 in all since the baseline, 3 in this interval

    # Counters that went down (entry reset or evicted) count from zero, never negative.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
                       "WHERE datname = current_database()), %s)", [probe_queryid()])
    run_probe(2)
    snapshotter.run(now=t0 + dt.timedelta(seconds=180))
    [row] = probe_rows(t0 + dt.timedelta(seconds=180))
    assert row.calls == 2
    baseline = StatementBaseline.objects.get(database="default", queryid=row.queryid)
    assert baseline.calls == 2 and "metadata_tenant" in baseline.query


@pytest.mark.django_db(databases="__all__")
def test_each_replica_is_snapshotted_on_its_own_server(settings):
    alias = settings.DATABASE_REPLICAS[0]
    snapshotter = StatementSnapshotter(["default", alias])
    t0 = timezone.now()
    snapshotter.run(now=t0)
    run_probe(4, alias)
    report = snapshotter.run(now=t0 + dt.timedelta(seconds=30))
    assert [d.error for d in report.databases] == ["", ""], report.summary()
    [row] = probe_rows(t0 + dt.timedelta(seconds=30), alias)
    assert row.calls == 4 and row.interval_s == pytest.approx(30)
    assert probe_rows(t0 + dt.timedelta(seconds=30), "default") == []  # ran on the replica only


@pytest.mark.django_db
def test_statements_carry_the_tag_of_the_code_that_sent_them(admin_client):
    with sql_tag("task", "tests.insights-probe"):
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s::text AS insights_tag_probe", ["x"])
    admin_client.get(reverse("admin:metadata_partitions"))
    texts = [c.query for c in read_counters("default")[0].values()]
    probe = next(t for t in texts if "insights_tag_probe" in t)
    assert probe.endswith("/* specops:task=tests.insights-probe */")
    assert describe(probe).source == "task=tests.insights-probe"
    assert any("/* specops:view=admin:metadata_partitions */" in t for t in texts)
    assert describe('SELECT "x" FROM "metadata_token_p20300101" WHERE a IN ($1, $2, $3)',
                    ("metadata_token",)).family == "select metadata_token"


def test_the_snapshot_job_has_a_stable_name_and_runs_on_the_maintenance_queue():
    from metadata.insights import snapshot_statements
    from specops.celery import app

    assert snapshot_statements.name == SNAPSHOT_TASK == "metadata.insights.snapshot_statements"
    assert app.amqp.router.route({}, SNAPSHOT_TASK)["queue"].name == "maintenance"


@pytest.mark.django_db
def test_the_migration_registered_the_beat_job_once():
    from django_celery_beat.models import PeriodicTask

    from metadata.insights import register_snapshot_job

    assert PeriodicTask.objects.filter(task=SNAPSHOT_TASK, queue="maintenance").count() == 1
    assert register_snapshot_job() is False  # idempotent
    assert PeriodicTask.objects.filter(task=SNAPSHOT_TASK).count() == 1


@pytest.fixture
def big_table(db, settings):
    """A table over the 'big' threshold, and statements on it: one scans it, one uses its index."""
    settings.SPECOPS_INSIGHTS_BIG_TABLE_ROWS = 1000
    with connection.cursor() as cursor:
        # After a whole suite pg_stat_statements is full (pg_stat_statements.max) and evicts the
        # least-used entries, a 5-call one among them: start from an empty set for this database.
        cursor.execute("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
                       "WHERE datname = current_database()), 0)")
        cursor.execute("CREATE TABLE insights_big (id int PRIMARY KEY, v int NOT NULL)")
        cursor.execute("INSERT INTO insights_big SELECT g, g % 97 FROM generate_series(1, 5000) g")
        cursor.execute("ANALYZE insights_big")
    return "insights_big"


@pytest.mark.django_db(databases="__all__")
def test_hot_queries_rank_flag_sequential_scans_and_fill_the_heatmap(big_table):
    snapshotter = StatementSnapshotter(["default"])
    t0 = timezone.now() - dt.timedelta(minutes=5)
    snapshotter.run(now=t0)
    with sql_tag("view", "tests.big-report"), connection.cursor() as cursor:
        for v in range(20):
            cursor.execute("SELECT count(*) FROM insights_big WHERE v = %s", [v])  # no index on v
        for i in range(5):
            cursor.execute("SELECT v FROM insights_big WHERE id = %s", [i])  # the primary key
    snapshotter.run(now=t0 + dt.timedelta(minutes=1))

    found = hot_queries(Window.last(1), order="calls", limit=50)["default"]
    by_text = {s.query: s for s in with_plans(found.statements)}
    scan = by_text["SELECT count(*) FROM insights_big WHERE v = $1"]
    lookup = by_text["SELECT v FROM insights_big WHERE id = $1"]
    assert (scan.calls, lookup.calls) == (20, 5)
    assert scan.source == "view=tests.big-report" and scan.family == "select insights_big"
    assert scan.plan.flagged and scan.plan.scans[0].relation == "insights_big" and scan.plan.scans[0].rows >= 5000
    assert not lookup.plan.flagged and not lookup.plan.skipped
    assert 0 < scan.share <= 1 and found.total_ms >= scan.total_ms

    heatmap = latency_heatmap(Window.last(1), "default")
    assert "select insights_big" in heatmap.families
    svg = heatmap_svg(heatmap)
    assert svg.startswith("<svg") and "select insights_big" in svg


@pytest.mark.django_db(databases="__all__")
def test_the_hot_queries_page_renders_real_snapshots(admin_client, big_table):
    snapshotter = StatementSnapshotter()
    snapshotter.run(now=timezone.now() - dt.timedelta(minutes=2))
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM insights_big WHERE v = %s", [3])
    snapshotter.run()
    page = admin_client.get(reverse("admin:metadata_hot_queries"), {"hours": 1, "order": "total"})
    assert page.status_code == 200
    html = page.content.decode()
    assert "SELECT count(*) FROM insights_big WHERE v = $1" in html
    assert "sequential scan:" in html and "<svg" in html and "Latency by hour and query family" in html
    assert "replica_0" in html  # every database has its section
    listing = admin_client.get(reverse("admin:metadata_statementbaseline_changelist"))
    assert listing.status_code == 200 and reverse("admin:metadata_hot_queries") in listing.content.decode()
    index = admin_client.get(reverse("admin:index")).content.decode()
    assert reverse("admin:metadata_hot_queries") in index and reverse("admin:metadata_partitions") in index


@pytest.mark.django_db(databases="__all__")
def test_the_capacity_page_renders_real_snapshots(admin_client):
    snapshotter = StatementSnapshotter()
    snapshotter.run(now=timezone.now() - dt.timedelta(minutes=2))
    run_probe(5)
    snapshotter.run()
    page = admin_client.get(reverse("admin:metadata_capacity"), {"hours": 1, "buffer": "3"})
    assert page.status_code == 200
    html = page.content.decode()
    assert "Needs at 3.0x the peak" in html and "connections busy at once" in html
    assert "select metadata_tenant" in html and "metadata_statement_snapshot" in html and "<svg" in html

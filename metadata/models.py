"""The metadata store: tenants, sessions, and their partitioned history tables.

Sessions, token history, candidates and the request log are RANGE-partitioned on a time column
(created by ``metadata.partitions.migration_operations.CreatePartitionedModel``; the sessions
table was converted in place by ``metadata.partitions.conversion``). Every primary key in the
database includes that column (PostgreSQL requires it). Tokens and candidates are partitioned on
their session's creation time, so one session's rows live in the partition of the same day as the
session itself (one unit to archive and restore), and a redelivered task's rows collide on the
natural key (``ON CONFLICT DO NOTHING``) instead of being written twice.

A session's id is a UUIDv7 of its ``created_at`` (``metadata.ids``): every lookup by id
through ``Session.objects`` adds the partition key the id carries, so PostgreSQL reads one
partition (``metadata.session_keys``).
"""
from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q
from django.utils import timezone

from metadata.ids import uuid7
from metadata.session_keys import SessionQuerySet, matching_id_and_time


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name


class TenantMembership(models.Model):
    """Which tenant an API user acts for; every API queryset is filtered by it."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="members")

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant}"


class SessionStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


LIVE_STATUSES = (SessionStatus.QUEUED, SessionStatus.RUNNING)


class Session(models.Model):
    """One generation: its request, its state, and its outcome. Partitioned by ``created_at``.

    The id and ``created_at`` are made together: a new session's id is the UUIDv7 of its
    ``created_at`` (to the millisecond; given or now), and a session given a UUIDv7 id takes
    its time as ``created_at``. Ids of version 4 (sessions made before UUIDv7) keep working.
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="sessions")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    last_activity_at = models.DateTimeField(default=timezone.now)
    status = models.CharField(max_length=16, choices=SessionStatus.choices, default=SessionStatus.QUEUED)
    target = models.ForeignKey("inference.ModelVersion", on_delete=models.PROTECT, related_name="+")
    draft = models.ForeignKey(
        "inference.ModelVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    drafter = models.CharField(max_length=16)
    queue = models.CharField(max_length=32)
    prompt = models.TextField()
    prompt_tokens = models.PositiveIntegerField()
    params = models.JSONField(default=dict)
    token_count = models.PositiveIntegerField(default=0)
    text = models.TextField(blank=True, default="")
    finish_reason = models.CharField(max_length=16, blank=True, default="")
    error = models.TextField(blank=True, default="")
    stats = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Crash safety: a worker claims a session by taking its lease (status running, lease in the
    # future) and renews it while the session is in its batch; an expired lease means the worker
    # died, and the reconciler re-enqueues the session. attempts counts claims (runs and resumes).
    attempts = models.PositiveSmallIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=128, blank=True, default="")
    # When a task for it was last handed to the broker (submission, or the reconciler when the
    # broker may have lost it): a session queued long after this gets another task.
    enqueued_at = models.DateTimeField(null=True, blank=True)

    objects = SessionQuerySet.as_manager()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args:  # made in code; rows loaded from the database come positionally (Model.from_db)
            kwargs = matching_id_and_time(kwargs)
        super().__init__(*args, **kwargs)

    class Meta:
        base_manager_name = "objects"
        indexes = [
            # The hottest read, state by session id, served by an index-only scan.
            models.Index(
                fields=["id"],
                include=["status", "token_count", "updated_at", "tenant"],
                name="session_state_covering",
            ),
            # Live sessions only: a small index that stays small as finished sessions pile up.
            models.Index(
                fields=["last_activity_at"],
                condition=Q(status__in=[s.value for s in LIVE_STATUSES]),
                name="session_live_partial",
            ),
            models.Index(fields=["tenant", "-created_at", "id"], name="session_tenant_recent"),
        ]

    def __str__(self) -> str:
        return str(self.id)


class TokenKind(models.IntegerChoices):
    """What produced a token: the four outcomes of a verification step.

    TARGET (shown as "plain"): the target alone, in a step with no draft. ACCEPTED: a drafted token the target
    accepted. CORRECTION: the target's own token after it rejected a drafted one. BONUS: the
    target's extra token after every drafted token of a branch was accepted. (Rows written
    before CORRECTION existed carry BONUS for both of the last two.)
    """

    TARGET = 0, "plain"
    ACCEPTED = 1, "accepted draft"
    BONUS = 2, "bonus"
    CORRECTION = 3, "correction"


class TokenRecord(models.Model):
    """One generated token. Partitioned by ``session_created_at``."""

    pk = models.CompositePrimaryKey("session_id", "position", "session_created_at")
    # The primary key starts with session_id, so the FK needs no index of its own.
    session = models.ForeignKey(
        Session, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    session_created_at = models.DateTimeField()
    position = models.PositiveIntegerField()
    step = models.PositiveIntegerField()
    token_id = models.IntegerField()
    piece = models.TextField()
    kind = models.SmallIntegerField(choices=TokenKind.choices)
    logprob = models.FloatField(null=True)

    class Meta:
        db_table = "metadata_token"

    def __str__(self) -> str:
        return f"{self.session_id}#{self.position}"


class Candidate(models.Model):
    """One drafted branch of one verification step, with its draft score (n-best candidates)."""

    pk = models.CompositePrimaryKey("session_id", "step", "branch", "session_created_at")
    # The primary key starts with session_id, so the FK needs no index of its own.
    session = models.ForeignKey(
        Session, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    session_created_at = models.DateTimeField()
    step = models.PositiveIntegerField()
    branch = models.PositiveIntegerField()
    token_ids = models.JSONField()
    score = models.FloatField()
    accepted_len = models.PositiveIntegerField()

    class Meta:
        db_table = "metadata_candidate"
        indexes = [models.Index("session", models.F("score").desc(), "step", "branch", name="candidate_by_score")]

    def __str__(self) -> str:
        return f"{self.session_id} step {self.step} branch {self.branch}"


class RequestLog(models.Model):
    """One API request (method, path, status, latency); partitioned by ``requested_at``."""

    pk = models.CompositePrimaryKey("id", "requested_at")
    id = models.UUIDField(default=uuid.uuid4)
    requested_at = models.DateTimeField(default=timezone.now)
    tenant = models.ForeignKey(
        Tenant, null=True, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=300)
    status_code = models.PositiveSmallIntegerField()
    duration_ms = models.FloatField()
    session = models.ForeignKey(
        Session, null=True, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )

    class Meta:
        db_table = "metadata_request_log"


class StatementSnapshot(models.Model):
    """One statement's work on one database during one snapshot interval; partitioned by ``taken_at``.

    Deltas of ``pg_stat_statements`` between two snapshots of the same database alias (the
    ``metadata.insights.snapshot_statements`` beat job). ``max_time_ms``: PostgreSQL 15 keeps
    only the maximum since the statistics were reset, so it is exact when the statement set a new
    maximum in the interval, else the interval's mean (a lower bound of its true maximum).
    """

    pk = models.CompositePrimaryKey("database", "queryid", "taken_at")
    taken_at = models.DateTimeField()
    interval_s = models.FloatField()  # since the previous snapshot of this database
    database = models.CharField(max_length=32)  # the Django alias: "default", "replica_0", ...
    queryid = models.BigIntegerField()
    query = models.TextField()  # normalised text (constants as $n, lists collapsed, tag removed)
    family = models.CharField(max_length=100)  # statement kind and main table, e.g. "select metadata_token"
    source = models.CharField(max_length=200, blank=True, default="")  # "view=…" or "task=…", from the SQL tag
    calls = models.BigIntegerField()
    total_time_ms = models.FloatField()
    max_time_ms = models.FloatField()
    rows = models.BigIntegerField()
    shared_blks_hit = models.BigIntegerField()
    shared_blks_read = models.BigIntegerField()
    shared_blks_dirtied = models.BigIntegerField()
    shared_blks_written = models.BigIntegerField()

    class Meta:
        db_table = "metadata_statement_snapshot"

    @property
    def mean_time_ms(self) -> float:
        return self.total_time_ms / self.calls if self.calls else 0.0


class StatementBaseline(models.Model):
    """The cumulative ``pg_stat_statements`` counters a database alias showed at its last snapshot.

    Small (one row per statement and alias, updated in place): the next snapshot's deltas are
    computed against it. The row with ``queryid`` 0 (no real statement has it) records the last
    snapshot time of the alias itself.
    """

    database = models.CharField(max_length=32)
    queryid = models.BigIntegerField()
    taken_at = models.DateTimeField()
    query = models.TextField(blank=True, default="")  # as pg_stat_statements shows it: EXPLAIN can prepare it
    calls = models.BigIntegerField(default=0)
    total_time_ms = models.FloatField(default=0.0)
    max_time_ms = models.FloatField(default=0.0)
    rows = models.BigIntegerField(default=0)
    shared_blks_hit = models.BigIntegerField(default=0)
    shared_blks_read = models.BigIntegerField(default=0)
    shared_blks_dirtied = models.BigIntegerField(default=0)
    shared_blks_written = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["database", "queryid"], name="one_baseline_per_statement")]

    def __str__(self) -> str:
        return f"{self.database} {self.queryid}"


# table -> RANGE partition column, for the migrations and the partition lifecycle.
PARTITIONED_TABLES: dict[str, str] = {
    Session._meta.db_table: "created_at",
    TokenRecord._meta.db_table: "session_created_at",
    Candidate._meta.db_table: "session_created_at",
    RequestLog._meta.db_table: "requested_at",
    StatementSnapshot._meta.db_table: "taken_at",
}


class ArchivalStep(models.TextChoices):
    PENDING = "pending"
    DETACHED = "detached"
    EXPORTED = "exported"
    VERIFIED = "verified"
    DROPPED = "dropped"
    FAILED = "failed"


class PartitionArchivalJob(models.Model):
    """One partition's way to cold storage; a crash resumes from ``step`` on the next run."""

    parent_table = models.CharField(max_length=63)
    partition = models.CharField(max_length=63)
    range_start = models.DateTimeField()
    range_end = models.DateTimeField()
    step = models.CharField(max_length=10, choices=ArchivalStep.choices, default=ArchivalStep.PENDING)
    # The table's OID when the job was made: a later table reusing the name is not this one.
    relation_oid = models.PositiveBigIntegerField(null=True, blank=True)
    archive_path = models.CharField(max_length=500, blank=True, default="")
    archive_sha256 = models.CharField(max_length=64, blank=True, default="")
    archive_bytes = models.BigIntegerField(null=True, blank=True)
    row_count = models.BigIntegerField(null=True, blank=True)
    checksum = models.CharField(max_length=64, blank=True, default="")  # rows, see archive_files
    error = models.TextField(blank=True, default="")
    failed_step = models.CharField(max_length=10, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)  # failed attempts so far
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # A name can come back (a drained or restored range), so only one *unfinished* job.
            models.UniqueConstraint(
                fields=["parent_table", "partition"],
                condition=~Q(step="dropped"),
                name="one_open_archival_job_per_partition",
            )
        ]
        indexes = [models.Index(fields=["step", "range_start"], name="archival_job_by_step")]

    def __str__(self) -> str:
        return f"{self.partition} ({self.step})"


class CacheStatsSnapshot(models.Model):
    """Cache counters of one process at one moment, so the admin can chart hit rates."""

    taken_at = models.DateTimeField(default=timezone.now, db_index=True)
    cache = models.CharField(max_length=32)  # e.g. "session_state", "prediction"
    tier = models.CharField(max_length=16)  # "local" | "redis"
    hits = models.BigIntegerField(default=0)
    misses = models.BigIntegerField(default=0)
    coalesced = models.BigIntegerField(default=0)

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None


class RollupWidth(models.IntegerChoices):
    MINUTE = 1, "minute"
    HOUR = 60, "hour"


class OpsRollup(models.Model):
    """One minute (or hour) of one operational series: what the dashboard reads instead of raw rows.

    ``series`` names what was aggregated and ``key`` its label (a drafter, a device queue, a
    cache tier, a replica, a status class). ``count``, ``total`` and the latency histogram
    ``buckets`` (counts over the fixed edges of ``core.histograms``) merge by addition, and
    ``values`` holds further sums (``*_max`` merge by max, lists element-wise), so minutes add up
    into hours and hours into any window. Written by ``ops.rollups``; each series is
    described there.
    """

    start = models.DateTimeField()  # UTC, truncated to the width
    width = models.PositiveSmallIntegerField(choices=RollupWidth.choices, default=RollupWidth.MINUTE)
    series = models.CharField(max_length=24)
    key = models.CharField(max_length=100, blank=True, default="")
    count = models.BigIntegerField(default=0)
    total = models.FloatField(default=0.0)
    buckets = ArrayField(models.BigIntegerField(), default=list, blank=True)
    values = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "metadata_ops_rollup"
        constraints = [
            models.UniqueConstraint(fields=["width", "series", "key", "start"], name="ops_rollup_one_per_slot"),
        ]
        indexes = [models.Index(fields=["width", "start"], name="ops_rollup_by_time")]

    def __str__(self) -> str:
        return f"{self.series}[{self.key}] {self.start:%Y-%m-%d %H:%M} ({self.get_width_display()})"


class MaintenanceAction(models.TextChoices):
    ROTATE = "rotate", "rotate now"
    ARCHIVE = "archive", "archive a partition"
    RESTORE = "restore", "restore an archive"


class MaintenanceRunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # another maintenance run held the lock; this one did nothing


class MaintenanceRun(models.Model):
    """One maintenance action an operator started from the admin, run as a Celery job.

    The record of who asked for what and when, and what came of it: the task writes its progress
    (``progress_done`` of ``progress_total`` steps, and the last line it reported) as it goes and
    its result in ``outcome``. ``archival_job_id`` names the ``PartitionArchivalJob`` an archive or
    restore run is about, as a plain number: jobs are truncated with their partitions in tests and
    by hand, and the record of a run must outlive them.
    """

    action = models.CharField(max_length=10, choices=MaintenanceAction.choices)
    target = models.CharField(max_length=500, blank=True, default="")  # a partition, or an archive file
    archival_job_id = models.BigIntegerField(null=True, blank=True)
    options = models.JSONField(default=dict, blank=True)  # e.g. {"attach": true} for a restore
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    requested_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    status = models.CharField(max_length=10, choices=MaintenanceRunStatus.choices,
                              default=MaintenanceRunStatus.QUEUED)
    progress_done = models.PositiveIntegerField(default=0)
    progress_total = models.PositiveIntegerField(default=0)
    progress_line = models.TextField(blank=True, default="")
    outcome = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    task_id = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        db_table = "metadata_maintenance_run"
        permissions = [
            ("run_rotation", "Can rotate partitions now from the admin"),
            ("run_archival", "Can archive a partition from the admin"),
            ("run_restore", "Can restore an archive from the admin"),
        ]
        indexes = [models.Index(fields=["-requested_at"], name="maintenance_run_recent")]

    def __str__(self) -> str:
        return f"{self.get_action_display()} {self.target} ({self.status})".replace("  ", " ")

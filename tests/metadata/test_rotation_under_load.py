"""Done-when: many rotations while writers insert; every row is in a table or a verified archive.

A simulated clock advances one day per rotation (retention two days, four made ahead), so every
rotation makes partitions, drains the DEFAULT partition (one row in ten is written nine days
ahead, where no partition exists yet) and archives the partitions that expired, while writer
threads keep inserting sessions with their tokens and candidates through
``insert_ignoring_conflicts`` and must never see an error.
"""
from __future__ import annotations

import datetime as dt
import gzip
import random
import threading
import time
from pathlib import Path

import pytest
from django.db import connections, transaction

from metadata.models import ModelVersion
from metadata.archival import ArchiveManifest, checksum_of_archive, manifest_path
from metadata.models import (
    ArchivalStep,
    Candidate,
    PartitionArchivalJob,
    Session,
    SessionStatus,
    Tenant,
    TokenKind,
    TokenRecord,
)
from metadata.partitions import PartitionPolicy, PartitionRotation
from metadata.history import insert_ignoring_conflicts
from tests.metadata.partition_helpers import BackgroundThreads, day, row_count

POLICY = PartitionPolicy(premake=4, retention=dt.timedelta(days=2))
SESSION_KEY = ("id",)
TOKEN_KEY = ("session_id", "position")
CANDIDATE_KEY = ("session_id", "step", "branch")


class Writers(BackgroundThreads):
    """Threads inserting tokens and candidates at the simulated clock until stopped."""

    def __init__(self, threads: int, pause: float, tenant_id: int, target_id: int) -> None:
        self.tenant_id, self.target_id = tenant_id, target_id
        self.now = day(0)
        self.pause = pause
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.sessions: list[tuple[str]] = []
        self.tokens: list[tuple[str, int]] = []
        self.candidates: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(threads)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not self.stop.is_set():
                self._write_one_session(rng)
                time.sleep(self.pause)
        except BaseException as exc:  # reported by the test: writers must see no error
            self.errors.append(exc)
        finally:
            connections.close_all()

    def _write_one_session(self, rng: random.Random) -> None:
        ahead = dt.timedelta(days=9) if rng.random() < 0.1 else dt.timedelta(0)
        session = Session(tenant_id=self.tenant_id, target_id=self.target_id, drafter="none", queue="cpu",
                          prompt="p", prompt_tokens=1, status=SessionStatus.SUCCEEDED,
                          created_at=self.now + ahead + dt.timedelta(seconds=rng.randrange(86_400)))
        session_id, created = session.pk, session.created_at  # a UUIDv7 of its creation time
        tokens = [TokenRecord(session_id=session_id, session_created_at=created, position=p, step=p // 3,
                              token_id=rng.randrange(50_000), piece=f"t{p}", kind=TokenKind.ACCEPTED,
                              logprob=-rng.random()) for p in range(rng.randrange(20, 120))]
        candidates = [Candidate(session_id=session_id, session_created_at=created, step=s, branch=b,
                                token_ids=[s, b], score=round(rng.random(), 2), accepted_len=b)
                      for s in range(rng.randrange(5, 20)) for b in range(3)]
        insert_ignoring_conflicts(Session, [session])
        insert_ignoring_conflicts(TokenRecord, tokens)
        insert_ignoring_conflicts(Candidate, candidates)
        with self.lock:
            self.sessions.append((str(session_id),))
            self.tokens += [(str(session_id), t.position) for t in tokens]
            self.candidates += [(str(session_id), c.step, c.branch) for c in candidates]


def rotate_under_load(rotations: int, threads: int, pause: float = 0.0) -> Writers:
    tenant = Tenant.objects.create(name="writers")
    target = ModelVersion.objects.create(name="m", version="1", role="target", path="/nonexistent", context_length=64)
    with Writers(threads, pause, tenant.pk, target.pk) as writers:
        for n in range(rotations):
            writers.now = day(n)
            report = PartitionRotation(POLICY, progress=lambda _: None).run(day(n))
            assert report.failed == [], report.failed
            time.sleep(0.05)  # let the writers in between rotations too
    assert writers.errors == [], writers.errors[:3]
    return writers


def archived_jobs(table: str) -> list[PartitionArchivalJob]:
    return list(PartitionArchivalJob.objects.using("default").filter(parent_table=table))


def assert_accounted(table: str, written: list[tuple]) -> list[PartitionArchivalJob]:
    """Rows written = rows in the table + rows in verified archives; each archive re-verified."""
    jobs = archived_jobs(table)
    assert jobs and all(j.step == ArchivalStep.DROPPED for j in jobs), [(j.partition, j.step, j.error) for j in jobs]
    assert len(set(written)) == len(written)
    assert row_count(table) + sum(j.row_count for j in jobs) == len(written)
    for job in jobs:
        manifest = ArchiveManifest.read(manifest_path(Path(job.archive_path)))
        with transaction.atomic(using="default"):
            again = checksum_of_archive(Path(job.archive_path), table, manifest.columns, lambda _: None)
        assert again == (job.row_count, job.checksum), job.partition
    return jobs


def keys_in_archives(jobs: list[PartitionArchivalJob], key: tuple[str, ...]) -> list[tuple]:
    keys = []
    for job in jobs:
        columns = ArchiveManifest.read(manifest_path(Path(job.archive_path))).columns
        at = [columns.index(k) for k in key]
        with gzip.open(job.archive_path, "rt") as fh:
            for line in fh:
                fields = line.rstrip("\n").split("\t")
                keys.append(tuple(fields[i] if n == 0 else int(fields[i]) for n, i in enumerate(at)))
    return keys


def keys_in_table(table: str, key: tuple[str, ...]) -> list[tuple]:
    with connections["default"].cursor() as cursor:
        cursor.execute(f"SELECT {', '.join([key[0] + '::text', *key[1:]])} FROM {table}")
        return [tuple(row) for row in cursor.fetchall()]


def test_a_few_rotations_under_concurrent_writes_lose_and_duplicate_nothing(partitioned) -> None:
    writers = rotate_under_load(rotations=6, threads=2)
    session_jobs = assert_accounted("metadata_session", writers.sessions)
    sessions = keys_in_table("metadata_session", SESSION_KEY) + keys_in_archives(session_jobs, SESSION_KEY)
    assert sorted(sessions) == sorted(writers.sessions)
    token_jobs = assert_accounted("metadata_token", writers.tokens)
    candidate_jobs = assert_accounted("metadata_candidate", writers.candidates)
    assert len(token_jobs) >= 3
    # Row by row: the union of table and archives is exactly what the writers wrote, once each.
    tokens = keys_in_table("metadata_token", TOKEN_KEY) + keys_in_archives(token_jobs, TOKEN_KEY)
    assert sorted(tokens) == sorted(writers.tokens)
    candidates = keys_in_table("metadata_candidate", CANDIDATE_KEY) + keys_in_archives(candidate_jobs, CANDIDATE_KEY)
    assert sorted(candidates) == sorted(writers.candidates)


@pytest.mark.slow
def test_forty_rotations_under_concurrent_writes(partitioned) -> None:
    # Paced writers: saturated ones would only stretch the run (2 cores) without a new interleaving.
    # Forty rotations take each day through made, written, drained, archived and dropped, forty
    # times over, with every assertion of the hundred this once ran (14 minutes of a loaded suite).
    rotations = 40
    writers = rotate_under_load(rotations=rotations, threads=2, pause=0.01)
    assert_accounted("metadata_session", writers.sessions)
    token_jobs = assert_accounted("metadata_token", writers.tokens)
    assert_accounted("metadata_candidate", writers.candidates)
    assert len(token_jobs) >= rotations - 3  # one day expires per rotation (plus drained far-ahead days)

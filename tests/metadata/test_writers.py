"""Batched, idempotent writes: a redelivered task writes nothing twice; one transaction per batch."""
from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest
from django.db import IntegrityError, connection
from django.test.utils import CaptureQueriesContext

from metadata.models import Candidate, TokenKind, TokenRecord
from metadata.history import BufferedWriter, insert_ignoring_conflicts

CREATED = dt.datetime(2030, 1, 1, 12, tzinfo=dt.timezone.utc)


def tokens(session_id: uuid.UUID, positions) -> list[TokenRecord]:
    return [TokenRecord(session_id=session_id, session_created_at=CREATED, position=p, step=p // 4, token_id=p,
                        piece=f"t{p}", kind=TokenKind.ACCEPTED, logprob=-0.5) for p in positions]


def stored_positions(session_id: uuid.UUID) -> list[int]:
    rows = TokenRecord.objects.using("default").filter(session_id=session_id).order_by("position")
    return list(rows.values_list("position", flat=True))


def inserts(queries) -> list[str]:
    return [q["sql"] for q in queries if q["sql"].startswith("INSERT INTO")]


def rows_in(sql: str) -> int:
    """Rows in one multi-row INSERT: Django 5.2 sends ``SELECT * FROM UNNEST(arrays)``, else VALUES."""
    unnest = re.search(r"UNNEST\(\('\{([^}]*)\}'", sql)
    if unnest:
        return unnest.group(1).count(",") + 1
    return sql.count("), (") + 1


def test_a_redelivered_task_writes_nothing_twice(transactional_db) -> None:
    session_id = uuid.uuid4()
    insert_ignoring_conflicts(TokenRecord, tokens(session_id, range(250)))
    insert_ignoring_conflicts(TokenRecord, tokens(session_id, range(250)))  # the same task, redelivered
    insert_ignoring_conflicts(TokenRecord, tokens(session_id, range(200, 300)))  # a crash after 200, rerun
    assert stored_positions(session_id) == list(range(300))


def test_rows_go_out_in_multi_row_statements_of_at_most_the_batch_size(transactional_db, settings) -> None:
    settings.SPECOPS_TOKEN_BATCH_SIZE = 40
    session_id = uuid.uuid4()
    with CaptureQueriesContext(connection) as captured:
        written = insert_ignoring_conflicts(TokenRecord, tokens(session_id, range(250)))
    statements = inserts(captured.captured_queries)
    assert written == 250 and len(statements) == 7  # ceil(250 / 40), not 250 single-row INSERTs
    rows_per_statement = [rows_in(sql) for sql in statements]
    assert rows_per_statement == [40] * 6 + [10]
    assert all("ON CONFLICT DO NOTHING" in sql for sql in statements)


def test_the_default_batch_is_one_hundred_rows(transactional_db) -> None:
    with CaptureQueriesContext(connection) as captured:
        insert_ignoring_conflicts(TokenRecord, tokens(uuid.uuid4(), range(201)))
    assert [rows_in(sql) for sql in inserts(captured.captured_queries)] == [100, 100, 1]


def test_each_batch_commits_on_its_own(transactional_db) -> None:
    """A bad row in the third batch loses that batch only; the first two are committed."""
    session_id = uuid.uuid4()
    rows = tokens(session_id, range(250))
    rows[230].position = -1  # violates the CHECK (position >= 0) the PositiveIntegerField made
    with pytest.raises(IntegrityError):
        insert_ignoring_conflicts(TokenRecord, rows)
    assert stored_positions(session_id) == list(range(200))


def test_buffered_writer_flushes_full_batches_and_the_tail(transactional_db) -> None:
    session_id = uuid.uuid4()
    writer = BufferedWriter(Candidate, batch_size=3)
    for step in range(7):
        writer.add(Candidate(session_id=session_id, session_created_at=CREATED, step=step, branch=0,
                             token_ids=[step], score=-step / 2, accepted_len=1))
        if step == 5:
            assert Candidate.objects.using("default").filter(session_id=session_id).count() == 6  # two full batches out
    writer.flush()
    assert writer.written == 7 and Candidate.objects.using("default").filter(session_id=session_id).count() == 7

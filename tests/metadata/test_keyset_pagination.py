"""Keyset pagination: pages concatenated are the full ORDER BY, also with inserts between pages.

Many ties on the leading key (a handful of scores, -inf and -0.0 included) are where a wrong
predicate skips or repeats rows. Rows inserted between page fetches appear if they sort after
the cursor and never otherwise; rows that existed at the start all appear, exactly once.
"""
from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.db import connection
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metadata.api.pagination import (
    CandidatePagination,
    SessionPagination,
    TokenPagination,
    after_predicate,
    decode_cursor,
)
from metadata.models import Candidate, Session, Tenant, TokenKind, TokenRecord

CREATED = dt.datetime(2030, 1, 1, 12, tzinfo=dt.timezone.utc)
SCORES = [float("-inf"), -2.5, -0.0, 0.0, 0.75, 3.0]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

candidate_keys = st.tuples(st.integers(0, 12), st.integers(0, 3))  # (step, branch), unique per session
candidate_rows = st.dictionaries(candidate_keys, st.sampled_from(SCORES), max_size=40)


def candidate_sort_key(row: tuple[float, int, int]) -> tuple[float, int, int]:
    score, step, branch = row
    return (-score, step, branch)  # score DESC, step ASC, branch ASC


def insert_candidates(session_id: uuid.UUID, rows: dict[tuple[int, int], float]) -> None:
    Candidate.objects.bulk_create(
        [Candidate(session_id=session_id, session_created_at=CREATED, step=step, branch=branch, token_ids=[1],
                   score=score, accepted_len=0) for (step, branch), score in rows.items()],
        ignore_conflicts=True,
    )


def walk(pagination, queryset, size, between_pages=lambda page_number, last_row: None):
    """Follow the cursors to the end; call ``between_pages`` after each page but the last."""
    seen, cursor, page_number = [], None, 0
    while True:
        rows, cursor = pagination.page(queryset, cursor, size)
        seen.extend(rows)
        if cursor is None:
            return seen
        between_pages(page_number, rows[-1])
        page_number += 1


@pytest.mark.django_db
@PROPERTY
@given(rows=candidate_rows, size=st.integers(1, 7))
def test_candidate_pages_concatenate_to_the_full_order(rows, size) -> None:
    session_id = uuid.uuid4()
    insert_candidates(session_id, rows)
    queryset = Candidate.objects.filter(session_id=session_id, session_created_at=CREATED)
    full = [(c.score, c.step, c.branch) for c in queryset.order_by("-score", "step", "branch")]
    paged = [(c.score, c.step, c.branch) for c in walk(CandidatePagination(), queryset, size)]
    assert paged == full
    assert sorted(full, key=candidate_sort_key) == full  # the database order is the one we model


@pytest.mark.django_db
@PROPERTY
@given(rows=candidate_rows, later=st.lists(candidate_rows, max_size=4), size=st.integers(1, 7))
def test_candidate_pages_with_inserts_between_fetches(rows, later, size) -> None:
    session_id = uuid.uuid4()
    insert_candidates(session_id, rows)
    present = {key: score for key, score in rows.items()}
    must_appear = {(score, *key) for key, score in rows.items()}
    must_not_appear = set()

    def insert_more(page_number: int, last: Candidate) -> None:
        if page_number >= len(later):
            return
        cursor_key = candidate_sort_key((last.score, last.step, last.branch))
        fresh = {k: s for k, s in later[page_number].items() if k not in present}
        insert_candidates(session_id, fresh)
        present.update(fresh)
        for (step, branch), score in fresh.items():
            target = must_appear if candidate_sort_key((score, step, branch)) > cursor_key else must_not_appear
            target.add((score, step, branch))

    queryset = Candidate.objects.filter(session_id=session_id, session_created_at=CREATED)
    paged = [(c.score, c.step, c.branch) for c in walk(CandidatePagination(), queryset, size, insert_more)]
    keys = [candidate_sort_key(r) for r in paged]
    assert keys == sorted(keys) and len(set(keys)) == len(keys), "in order, nothing repeated"
    assert set(paged) == must_appear, "every row that existed or was inserted ahead of the cursor; none behind"
    assert not set(paged) & must_not_appear


@pytest.mark.django_db
@PROPERTY
@given(positions=st.sets(st.integers(0, 500), max_size=60), later=st.sets(st.integers(0, 500), max_size=20),
       size=st.integers(1, 9))
def test_token_pages_by_position_with_inserts(positions, later, size) -> None:
    session_id = uuid.uuid4()

    def tokens(ps):
        return [TokenRecord(session_id=session_id, session_created_at=CREATED, position=p, step=0, token_id=p,
                            piece="x", kind=TokenKind.TARGET) for p in ps]

    TokenRecord.objects.bulk_create(tokens(positions))
    inserted_ahead: set[int] = set()

    def insert_more(page_number: int, last: TokenRecord) -> None:
        if page_number == 0:
            fresh = later - positions
            TokenRecord.objects.bulk_create(tokens(fresh))
            inserted_ahead.update(p for p in fresh if p > last.position)

    queryset = TokenRecord.objects.filter(session_id=session_id, session_created_at=CREATED)
    paged = [t.position for t in walk(TokenPagination(), queryset, size, insert_more)]
    assert paged == sorted(positions | inserted_ahead)


@pytest.mark.django_db
@PROPERTY
@given(stamps=st.lists(st.sampled_from([0, 0, 1, 2]), max_size=25), size=st.integers(1, 6))
def test_session_pages_with_tied_creation_times(model_version, stamps, size) -> None:
    tenant = Tenant.objects.create(name=f"t-{uuid.uuid4()}")
    Session.objects.bulk_create([
        Session(tenant=tenant, target=model_version, drafter="ngram", queue="cpu", prompt="p", prompt_tokens=1,
                created_at=CREATED + dt.timedelta(seconds=s)) for s in stamps
    ])
    queryset = Session.objects.filter(tenant=tenant)
    full = list(queryset.order_by("-created_at", "id").values_list("id", flat=True))
    assert [s.id for s in walk(SessionPagination(), queryset, size)] == full


@pytest.mark.django_db
def test_the_keyset_predicate_gives_the_index_a_range_on_score() -> None:
    """``score <= s AND (...)``: the leading conjunct is an index bound, unlike ``score < s OR ...``."""
    session_id = uuid.uuid4()
    insert_candidates(session_id, {(step, 0): float(step % 5) for step in range(50)})
    queryset = Candidate.objects.filter(session_id=session_id, session_created_at=CREATED)
    pagination = CandidatePagination()
    _, cursor = pagination.page(queryset, None, 10)
    ordered = queryset.order_by("-score", "step", "branch")
    page_query = ordered.filter(after_predicate(pagination.columns, decode_cursor(cursor, 3)))[:10]
    with connection.cursor() as db:
        db.execute("SET LOCAL enable_seqscan = off")
        db.execute("SET LOCAL enable_bitmapscan = off")
        # and no sort: with a handful of fresh rows (no statistics yet) another index plus a sort
        # can look as cheap, and the planner's pick then varies from run to run
        db.execute("SET LOCAL enable_sort = off")
    plan = page_query.explain()
    assert "_session_id_score_step_bra" in plan  # the partition's copy of candidate_by_score
    index_cond = next(line for line in plan.splitlines() if "Index Cond" in line)
    assert "score <=" in index_cond, plan


def test_tokens_endpoint_walks_with_opaque_cursors(api_client, api_user, model_version) -> None:
    session = Session.objects.create(tenant=api_user.membership.tenant, target=model_version, drafter="ngram",
                                     queue="cpu", prompt="p", prompt_tokens=1)
    TokenRecord.objects.bulk_create([
        TokenRecord(session=session, session_created_at=session.created_at, position=p, step=p, token_id=p,
                    piece=str(p), kind=TokenKind.TARGET) for p in range(23)
    ])
    url, positions = f"/api/v1/sessions/{session.id}/tokens/?page_size=5", []
    while url:
        body = api_client.get(url).json()
        positions += [t["position"] for t in body["results"]]
        url = body["next"]
    assert positions == list(range(23))
    bad = api_client.get(f"/api/v1/sessions/{session.id}/tokens/?cursor=not-ours")
    assert bad.status_code == 400 and "cursor" in bad.json()  # the error names the parameter

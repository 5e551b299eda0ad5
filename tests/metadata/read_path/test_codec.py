"""The shared tier's codec: what goes into Redis comes back as it was, and anything else is a miss."""
from __future__ import annotations

import datetime as dt
import pickle
import uuid
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from metadata.cache import codec
from metadata.models import Session, SessionStatus
from metadata.replicas import lsn
from sessions.state.cache import DETAIL, cache_for, get_session_detail

AWARE = dt.datetime(2026, 12, 7, 4, 30, 1, 123456, tzinfo=dt.UTC)


def test_every_type_a_cached_row_carries_comes_back_as_it_was():
    value = {
        "id": uuid.UUID("0192f1c6-8c1e-7abc-8def-0123456789ab"), "at": AWARE, "naive": AWARE.replace(tzinfo=None),
        "day": AWARE.date(), "time": AWARE.time(), "took": dt.timedelta(days=1, seconds=2, microseconds=3),
        "price": Decimal("1.10"), "raw": b"\x00\x80\xff", "pair": (1, "a"), "nested": [{"x": None, "y": 1.5}],
        "by_number": {1: "one", 2: "two"}, "text": "NUL \x00 and a lone \ud800 surrogate",
        "user_json": {"$t": "not a tag: a client's own key", "v": [1]}, "flag": True, "big": 2**70,
    }
    back, position = codec.loads(codec.dumps(value, 12345))
    assert back == value and position == 12345
    assert type(back["at"]) is dt.datetime and back["at"].tzinfo is not None and type(back["pair"]) is tuple


def test_a_choices_member_is_cached_as_its_text_and_an_unknown_type_is_refused():
    assert codec.loads(codec.dumps({"status": SessionStatus.QUEUED}, 1))[0] == {"status": "queued"}
    with pytest.raises(codec.UncacheableValue):
        codec.dumps({"session": object()}, 1)


@pytest.mark.parametrize("payload", [
    pickle.dumps(({"a": 1}, 5)), b"", b"not json", b"[1, 2]", b'{"format": 2, "lsn": 1, "value": 1}',
    b'{"format": 1, "lsn": "1", "value": 1}', b'{"format": 1, "lsn": 1, "value": {"$t": "eval", "v": "1"}}',
    b'{"format": 1, "lsn": 1}', b'{"format": 1, "lsn": 1, "value": {"$t": "datetime", "v": "yesterday"}}',
    b"[" * 100_000 + b"]" * 100_000,
])
def test_anything_the_codec_did_not_write_is_unreadable_never_another_error(payload):
    with pytest.raises(codec.UnreadableEntry):
        codec.loads(payload)


@pytest.mark.django_db(transaction=True)
def test_a_session_detail_comes_back_from_redis_whole_with_its_target_and_no_query(tenant, tiny_model):
    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu",
                                     prompt="p q", prompt_tokens=2, params={"temperature": 0, "$t": 1},
                                     stats={"cached_tokens": 0})
    cache = cache_for(DETAIL)
    with lsn.floor_scope():
        loaded = get_session_detail(session.pk)
        cache.clear_local()
        with CaptureQueriesContext(connection) as queries:
            from_redis = get_session_detail(session.pk)
    assert len(queries) == 0, [query["sql"] for query in queries]
    assert from_redis is not loaded
    for field in ("id", "tenant_id", "prompt", "params", "stats", "created_at", "status", "target_id"):
        assert getattr(from_redis, field) == getattr(loaded, field), field
    assert from_redis.target.name == tiny_model.name and from_redis.target.pk == tiny_model.pk

"""Redis holds no usable credential, and nothing read from it is unpickled.

After a tenant authenticates and reads its sessions (and a prediction is cached), every value in
the tests' Redis database is scanned: no API token in any key or value, no password hash, no
pickle, and the token cache's keys are not a plain hash of the token either. A pickle planted
where the caches read (one that would create a directory when unpickled) is a miss: the value
is loaded again from the database and nothing runs.
"""
from __future__ import annotations

import hashlib
import os
import pickle

import pytest
from django_redis import get_redis_connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from sessions.submission import prediction_cache
from metadata.api.authentication import CachedTokenAuthentication, token_cache
from metadata.models import Session
from metadata.replicas import lsn
from sessions.state.cache import DETAIL, STATE, cache_for, get_session_detail, get_session_state

pytestmark = pytest.mark.django_db(transaction=True)


def redis_contents() -> dict[bytes, list[bytes]]:
    """Every key of the tests' Redis database with the byte strings it holds."""
    client = get_redis_connection("default")
    contents = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            values = [client.get(key)]
        elif kind == "hash":
            values = [item for pair in client.hgetall(key).items() for item in pair]
        elif kind == "list":
            values = client.lrange(key, 0, -1)
        elif kind == "set":
            values = list(client.smembers(key))
        elif kind == "zset":
            values = client.zrange(key, 0, -1)
        elif kind == "stream":
            values = [item for _, fields in client.xrange(key) for pair in fields.items() for item in pair]
        else:
            values = []
        contents[key] = [value for value in values if value is not None]
    return contents


class RunsWhenUnpickled:
    """A pickle that, when loaded, creates ``path`` (what a write to Redis could make a process run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.fixture
def sessions(tenant, tiny_model) -> list[Session]:
    return [Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu",
                                   prompt=f"prompt {n}", prompt_tokens=2) for n in range(3)]


def test_after_a_tenant_reads_its_sessions_redis_holds_no_token_password_hash_or_pickle(api_user, sessions):
    token = Token.objects.create(user=api_user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    token_cache().clear_local()
    for session in sessions:
        assert client.get(f"/api/v1/sessions/{session.pk}/").status_code == 200
        assert get_session_state(session.pk)["tenant_id"] == session.tenant_id
    assert client.get("/api/v1/sessions/").status_code == 200
    key = prediction_cache.request_key(sessions[0].tenant_id, sessions[0].target_id, None, "ngram", "p",
                                       {"temperature": 0}, deterministic=True)
    assert prediction_cache.store(key, {"text": "x", "token_count": 1, "finish_reason": "length", "stats": {},
                                        "source_session": str(sessions[0].pk)})

    contents = redis_contents()
    token_keys = [name for name in contents if name.startswith(b"specops:c:api_token:") and not name.endswith(b":inv")]
    assert token_keys, "the token was not cached in Redis"
    plain_hash = hashlib.sha256(token.key.encode()).hexdigest().encode()
    for name, values in contents.items():
        assert token.key.encode() not in name and plain_hash not in name, name
        for value in values:
            assert token.key.encode() not in value, (name, value[:200])
            assert b"pbkdf2_" not in value and api_user.password.encode() not in value, (name, value[:200])
            assert not value.startswith(b"\x80"), (name, value[:200])  # pickle's PROTO opcode
    # the cached rows still authenticate: a known token costs no query, and the user is whole
    with lsn.floor_scope():
        user, cached = CachedTokenAuthentication().authenticate_credentials(token.key)
    assert cached.key == token.key and user.pk == api_user.pk and user.check_password("pw-alice-123")


def test_a_pickle_planted_where_the_caches_read_is_a_miss_and_never_runs(api_user, sessions, tmp_path):
    marker = tmp_path / "ran"
    planted = pickle.dumps((RunsWhenUnpickled(str(marker)), 1 << 60), protocol=pickle.HIGHEST_PROTOCOL)
    client = get_redis_connection("default")
    token = Token.objects.create(user=api_user)
    session = sessions[0]
    for cache, ident in ((cache_for(STATE), str(session.pk)), (cache_for(DETAIL), str(session.pk)),
                         (token_cache(), token.key)):
        cache.clear_local()
        client.set(cache.key(ident), planted, ex=60)
    key = prediction_cache.request_key(session.tenant_id, session.target_id, None, "ngram", "q", {"temperature": 0},
                                       deterministic=True)
    client.set(key.redis_key(0, 0), planted, ex=60)

    with lsn.floor_scope():
        state = get_session_state(session.pk)
        detail = get_session_detail(session.pk)
        user, _ = CachedTokenAuthentication().authenticate_credentials(token.key)
    assert prediction_cache.lookup(key) is None
    assert not marker.exists(), "a value read from Redis was unpickled"
    assert state["status"] == "queued" and state["tenant_id"] == session.tenant_id
    assert detail.pk == session.pk and detail.target.pk == session.target_id and detail.prompt == session.prompt
    assert user.pk == api_user.pk
    # the miss loaded the value again and stored it in the codec's form
    assert client.get(cache_for(STATE).key(str(session.pk))).startswith(b'{"format":1,')

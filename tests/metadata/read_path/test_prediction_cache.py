"""Prediction cache: a hit for a repeated deterministic request, a miss after the target is
promoted away, never a hit for a non-deterministic request."""
from __future__ import annotations

import pytest

from inference.worker.session_params import is_deterministic
from sessions.submission import prediction_cache
from metadata.models import ModelVersion
from metadata.models import Session, SessionStatus
from tests.metadata.read_path.conftest import make_session

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "stop": [], "draft_length": 4}


def finished(session: Session, text: str = "hello world") -> Session:
    session.status, session.text, session.token_count, session.finish_reason = SessionStatus.SUCCEEDED, text, 2, "length"
    session.save()
    return session


def remember(session: Session) -> bool:
    """What the worker does after a generation: cache its result (a no-op unless deterministic)."""
    return prediction_cache.remember_result(session, deterministic=is_deterministic(session.params),
                                            text=session.text, token_count=session.token_count,
                                            finish_reason=session.finish_reason, stats=session.stats)


def key_like(session: Session, **params) -> prediction_cache.RequestKey | None:
    params = {**session.params, **params}
    return prediction_cache.request_key(session.tenant_id, session.target_id, session.draft_id, session.drafter,
                                        session.prompt, params, deterministic=is_deterministic(params))


def serve(validated: dict, params: dict, tenant, user) -> Session | None:
    """What submission does first: a deterministic request answered from the cache (the serializer
    tells whether it is deterministic, by the worker's rule)."""
    return prediction_cache.serve_from_cache(validated, params, tenant, user, deterministic=is_deterministic(params))


def test_repeated_deterministic_request_hits(tenant, target_version):
    session = finished(make_session(tenant, target_version, params=GREEDY))
    assert remember(session) is True

    hit = prediction_cache.lookup(key_like(session))
    assert hit is not None and hit["text"] == "hello world" and hit["source_session"] == str(session.pk)
    assert prediction_cache.lookup(key_like(session, max_new_tokens=9)) is None  # another request
    seeded = finished(make_session(tenant, target_version, params={**GREEDY, "temperature": 0.7, "seed": 7}))
    assert remember(seeded) is True  # sampling with a seed is deterministic
    assert prediction_cache.lookup(key_like(seeded)) is not None


def test_promotion_invalidates_the_replaced_versions_entries(tenant, target_version):
    session = finished(make_session(tenant, target_version, params=GREEDY))
    remember(session)
    assert prediction_cache.lookup(key_like(session)) is not None

    successor = ModelVersion.objects.create(name=target_version.name, version="2", role="target",
                                            path=target_version.path, context_length=512)
    assert successor.promote() == [target_version]  # model_promoted is sent after commit

    assert prediction_cache.lookup(key_like(session)) is None


def test_non_deterministic_request_never_hits(tenant, target_version):
    sampled = {**GREEDY, "temperature": 0.8}  # no seed
    session = finished(make_session(tenant, target_version, params=sampled))
    assert remember(session) is False
    assert key_like(session) is None and prediction_cache.lookup(key_like(session)) is None
    greedy_twin = key_like(session, temperature=0.0)  # same prompt, greedy: nothing was stored for it
    assert prediction_cache.lookup(greedy_twin) is None


def test_api_hook_serves_a_hit_as_a_succeeded_session(tenant, api_user, target_version):
    source = finished(make_session(tenant, target_version, params=GREEDY), text="cached text")
    remember(source)
    validated = {"target": target_version, "draft": None, "drafter": source.drafter, "prompt": source.prompt,
                 "prompt_tokens": source.prompt_tokens}

    served = serve(validated, GREEDY, tenant, api_user)

    assert served is not None and served.pk != source.pk
    served.refresh_from_db()
    assert (served.status, served.text, served.created_by_id) == (SessionStatus.SUCCEEDED, "cached text", api_user.pk)
    assert served.stats["prediction_cache"] == {"hit": True, "source": str(source.pk)}
    assert serve(validated, {**GREEDY, "temperature": 0.9}, tenant, api_user) is None

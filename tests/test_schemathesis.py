"""Schemathesis against the OpenAPI schema (/api/schema/): over 1,000 cases, positive and negative, no 5xx.

In process: the schema is loaded from the project's own WSGI application and every case is sent
to it through Schemathesis' WSGI transport, authenticated with a real DRF token of a tenant user,
on the real database (the test's transaction, rolled back at the end) and the real Redis
(throttles, cache, broker). Half the cases of an operation with an ``{id}`` aim at a real session
or model, so the handlers run past their 404s. Generations are enqueued on the tests' own broker
database (no worker runs; the queue is emptied after). A 5xx is collected with the case that
caused it (its curl command and the response), and the test fails listing all of them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import redis
import schemathesis
from django.conf import settings
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis.errors import Unsatisfiable
from rest_framework.authtoken.models import Token

from metadata.models import Candidate, Session, TokenRecord
from specops.wsgi import application

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SCHEMA_PATH = "/api/schema/"
MIN_CASES = 1000
EXAMPLES = 36  # per operation, mode and target (generated or real ids); some spaces are smaller
# the operation with the richest input, where a bad value would reach the worker: more cases
EXAMPLES_OF = {"POST /api/v1/generations/": 120}
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
BROKER_QUEUE = "cpu"


@pytest.fixture
def in_process_requests() -> Iterator[None]:
    """Requests share the test's connection, as with Django's test client: a request must not close it."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def broker_queue() -> Iterator[None]:
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete(BROKER_QUEUE)
    yield
    client.delete(BROKER_QUEUE)


@pytest.fixture
def real_session(tenant, tiny_model) -> Session:
    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu",
                                     prompt="x = 1\n", prompt_tokens=3, params={"max_new_tokens": 4})
    TokenRecord.objects.bulk_create([
        TokenRecord(session=session, session_created_at=session.created_at, position=p, step=p // 2, token_id=p,
                    piece="x", kind=p % 4) for p in range(6)])
    Candidate.objects.bulk_create([
        Candidate(session=session, session_created_at=session.created_at, step=s, branch=b, token_ids=[s, b],
                  score=float(b - s), accepted_len=b) for s in range(3) for b in range(2)])
    return session


def test_no_case_of_the_schema_is_a_server_error(api_user, tiny_model, real_session, in_process_requests,
                                                 broker_queue):
    auth = {"Authorization": f"Token {Token.objects.create(user=api_user).key}"}
    schema = schemathesis.openapi.from_wsgi(SCHEMA_PATH, application, headers=auth)
    real_ids = {"session": str(real_session.pk), "models": tiny_model.pk}
    counts: Counter[str] = Counter()
    server_errors: list[str] = []
    unsatisfiable: list[str] = []

    def run(strategy, label: str, examples: int) -> None:
        """Send ``examples`` cases of ``strategy``; count them under ``label``, collect any 5xx."""
        @hypothesis_settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                             phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def send(case) -> None:
            response = case.call(headers=auth)
            counts[label] += 1
            if response.status_code >= 500:
                server_errors.append(f"{response.status_code} from {case.as_curl_command(headers=auth)}\n"
                                     f"  {response.text[:500]}")

        try:
            send()
        except Unsatisfiable:  # nothing to negate (no parameters, or only the fixed id)
            unsatisfiable.append(label)

    for result in schema.get_all_operations():
        operation = result.ok()
        targets = [None]
        if "{id}" in operation.path:
            targets.append({"id": real_ids["models" if "/models/" in operation.path else "session"]})
        for mode in MODES:
            for path_parameters in targets:
                strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)
                label = f"{operation.label} {mode.value}{' (real id)' if path_parameters else ''}"
                run(strategy, label, EXAMPLES_OF.get(operation.label, EXAMPLES))

    total = sum(counts.values())
    summary = "\n".join(f"  {label}: {count}" for label, count in sorted(counts.items()))
    summary += f"\n  no cases to generate: {unsatisfiable}"
    print(f"{total} cases:\n{summary}")
    assert not server_errors, f"{len(server_errors)} server errors:\n" + "\n".join(server_errors[:20])
    assert total >= MIN_CASES, f"only {total} cases ran:\n{summary}"
    assert any(" negative" in k for k in counts) and any(" positive" in k for k in counts), summary
    assert Session.objects.count() > 1  # positive generations were accepted (and enqueued), not only refused

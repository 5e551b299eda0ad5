"""Schemathesis against both APIs: over 1,000 cases of each, positive and negative, no 5xx.

The REST API's schema is served at /api/schema/ (drf-spectacular); the OpenAI API's is written by
hand (``tests/openai_schema.py``: the plain async views have no generated one), its
``model`` narrowed to the test's model so positive cases reach a generation.
In process: the schema is loaded from the project's own WSGI application and every case is sent
to it through Schemathesis' WSGI transport, authenticated with a real DRF token of a tenant user,
on the real database (the test's transaction, rolled back at the end) and the real Redis
(throttles, cache, broker). Half the cases of an operation with an ``{id}`` aim at a real session
or model, so the handlers run past their 404s. Generations are enqueued on the tests' own broker
database (no worker runs; the queue is emptied after). A 5xx is collected with the case that
caused it (its curl command and the response), and the test fails listing all of them. No worker
runs, so a valid non-streaming OpenAI request waits its (shortened) SPECOPS_OPENAI_TIMEOUT_S and
ends in a 504 ``timeout`` ("it goes on as a session"): counted apart, not as a server error; a
stream ends at its (shortened) idle limit.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

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
from tests.openai_schema import openai_schema

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

SCHEMA_PATH = "/api/schema/"
MIN_CASES = 1000
EXAMPLES = 36  # per operation, mode and target (generated or real ids); some spaces are smaller
# the operation with the richest input, where a bad value would reach the worker: more cases
EXAMPLES_OF = {"POST /api/v1/generations/": 120, "POST /v1/completions": 180, "POST /v1/chat/completions": 180,
               "GET /v1/models/{model}": 60}
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


class Fuzzer:
    """Sends the cases of a schema's operations; counts them by label and collects every 5xx."""

    def __init__(self, auth: dict[str, str]) -> None:
        self.auth = auth
        self.counts: Counter[str] = Counter()
        self.server_errors: list[str] = []
        self.unsatisfiable: list[str] = []
        self.timeouts = 0

    def run(self, strategy, label: str, examples: int) -> None:
        """Send ``examples`` cases of ``strategy``; count them under ``label``, collect any 5xx."""
        @hypothesis_settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                             phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def send(case) -> None:
            response = case.call(headers=self.auth)
            self.counts[label] += 1
            if response.status_code == 504 and '"timeout"' in response.text:
                self.timeouts += 1  # a valid generation that no worker runs: "it goes on as a session"
            elif response.status_code >= 500:
                self.server_errors.append(f"{response.status_code} from {case.as_curl_command(headers=self.auth)}\n"
                                          f"  {response.text[:500]}")

        try:
            send()
        except Unsatisfiable:  # nothing to negate (no parameters, or only the fixed id)
            self.unsatisfiable.append(label)

    def run_schema(self, schema, real_id: Callable[[str], dict | None]) -> None:
        """Every operation, positive and negative; one with a path parameter also aimed at a real
        row (``real_id(path)``: its path parameters, or None)."""
        for result in schema.get_all_operations():
            operation = result.ok()
            targets = [None]
            if real_id(operation.path) is not None:
                targets.append(real_id(operation.path))
            for mode in MODES:
                for path_parameters in targets:
                    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)
                    label = f"{operation.label} {mode.value}{' (real id)' if path_parameters else ''}"
                    self.run(strategy, label, EXAMPLES_OF.get(operation.label, EXAMPLES))

    def total(self, prefix: str) -> int:
        return sum(count for label, count in self.counts.items() if label.split(" ")[1].startswith(prefix))

    def summary(self) -> str:
        lines = "\n".join(f"  {label}: {count}" for label, count in sorted(self.counts.items()))
        return (f"{sum(self.counts.values())} cases:\n{lines}\n  no cases to generate: {self.unsatisfiable}\n"
                f"  504 timeouts of valid generations (no worker runs): {self.timeouts}")


def test_no_case_of_either_api_is_a_server_error(api_user, tiny_model, real_session, in_process_requests,
                                                  broker_queue, settings):
    settings.SPECOPS_OPENAI_TIMEOUT_S = 0.02  # no worker runs: a valid generation's wait ends at once
    settings.SPECOPS_STREAM_IDLE_LIMIT_S = 0.05  # and so does its stream
    auth = {"Authorization": f"Token {Token.objects.create(user=api_user).key}"}
    fuzzer = Fuzzer(auth)
    rest = schemathesis.openapi.from_wsgi(SCHEMA_PATH, application, headers=auth)
    fuzzer.run_schema(rest, lambda path: None if "{id}" not in path else {
        "id": tiny_model.pk if "/models/" in path else str(real_session.pk)})
    rest_sessions = Session.objects.count() - 1
    openai = schemathesis.openapi.from_dict(openai_schema([tiny_model.name]))
    openai.app = application
    fuzzer.run_schema(openai, lambda path: {"model": tiny_model.name} if "{model}" in path else None)
    openai_sessions = Session.objects.count() - 1 - rest_sessions

    summary = fuzzer.summary()
    print(summary)
    assert not fuzzer.server_errors, f"{len(fuzzer.server_errors)} server errors:\n" + "\n".join(
        fuzzer.server_errors[:20])
    assert fuzzer.total("/api/") >= MIN_CASES and fuzzer.total("/v1/") >= MIN_CASES, summary
    assert any(" negative" in k for k in fuzzer.counts) and any(" positive" in k for k in fuzzer.counts), summary
    # positive generations of both APIs were accepted (and enqueued), not only refused
    assert rest_sessions > 0 and openai_sessions > 0, (rest_sessions, openai_sessions)

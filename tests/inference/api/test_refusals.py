"""A generation the platform refuses (the broker down, an unknown model): one service raises plain
errors (``sessions.submission``, ``inference.served_targets``), and each API answers in its own shape."""
from __future__ import annotations

import pytest
from rest_framework.exceptions import APIException

from inference.served_targets import ModelBuilding, ModelNotServed
from metadata.models import Session, SessionStatus
from sessions import tasks
from sessions.submission import GenerationRefused, QueueUnavailable

REST = "/api/v1/generations/"
OPENAI = "/v1/completions"


@pytest.fixture
def broker_down(monkeypatch):
    def refuse(*args, **kwargs):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(tasks.generate, "apply_async", refuse)


def test_the_service_raises_no_http_exception():
    for refusal in (QueueUnavailable, ModelNotServed, ModelBuilding):
        assert issubclass(refusal, GenerationRefused) and not issubclass(refusal, APIException)


@pytest.mark.django_db
def test_broker_down_is_a_503_in_the_rest_shape_and_the_session_failed(api_client, tiny_model, broker_down):
    response = api_client.post(REST, {"prompt": "import os\n", "max_new_tokens": 4, "temperature": 0.7},
                               format="json")
    assert response.status_code == 503
    assert response.json() == {"detail": "the task queue is unavailable; try again shortly.", "status": 503}
    session = Session.objects.get()
    assert session.status == SessionStatus.FAILED and session.error.startswith("enqueue failed:")
    assert session.finished_at is not None  # ended as every session ends (end_session)


@pytest.mark.django_db
def test_broker_down_is_a_503_in_the_openai_shape_with_retry_after(api_client, tiny_model, broker_down):
    response = api_client.post(OPENAI, {"model": tiny_model.name, "prompt": "import os\n", "max_tokens": 4,
                                        "temperature": 0.7}, format="json")
    assert response.status_code == 503 and response["Retry-After"] == "5"
    error = response.json()["error"]
    assert error["code"] == "queue_unavailable" and error["message"] == "the task queue is unavailable; try again shortly."
    assert Session.objects.get().status == SessionStatus.FAILED


@pytest.mark.django_db
def test_an_unknown_model_is_a_400_on_model_in_rest_and_a_404_in_openai(api_client, tiny_model):
    rest = api_client.post(REST, {"prompt": "x", "model": "nope"}, format="json")
    openai = api_client.post(OPENAI, {"model": "nope", "prompt": "x"}, format="json")
    assert rest.status_code == 400 and rest.json()["model"] == ["no active target model named 'nope'."]
    assert openai.status_code == 404 and openai.json()["error"]["code"] == "model_not_found"
    assert api_client.get("/v1/models/nope").status_code == 404
    assert Session.objects.count() == 0

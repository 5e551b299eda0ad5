"""Production-safe defaults: DEBUG off unless set, JSON errors without tracebacks or settings,
a JSON 413 naming the body limit, a 400 for JSON nested too deeply. Both APIs, each in its shape."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.test import Client

from inference.api import views as rest_views
from inference.api.openai import views as openai_views
from tests.core.test_configuration import ROOT

SECRET_HOST = "db-secret-host.internal"


def test_debug_is_off_unless_the_environment_sets_it():
    env = {k: v for k, v in os.environ.items() if k != "DEBUG"}
    result = subprocess.run(  # the settings module alone: no app (and no torch) is loaded
        [sys.executable, "-c", "from specops import settings; print(settings.DEBUG)"],
        cwd=ROOT, env={**env, "SECRET_KEY": "a-key-for-this-test-only-0123456789"}, capture_output=True, text=True,
        timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.django_db
def test_a_crash_is_a_json_500_without_traceback_or_settings(api_client, api_user, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError(f"could not connect to {SECRET_HOST}")

    monkeypatch.setattr(rest_views.ModelVersionViewSet, "list", crash)
    monkeypatch.setattr(openai_views, "_active_targets", crash)
    api_client.raise_request_exception = False

    rest = api_client.get("/api/v1/models/")
    openai = api_client.get("/v1/models")

    assert rest.status_code == 500 and rest["Content-Type"] == "application/json"
    assert rest.json() == {"detail": "internal server error; the failure has been logged.", "status": 500}
    assert openai.status_code == 500 and openai.json()["error"]["type"] == "server_error"
    for response in (rest, openai):
        assert SECRET_HOST not in response.content.decode() and "Traceback" not in response.content.decode()


@pytest.mark.django_db
def test_an_unknown_path_is_a_json_404_in_each_api_shape():
    client = Client()
    rest = client.get("/api/v1/nothing-here/")
    openai = client.get("/v1/nothing-here")
    assert rest.status_code == 404 and rest.json()["status"] == 404
    assert openai.status_code == 404 and openai.json()["error"]["code"] == "not_found"


@pytest.mark.django_db
def test_a_body_over_the_limit_is_a_json_413_naming_the_limit(api_client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    body = '{"prompt": "' + "x" * 20_000 + '"}'

    rest = api_client.post("/api/v1/generations/", body, content_type="application/json")
    openai = api_client.post("/v1/chat/completions", body, content_type="application/json")

    assert rest.status_code == 413 and "DATA_UPLOAD_MAX_MEMORY_SIZE" in rest.json()["detail"]
    assert "10000 bytes" in rest.json()["detail"] and f"{len(body)} bytes" in rest.json()["detail"]
    assert openai.status_code == 413 and "DATA_UPLOAD_MAX_MEMORY_SIZE" in openai.json()["error"]["message"]


@pytest.mark.django_db
def test_json_nested_too_deeply_is_a_400_naming_the_body(api_client, tiny_model):
    body = "[" * 100_000 + "]" * 100_000

    rest = api_client.post("/api/v1/generations/", body, content_type="application/json")
    openai = api_client.post("/v1/completions", body, content_type="application/json",
                             HTTP_AUTHORIZATION=api_client._credentials["HTTP_AUTHORIZATION"])

    assert rest.status_code == 400 and rest.json()["detail"].startswith("request body:")
    assert openai.status_code == 400 and openai.json()["error"]["message"].startswith("request body:")

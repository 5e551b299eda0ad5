"""POST /api/v1/generations/ and GET /api/v1/sessions/{id}/: validation, auth, tenancy; registering a pair."""
from __future__ import annotations

import uuid

import pytest
from rest_framework.test import APIClient

from inference.engine.drafters import DRAFTERS, PARAMETER_NAMES
from metadata.models import Session, Tenant
from tests.helpers import empty_queue, queued_messages

URL = "/api/v1/generations/"




@pytest.fixture(autouse=True)
def empty_cpu_queue():
    empty_queue("cpu")


@pytest.mark.django_db
def test_no_token_is_401(tiny_model):
    assert APIClient().post(URL, {"prompt": "x"}, format="json").status_code == 401
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert bad.get(f"/api/v1/sessions/{uuid.uuid4()}/").status_code == 401


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field, rule",
    [
        ({}, "prompt", "required"),
        ({"prompt": "def f():", "max_new_tokens": 0}, "max_new_tokens", "greater than or equal to 1"),
        ({"prompt": "def f():", "max_new_tokens": "many"}, "max_new_tokens", "valid integer"),
        ({"prompt": "def f():", "temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"prompt": "def f():", "top_p": 0}, "top_p", "greater than 0"),
        ({"prompt": "def f():", "drafter": "magic"}, "drafter", "not a valid choice"),
        ({"prompt": "def f():", "draft_length": 9}, "draft_length", "less than or equal to 8"),
        ({"prompt": "def f():", "model": "nope"}, "model", "no active target model named 'nope'"),
        ({"prompt": "def f():", "stop": ["a", "b", "c", "d", "e"]}, "stop", "no more than 4"),
    ],
)
def test_bad_input_is_400_naming_field_and_rule(api_client, tiny_model, body, field, rule):
    response = api_client.post(URL, body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert rule in " ".join(map(str, response.json()[field]))
    assert Session.objects.count() == 0
    assert queued_messages() == 0


@pytest.mark.django_db
def test_prompt_longer_than_the_context_is_400_and_leaves_nothing(api_client, tiny_model):
    prompt = "def f(x):\n    return x\n" * 2000  # far beyond the tiny model's 1024 positions
    response = api_client.post(URL, {"prompt": prompt}, format="json")
    assert response.status_code == 400
    assert "accepts at most 1024 tokens" in response.json()["prompt"][0]
    assert Session.objects.count() == 0
    assert queued_messages() == 0


@pytest.mark.django_db
def test_accepted_request_writes_a_session_and_enqueues_on_the_model_queue(api_client, tiny_model):
    response = api_client.post(URL, {"prompt": "import os\n", "max_new_tokens": 8}, format="json")
    assert response.status_code == 202, response.content
    body = response.json()
    session = Session.objects.get(pk=body["id"])
    assert session.status == "queued" and session.queue == "cpu" and session.drafter == "draft_model"
    assert session.params["max_new_tokens"] == 8 and session.prompt_tokens > 0
    assert body["url"].endswith(f"/api/v1/sessions/{session.pk}/")
    assert response["Location"] == body["url"]
    assert queued_messages("cpu") == 1


@pytest.mark.django_db
def test_sessions_are_tenant_scoped_and_unknown_is_404(api_client, tiny_model):
    created = api_client.post(URL, {"prompt": "import os\n"}, format="json").json()
    assert api_client.get(f"/api/v1/sessions/{created['id']}/").json()["status"] == "queued"
    assert api_client.get(f"/api/v1/sessions/{uuid.uuid4()}/").status_code == 404

    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from metadata.models import TenantMembership

    other = get_user_model().objects.create_user("mallory")
    TenantMembership.objects.create(user=other, tenant=Tenant.objects.create(name="other"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=other).key}")
    assert client.get(f"/api/v1/sessions/{created['id']}/").status_code == 404
    assert client.get("/api/v1/sessions/").json()["results"] == []


@pytest.mark.django_db
def test_model_promotion_needs_an_operator(api_client, tiny_model, admin_client):
    assert api_client.post(f"/api/v1/models/{tiny_model.pk}/promote/").status_code == 403
    listed = api_client.get("/api/v1/models/").json()
    assert {(m["name"], m["role"], m["status"]) for m in listed} == {("tiny", "target", "active"),
                                                                      ("tiny", "draft", "active")}
    from inference.registry import register_version

    newer = register_version("tiny", "2", "target", tiny_model.directory)
    response = admin_client.post(f"/api/v1/models/{newer.pk}/promote/")
    assert response.status_code == 200 and response.json()["replaced"] == [tiny_model.pk]
    tiny_model.refresh_from_db()
    assert tiny_model.status == "retired"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field, rule",
    [
        ({"drafter": "tree", "draft_length": 3}, "draft_length",
         "the 'tree' drafter does not take draft_length (it takes tree_width, tree_depth, node_budget)"),
        ({"drafter": "none", "tree_width": 2}, "tree_width", "the 'none' drafter does not take tree_width"),
        ({"drafter": "draft_model", "ngram_size": 2}, "ngram_size", "the 'draft_model' drafter does not"),
        ({"node_budget": 4}, "node_budget", "the 'draft_model' drafter does not take node_budget"),  # the default
        ({"drafter": "tree", "tree_depth": 0}, "tree_depth", "greater than or equal to 1"),
        ({"drafter": "tree", "node_budget": 65}, "node_budget", "less than or equal to 64"),
    ],
)
def test_a_parameter_the_drafter_does_not_take_is_400_naming_it_and_the_drafter(api_client, tiny_model, body,
                                                                               field, rule):
    response = api_client.post(URL, {"prompt": "def f():", **body}, format="json")
    assert response.status_code == 400, response.content
    assert rule in " ".join(map(str, response.json()[field]))
    assert Session.objects.count() == 0 and queued_messages() == 0


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, drafter, stored",
    [
        ({}, "draft_model", {"draft_length": 4}),
        ({"drafter": "tree", "tree_width": 3}, "tree", {"tree_width": 3, "tree_depth": 4, "node_budget": 8}),
        ({"drafter": "ngram", "draft_length": 6}, "ngram", {"draft_length": 6, "ngram_size": 3}),
        ({"drafter": "none"}, "none", {}),
    ],
)
def test_the_session_stores_every_parameter_of_its_drafter_and_no_other(api_client, tiny_model, body, drafter,
                                                                         stored):
    response = api_client.post(URL, {"prompt": "import os\n", **body}, format="json")
    assert response.status_code == 202, response.content
    session = Session.objects.get(pk=response.json()["id"])
    assert session.drafter == drafter
    assert {key: value for key, value in session.params.items() if key in PARAMETER_NAMES} == stored
    config = DRAFTERS[drafter].draft_config(session.params)  # what the worker builds from the row
    assert all(getattr(config, p.field) == stored[p.name] for p in DRAFTERS[drafter].parameters)


def test_the_drafter_choices_are_the_registry_s():
    from inference.api.serializers import GenerationRequestSerializer

    fields = GenerationRequestSerializer().fields
    assert list(fields["drafter"].choices) == list(DRAFTERS) and "auto" in DRAFTERS
    assert {"draft_length", "tree_width", "tree_depth", "node_budget", "ngram_size"} <= set(fields)


@pytest.mark.django_db
def test_registering_a_draft_with_another_tokenizer_is_refused_naming_both_directories(tiny_model_dirs, tmp_path):
    from django.core.management import CommandError, call_command

    from metadata.models import ModelVersion
    from inference.registry import RegistrationError, register_pair
    from inference.demo.tiny_models import build_foreign_draft

    target_dir = tiny_model_dirs[0]
    foreign_dir = build_foreign_draft(tmp_path / "foreign-draft")
    with pytest.raises(RegistrationError, match="does not share the tokenizer") as raised:
        register_pair("mixed", "1", target_dir, foreign_dir)
    message = str(raised.value)
    assert str(target_dir) in message and str(foreign_dir) in message and "\n" not in message
    with pytest.raises(CommandError, match="does not share the tokenizer") as raised:
        call_command("register_model", "mixed", "1", str(target_dir), "--draft", str(foreign_dir))
    assert str(target_dir) in str(raised.value) and str(foreign_dir) in str(raised.value)
    assert not ModelVersion.objects.filter(name="mixed").exists()  # nothing half-registered
    assert register_pair("matched", "1", *tiny_model_dirs).default_draft is not None

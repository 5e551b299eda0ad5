"""Bounded list pages: the API's session list caps prompt, text and params; the admin's session list runs no
COUNT(*) over the table and no SELECT DISTINCT for its filters, and its id search prunes to one partition."""
from __future__ import annotations

import re
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from metadata import admin_paging
from metadata.admin_paging import EstimatedCountPaginator, estimated_count
from sessions.api.serializers import LIST_TEXT_CAP
from metadata.models import Session

pytestmark = pytest.mark.django_db


def make(tenant, model, prompt: str = "x", text: str = "", **fields) -> Session:
    fields.setdefault("params", {})
    return Session.objects.create(tenant=tenant, target=model, drafter="ngram", queue="cpu", prompt=prompt,
                                  prompt_tokens=1, status="succeeded", text=text, **fields)


def test_a_list_page_caps_prompt_and_text_and_the_detail_view_has_them_whole(api_client, tenant, tiny_model):
    long_prompt, long_text = "p" * (LIST_TEXT_CAP + 1), "é" * 5000
    big = make(tenant, tiny_model, prompt=long_prompt, text=long_text)
    small = make(tenant, tiny_model, prompt="short", text="t" * LIST_TEXT_CAP)

    rows = {row["id"]: row for row in api_client.get("/api/v1/sessions/").json()["results"]}

    assert rows[str(big.pk)]["prompt"] == long_prompt[:LIST_TEXT_CAP]
    assert rows[str(big.pk)]["text"] == long_text[:LIST_TEXT_CAP]
    assert rows[str(big.pk)]["prompt_truncated"] is True and rows[str(big.pk)]["text_truncated"] is True
    assert rows[str(small.pk)]["prompt"] == "short" and rows[str(small.pk)]["text"] == "t" * LIST_TEXT_CAP
    assert rows[str(small.pk)]["prompt_truncated"] is False and rows[str(small.pk)]["text_truncated"] is False
    detail = api_client.get(f"/api/v1/sessions/{big.pk}/").json()
    assert detail["prompt"] == long_prompt and detail["text"] == long_text
    assert "prompt_truncated" not in detail


def test_a_page_of_the_longest_sessions_stays_small(api_client, tenant, tiny_model):
    for _ in range(20):
        make(tenant, tiny_model, prompt="p" * 100_000, text="t" * 100_000)
    response = api_client.get("/api/v1/sessions/?page_size=20")
    assert len(response.json()["results"]) == 20
    assert len(response.content) < 20 * 4 * LIST_TEXT_CAP  # not 4 MB


def test_a_list_page_caps_each_text_of_params_and_the_detail_view_has_them_whole(api_client, tenant, tiny_model):
    response_format = '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"description": "%s"}}}' % (
        "d" * 60_000)
    big = make(tenant, tiny_model, params={"max_new_tokens": 8, "stop": ["s" * 300], "response_format": response_format})
    small = make(tenant, tiny_model, params={"max_new_tokens": 8, "stop": ["\n"]})

    response = api_client.get("/api/v1/sessions/")
    rows = {row["id"]: row for row in response.json()["results"]}

    assert rows[str(big.pk)]["params"] == {"max_new_tokens": 8, "stop": ["s" * LIST_TEXT_CAP],
                                           "response_format": response_format[:LIST_TEXT_CAP]}
    assert rows[str(big.pk)]["params_truncated"] is True
    assert rows[str(small.pk)]["params"] == {"max_new_tokens": 8, "stop": ["\n"]}
    assert rows[str(small.pk)]["params_truncated"] is False
    assert len(response.content) < 8 * LIST_TEXT_CAP * 4
    assert api_client.get(f"/api/v1/sessions/{big.pk}/").json()["params"]["response_format"] == response_format


def count_queries(queries) -> list[str]:
    return [q["sql"] for q in queries if re.search(r"COUNT\(\*\)", q["sql"], re.I)]


def distinct_over_sessions(queries) -> list[str]:
    """SELECT DISTINCTs that read the sessions table (the model registry's small table is fine)."""
    return [q["sql"] for q in queries if "DISTINCT" in q["sql"].upper() and '"metadata_session"' in q["sql"]]


def test_the_admin_list_counts_no_more_than_the_cap(admin_client, tenant, tiny_model, monkeypatch):
    for n in range(4):
        make(tenant, tiny_model, prompt=f"s{n}")
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get("/admin/metadata/session/")
    assert page.status_code == 200
    counts = count_queries(queries.captured_queries)
    assert counts and all("LIMIT" in sql for sql in counts), counts  # a capped count, never the whole table
    assert not distinct_over_sessions(queries.captured_queries)
    assert "4 sessions" in page.content.decode()

    monkeypatch.setattr(admin_paging, "EXACT_COUNT_CAP", 2)  # past the cap: the estimate, at least cap + 1
    assert estimated_count(Session.objects.all()) >= 3
    assert estimated_count(Session.objects.filter(prompt="s1")) == 1
    assert EstimatedCountPaginator(Session.objects.filter(status="succeeded").order_by("pk"), 2).count >= 3


def test_the_admin_filters_offer_fixed_choices_and_filter(admin_client, tenant, tiny_model):
    make(tenant, tiny_model, prompt="by-ngram")
    tree = make(tenant, tiny_model, prompt="by-tree")
    Session.objects.filter(pk=tree.pk).update(drafter="tree")
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get("/admin/metadata/session/?drafter=tree&queue=cpu").content.decode()
    assert not distinct_over_sessions(queries.captured_queries)
    assert str(tree.pk) in page and "by-ngram" not in page
    assert "?drafter=dspark" in page and "?queue=cpu" in page  # choices from the registry, not the rows


def test_the_admin_id_search_reads_one_partition(admin_client, tenant, tiny_model):
    session = make(tenant, tiny_model)
    other = make(tenant, tiny_model)
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(f"/admin/metadata/session/?q={session.pk}").content.decode()
    assert str(session.pk) in page and str(other.pk) not in page
    listed = [q["sql"] for q in queries.captured_queries if 'FROM "metadata_session"' in q["sql"]]
    assert listed and all('"metadata_session"."created_at" =' in sql for sql in listed), listed  # its partition key
    assert admin_client.get("/admin/metadata/session/?q=not-an-id").status_code == 200
    assert admin_client.get(f"/admin/metadata/session/?q={uuid.uuid4()}").status_code == 200

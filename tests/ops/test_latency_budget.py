"""The latency budget page (seed 002), rendered from real measurements.

Generations go through the live ASGI server (uvicorn) and a real Celery worker, both writing their
Prometheus histograms to one PROMETHEUS_MULTIPROC_DIR, as under ``scripts/run.sh``; the admin page
is then rendered with the Django test client, reading that directory, against budgets from the
settings.
"""
from __future__ import annotations

import re

import openai
import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from core.latency_budget import COMPONENTS, Distribution, budget_lines, collect
from specops.celery import app
from tests.web_process import start_web, stop_web
from tests.worker_process import start_worker, stop_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prometheus")


@pytest.fixture(scope="module")
def measured_services(django_db_setup, tmp_path_factory, metrics_dir):
    app.control.purge()
    logs = tmp_path_factory.mktemp("logs")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    worker = start_worker("cpu", "budget-cpu", logs / "worker.log", extra_env=env)
    try:
        web = start_web(logs / "web.log", **env)
    except BaseException:
        stop_worker(worker)
        raise
    yield web
    stop_web(web)
    stop_worker(worker)


def row(html: str, component: str) -> str:
    match = re.search(rf'<tr class="[^"]*" data-component="{component}" data-state="[^"]*">.*?</tr>', html, re.S)
    assert match, f"no row for {component}"
    return match.group(0)


def test_the_page_marks_the_component_over_its_budget(measured_services, metrics_dir, api_user, tiny_model,
                                                      client, settings, monkeypatch):
    openai_client = openai.OpenAI(base_url=f"{measured_services.url}/v1", max_retries=0, timeout=120,
                                  api_key=Token.objects.create(user=api_user).key)
    for prompt in ("def parse(text):\n    ", "import os\n", "class Node:\n    def"):
        chunks = list(openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                       stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    for component in COMPONENTS:  # generous budgets, but one nothing real can meet
        setattr(settings, component.setting, 60_000.0)
    settings.SPECOPS_BUDGET_INFERENCE_MS = 0.001
    lines = {line.component.name: line for line in budget_lines(collect())}
    for name, line in lines.items():  # every component was measured, by the web server or the worker
        assert line.count >= 1 and line.p95_ms is not None and line.p95_ms > 0, name
    assert lines["streaming"].count >= 3 and lines["db_write"].count == 3  # one row per request, a step per chunk
    assert [name for name, line in lines.items() if line.over] == ["inference"]

    admin = get_user_model().objects.create_superuser("ops", password="pw-ops-123456")
    client.force_login(admin)
    page = client.get("/admin/latency-budget/")
    assert page.status_code == 200
    html = page.content.decode()
    inference = row(html, "inference")
    assert 'data-state="over budget"' in inference and 'class="over"' in inference and "over-mark" in inference
    for component in COMPONENTS:
        if component.name != "inference":
            assert 'data-state="within"' in row(html, component.name), component.name
    assert re.search(r'id="budget-overruns">Over budget: inference\.', html)
    assert "SPECOPS_BUDGET_QUEUE_WAIT_MS" in html and 'class="point"' in html  # the settings and the chart
    assert "Latency budget" in client.get("/admin/").content.decode()  # linked from the admin index


def test_the_quantile_follows_histogram_quantile():
    """Linear inside the bucket that holds the rank, as Prometheus' histogram_quantile."""
    histogram = Distribution({0.01: 10, 0.1: 90, float("inf"): 100}, count=100, total=5.0)
    assert histogram.quantile(0.05) == pytest.approx(0.005)
    assert histogram.quantile(0.5) == pytest.approx(0.01 + 0.09 * 40 / 80)
    assert histogram.quantile(0.95) == pytest.approx(0.1)  # past the last finite edge: that edge
    assert Distribution({}, 0, 0).quantile(0.95) is None and histogram.mean == pytest.approx(0.05)

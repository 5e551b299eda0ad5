"""The operator's admin in a real browser: Playwright driving Debian's Chromium against a live server.

An operator logs in through the login form and opens every admin page on real rows; each test
asserts what a person sees (coloured tokens equal the token rows in number and kind, charts have
their points, an action started from the page completes and its outcome shows) and that the page
logged no console error. Screenshots are kept under ``var/browser/`` as test artifacts.

Needs Debian's ``chromium`` (scripts/bootstrap.sh installs it; ``SPECOPS_CHROMIUM`` overrides the
path) and the ``playwright`` package; Playwright's own browser download is never used.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission

from metadata.models import ModelVersion, VersionStatus
from metadata.models import Session, TenantMembership, TokenRecord
from ops.rollups import roll_up
from specops.celery import app
from tests.metadata.test_admin_sessions import make_session
from tests.ops.test_dashboard import finished_session
from tests.worker_process import ROOT, start_worker, stop_worker

# Every alias: the live server answers on threads of its own, whose reads the router may send to the replica
# (in tests a mirror of the primary).
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases="__all__")]

# Playwright's sync API runs an event loop in this thread between calls; the ORM calls the tests
# make between page actions are plain synchronous code all the same.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM = os.environ.get("SPECOPS_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = ROOT / "var" / "browser"
PASSWORD = "pw-operator-browser-1"
OPERATOR_PERMISSIONS = ["metadata.view_session", "metadata.change_session", "metadata.add_session",
                        "metadata.view_modelversion", "metadata.change_modelversion"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/bootstrap.sh (it installs Debian's chromium)")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def operator(db, tenant):
    """Staff of ``tenant`` (staff see their own tenant's sessions only)."""
    user = get_user_model().objects.create_user("operator", password=PASSWORD, is_staff=True)
    for perm in OPERATOR_PERMISSIONS:
        app_label, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    TenantMembership.objects.create(user=user, tenant=tenant)
    return user


class OperatorPage:
    """A logged-in page that records console errors and failed requests."""

    def __init__(self, page, base_url: str) -> None:
        self.page, self.base_url = page, base_url
        self.errors: list[str] = []
        page.on("console", lambda message: message.type == "error" and "favicon" not in str(message.location)
                and self.errors.append(message.text))
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        # the browser's own favicon probe is not the page's (the admin declares none)
        page.on("response", lambda response: response.status >= 400 and not response.url.endswith("/favicon.ico")
                and self.errors.append(f"{response.status} {response.url}"))

    def open(self, path: str) -> None:
        self.page.goto(self.base_url + path)

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def assert_clean(self) -> None:
        assert not self.errors, f"console errors / failed requests: {self.errors}"


@pytest.fixture
def reads_on_the_primary(settings):
    """The live server's threads would read the streaming replica, which may not have replayed the
    rows the test wrote a moment ago, and a browser sends no LSN header to hold it back: read the
    primary, as tests/web_process.py does for its server."""
    settings.DATABASE_ROUTERS = []


@pytest.fixture
def ops(browser, live_server, operator, reads_on_the_primary):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)  # a loaded 2-core machine: the first page of a run compiles every template
    ops = OperatorPage(page, live_server.url)
    ops.open("/admin/login/")
    page.fill("#id_username", operator.username)
    page.fill("#id_password", PASSWORD)
    with page.expect_navigation():
        page.click("input[type=submit]")
    if page.locator("#user-tools").count() == 0:  # logged in: the header greets the operator
        ops.shot("login-failed")
        pytest.fail(f"login failed at {page.url}: {page.locator('#content').inner_text()[:500]}")
    yield ops
    context.close()


def test_the_index_links_the_operator_pages(ops):
    ops.open("/admin/")
    for text in ("SpecOps dashboard", "Partitions", "Sessions", "Model versions"):
        assert ops.page.get_by_role("link", name=text).first.is_visible(), text
    ops.shot("index")
    ops.assert_clean()


def test_the_session_page_shows_every_token_coloured_by_kind_and_the_draft_trees(ops, tenant, tiny_model):
    session = make_session(tenant, tiny_model, steps=4)
    ops.open(f"/admin/metadata/session/{session.pk}/change/")
    page = ops.page
    rows = list(TokenRecord.objects.filter(session_id=session.pk).order_by("position"))
    kinds = page.eval_on_selector_all("#output .tok", "spans => spans.map(s => s.dataset.kind)")
    assert kinds == [{0: "plain", 1: "accepted", 2: "bonus", 3: "correction"}[r.kind] for r in rows]
    colours = set(page.eval_on_selector_all("#output .tok", "spans => spans.map(s => getComputedStyle(s).backgroundColor)"))
    assert len(colours) == len({r.kind for r in rows})  # one colour per kind present
    first = page.locator("#output .tok").first
    first.hover()
    assert first.get_attribute("title").startswith("position 0 · step 0 ·")
    assert page.locator('.sv-step[data-step="2"] [data-state="accepted"]').count() == 2
    assert page.locator('.sv-step[data-step="2"] [data-state="rejected"]').count() == 1
    assert page.locator("#acceptance-chart .point").count() == 3
    assert page.locator("input[value='Save']").count() == 0  # read-only
    ops.shot("session")
    ops.assert_clean()


def test_the_dashboard_draws_its_charts_and_refreshes_without_a_reload(ops, tenant, tiny_model):
    finished_session(tenant, tiny_model, "tree")
    roll_up()
    ops.open("/admin/dashboard/")
    page = ops.page
    assert page.locator("svg.chart").count() >= 12
    assert page.locator('svg[aria-label="Generations per minute (all drafters)"] .point').count() >= 1
    assert page.locator("svg.chart .tick").count() > 0  # axes with values
    assert page.locator("#tile-generations").inner_text() == "1"
    page.evaluate("window.__no_reload_marker = true")
    finished_session(tenant, tiny_model, "ngram")
    roll_up()
    page.wait_for_function("document.getElementById('tile-generations').innerText === '2'", timeout=30_000)
    assert page.evaluate("window.__no_reload_marker") is True  # the panels were swapped in, not reloaded
    ops.shot("dashboard")
    ops.assert_clean()


def test_cancel_from_the_session_page_completes_and_shows_its_outcome(ops, tenant, tiny_model):
    session = make_session(tenant, tiny_model, status="queued", steps=1)
    ops.open(f"/admin/metadata/session/{session.pk}/change/")
    page = ops.page
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#cancel-session")
    page.wait_for_selector(".messagelist .success")
    assert "Cancelled 1 queued session" in page.locator(".messagelist").inner_text()
    assert page.locator("#session-status").inner_text().startswith("cancelled")
    assert page.locator("#cancel-session").count() == 0
    session.refresh_from_db()
    assert session.status == "cancelled"
    ops.shot("session-cancelled")
    ops.assert_clean()


@pytest.fixture
def cpu_worker(live_server, tmp_path):
    app.control.purge()
    process = start_worker("cpu", "browser-cpu", tmp_path / "worker.log")
    yield process
    stop_worker(process)


def test_rerun_from_the_session_page_runs_on_a_real_worker_and_its_tokens_show(ops, tenant, tiny_model, cpu_worker):
    original = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu",
                                      prompt="def parse(text):\n    ", prompt_tokens=6, status="succeeded",
                                      params={"max_new_tokens": 12, "temperature": 0.0, "ngram_size": 3,
                                              "draft_length": 3})
    ops.open(f"/admin/metadata/session/{original.pk}/change/")
    page = ops.page
    page.click("#rerun-session")
    page.wait_for_selector(".messagelist .success")
    new = Session.objects.exclude(pk=original.pk).get()
    assert page.url.endswith(f"/admin/metadata/session/{new.pk}/change/")
    for _ in range(60):  # the worker runs it; an operator reloads the page
        page.reload()
        if page.locator("#session-status").inner_text().startswith(("succeeded", "failed")):
            break
        page.wait_for_timeout(1000)
    assert page.locator("#session-status").inner_text().startswith("succeeded"), Session.objects.get(pk=new.pk).error
    assert page.locator("#output .tok").count() == TokenRecord.objects.filter(session_id=new.pk).count() > 0
    ops.shot("session-rerun")
    ops.assert_clean()


def test_promotion_from_the_registry_asks_then_shows_what_it_retired(ops, tiny_model):
    staged = ModelVersion.objects.create(name="tiny", version="2", role="target", path=tiny_model.path,
                                         context_length=tiny_model.context_length)
    ops.open("/admin/metadata/modelversion/")
    page = ops.page
    assert page.locator("#pair-acceptance svg.chart").count() == 1
    page.click(f'a.promote-link[href$="/{staged.pk}/promote/"]')
    plan = page.locator("#promotion-plan").inner_text()
    assert "tiny:1 (target)" in plan and "prediction cache" in plan
    ops.shot("promote-confirmation")
    page.click("#confirm-promotion")
    page.wait_for_selector(".messagelist .success")
    assert re.search(r"Promoted tiny:2 \(target\): it is active; retired: tiny:1 \(target\)",
                     page.locator(".messagelist").inner_text())
    staged.refresh_from_db()
    assert staged.status == VersionStatus.ACTIVE
    ops.shot("registry")
    ops.assert_clean()

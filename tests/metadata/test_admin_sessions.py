"""The admin's session view (read-only, tokens by kind, draft trees, keyset steps), its actions, the registry."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from metadata.models import ModelVersion, VersionStatus
from metadata.models import Candidate, Session, TenantMembership, TokenKind, TokenRecord
from specops.celery import app

pytestmark = pytest.mark.django_db


def make_session(tenant, model, status="succeeded", steps=3) -> Session:
    """A session of ``steps`` steps: each drafts two branches; step s accepts s tokens of branch 0."""
    now = timezone.now()
    session = Session.objects.create(
        tenant=tenant, target=model, draft=model.default_draft, drafter="tree", queue="cpu", prompt="def f(x):",
        prompt_tokens=4, status=status, params={"max_new_tokens": 16, "temperature": 0.0, "tree_width": 2},
        created_at=now - timedelta(seconds=3), started_at=now - timedelta(seconds=2),
        finished_at=now if status == "succeeded" else None,
        stats={"drafter": "tree", "steps": steps, "drafted": 6 * steps, "accepted": 3,
               "drafted_per_position": [steps * 2, steps * 2, steps * 2], "accepted_per_position": [2, 1, 0],
               "acceptance_per_position": [2 / 6, 1 / 6, 0.0], "draft_seconds": 0.05, "verify_seconds": 0.1,
               "total_seconds": 0.2, "batch_rows_max": 1})
    position = 0
    for step in range(steps):
        accepted = min(step, 3)
        branch0 = [100 + step * 10 + i for i in range(3)]
        branch1 = branch0[:1] + [900 + step]  # shares the first drafted token with branch 0
        Candidate.objects.create(session=session, session_created_at=session.created_at, step=step, branch=0,
                                 token_ids=branch0, score=-1.0, accepted_len=accepted)
        Candidate.objects.create(session=session, session_created_at=session.created_at, step=step, branch=1,
                                 token_ids=branch1, score=-2.0, accepted_len=min(accepted, 1))
        kinds = [TokenKind.ACCEPTED] * accepted + [TokenKind.BONUS if accepted == 3 else TokenKind.CORRECTION]
        for offset, kind in enumerate(kinds):
            token_id = branch0[offset] if offset < accepted else 500 + step
            TokenRecord.objects.create(session=session, session_created_at=session.created_at, position=position,
                                       step=step, token_id=token_id, piece=f"t{position}", kind=kind,
                                       logprob=-0.5 if offset == 0 else None)
            position += 1
    Session.objects.filter(pk=session.pk).update(token_count=position)
    session.refresh_from_db()
    return session


def staff(username: str, *perms: str, tenant=None):
    """A staff user with ``perms``; in ``tenant`` (staff see their own tenant's sessions only)."""
    user = get_user_model().objects.create_user(username, password="pw-operator-123", is_staff=True)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    if tenant is not None:
        TenantMembership.objects.create(user=user, tenant=tenant)
    return user


def test_the_session_page_is_read_only_and_colours_every_token_by_kind(admin_client, tenant, tiny_model):
    session = make_session(tenant, tiny_model)
    html = admin_client.get(f"/admin/metadata/session/{session.pk}/change/").content.decode()
    output = html.split('id="output">', 1)[1].split("</div>", 1)[0]
    spans = re.findall(r'<span class="tok tok-(\w+)" data-kind="\w+" data-position="(\d+)" data-step="(\d+)" '
                       r'title="([^"]*)"', output)
    rows = list(TokenRecord.objects.filter(session_id=session.pk).order_by("position"))
    assert [(css, int(pos)) for css, pos, _, _ in spans] == [
        ({0: "plain", 1: "accepted", 2: "bonus", 3: "correction"}[r.kind], r.position) for r in rows]
    assert "position 0 · step 0 · correction · log-prob -0.500" in spans[0][3]
    # nothing to edit, add or delete
    assert "<form" not in html.split('id="content-main"', 1)[1].split('class="sv-actions"', 1)[0]
    assert 'name="_save"' not in html and "Delete" not in html
    assert admin_client.get("/admin/metadata/session/add/").status_code == 403
    assert admin_client.post(f"/admin/metadata/session/{session.pk}/delete/").status_code == 403
    assert "Time to first token" in html and "Queue wait" in html and "Attempts" in html
    assert f"/api/v1/sessions/{session.pk}/tokens/" in html and f"/admin/metadata/modelversion/{tiny_model.pk}/" in html
    assert 'id="acceptance-chart"' in html and 'data-points="3"' in html


def test_the_session_page_shows_the_schedulers_lengths_and_its_calibration(admin_client, tenant, tiny_model):
    session = make_session(tenant, tiny_model)
    session.stats = {**session.stats, "drafter": "dspark", "verified_lengths": [2, 0, 1, 4],
                     "expected_accepted": 9.5, "scheduled_accepted": 7, "survival_calibration": 0.737}
    session.save(update_fields=["stats"])
    html = admin_client.get(f"/admin/metadata/session/{session.pk}/change/").content.decode()
    for shown in ("verified_lengths", "[2, 0, 1, 4]", "survival_calibration", "0.737", "expected_accepted", "9.5"):
        assert shown in html, shown


def test_each_step_draws_its_branches_as_a_tree_with_the_accepted_path_and_the_rejection(admin_client, tenant,
                                                                                         tiny_model):
    session = make_session(tenant, tiny_model)
    html = admin_client.get(f"/admin/metadata/session/{session.pk}/change/").content.decode()
    step2 = html.split('data-step="2">', 1)[1].split('<div class="sv-step"', 1)[0]
    states = re.findall(r'data-state="([\w-]+)" title="depth (\d)', step2)
    # step 2 accepted 2 tokens of branch 0: depth 1 and 2 accepted, branch 0's depth 3 rejected,
    # branch 1's second token (a sibling off the path at depth 2) not reached
    assert ("accepted", "1") in states and ("accepted", "2") in states and ("rejected", "3") in states
    assert ("not-taken", "2") in states
    assert "accepted 2 of 3 positions; rejected at depth 3" in step2
    step0 = html.split('data-step="0">', 1)[1].split('<div class="sv-step"', 1)[0]
    assert re.findall(r'data-state="([\w-]+)" title="depth 1', step0) == ["rejected"]  # nothing accepted


def test_steps_are_paged_by_keyset_never_offset(admin_client, tenant, tiny_model):
    session = make_session(tenant, tiny_model, steps=25)
    with CaptureQueriesContext(connection) as queries:
        first = admin_client.get(f"/admin/metadata/session/{session.pk}/change/").content.decode()
    assert not [q["sql"] for q in queries.captured_queries if "OFFSET" in q["sql"]]
    assert first.count('<div class="sv-step"') == 20
    cursor = re.search(r'id="steps-next"', first) and re.search(r'href="\?steps=([\w-]+)" id="steps-next"', first)[1]
    second = admin_client.get(f"/admin/metadata/session/{session.pk}/change/?steps={cursor}").content.decode()
    assert re.findall(r'<div class="sv-step" data-step="(\d+)"', second) == [str(s) for s in range(20, 25)]
    assert 'id="steps-next"' not in second and 'id="steps-previous"' in second


def test_cancel_needs_the_change_permission_and_ends_a_queued_session(client, tenant, tiny_model):
    session = make_session(tenant, tiny_model, status="queued", steps=1)
    viewer = staff("viewer", "metadata.view_session", tenant=tenant)
    client.force_login(viewer)
    page = client.get(f"/admin/metadata/session/{session.pk}/change/").content.decode()
    assert 'id="cancel-session"' not in page and 'id="rerun-session"' not in page
    assert client.post(f"/admin/metadata/session/{session.pk}/cancel/").status_code == 403
    session.refresh_from_db()
    assert session.status == "queued"

    client.force_login(staff("operator", "metadata.view_session", "metadata.change_session", tenant=tenant))
    page = client.get(f"/admin/metadata/session/{session.pk}/change/").content.decode()
    assert 'id="cancel-session"' in page
    response = client.post(f"/admin/metadata/session/{session.pk}/cancel/", follow=True)
    assert "Cancelled 1 queued session" in response.content.decode()
    session.refresh_from_db()
    assert session.status == "cancelled" and session.finish_reason == "cancelled" and session.finished_at


def test_cancel_of_a_running_session_leaves_its_end_to_the_worker(admin_client, tenant, tiny_model):
    running = make_session(tenant, tiny_model, status="running", steps=1)
    done = make_session(tenant, tiny_model, status="succeeded", steps=1)
    response = admin_client.post("/admin/metadata/session/", {
        "action": "cancel", "_selected_action": [str(running.pk), str(done.pk)]}, follow=True)
    assert "1 running session(s) stop at their next step" in response.content.decode()
    running.refresh_from_db()
    done.refresh_from_db()
    assert running.status == "cancelled" and running.finished_at is None  # the batching loop writes the end
    assert done.status == "succeeded"


def test_rerun_needs_the_add_permission_and_submits_the_same_parameters(client, tenant, tiny_model):
    session = make_session(tenant, tiny_model, steps=1)
    client.force_login(staff("operator2", "metadata.view_session", "metadata.change_session", tenant=tenant))
    assert client.post(f"/admin/metadata/session/{session.pk}/rerun/").status_code == 403

    client.force_login(staff("operator3", "metadata.view_session", "metadata.add_session", tenant=tenant))
    app.control.purge()
    try:
        response = client.post(f"/admin/metadata/session/{session.pk}/rerun/", follow=True)
    finally:
        app.control.purge()
    new = Session.objects.exclude(pk=session.pk).get()
    assert response.redirect_chain[-1][0] == f"/admin/metadata/session/{new.pk}/change/"
    assert f"Re-ran {session.pk}" in response.content.decode()
    assert new.prompt == session.prompt and new.drafter == "tree" and new.tenant_id == tenant.pk
    assert {k: new.params[k] for k in session.params} == session.params and new.status == "queued"


def test_promotion_asks_first_and_says_what_it_retires_and_that_the_cache_is_invalidated(admin_client, tiny_model):
    successor = ModelVersion.objects.create(name="tiny", version="2", role="target", path=tiny_model.path,
                                            context_length=tiny_model.context_length)
    listing = admin_client.get("/admin/metadata/modelversion/").content.decode()
    assert 'id="pair-acceptance"' in listing and "promote…" in listing
    confirm = admin_client.get(f"/admin/metadata/modelversion/{successor.pk}/promote/").content.decode()
    assert "tiny:1 (target)" in confirm and "prediction cache entries" in confirm
    successor.refresh_from_db()
    assert successor.status == VersionStatus.STAGED  # nothing happens before the confirmation
    done = admin_client.post(f"/admin/metadata/modelversion/{successor.pk}/promote/", {"confirmed": "yes"},
                             follow=True).content.decode()
    assert "Promoted tiny:2 (target): it is active; retired: tiny:1 (target)" in done and "invalidated" in done
    tiny_model.refresh_from_db()
    assert tiny_model.status == VersionStatus.RETIRED


def test_promote_action_shows_the_confirmation_page(admin_client, tiny_model):
    staged = ModelVersion.objects.create(name="tiny", version="3", role="target", path=tiny_model.path,
                                         context_length=tiny_model.context_length)
    page = admin_client.post("/admin/metadata/modelversion/", {"action": "promote", "_selected_action": [staged.pk]})
    assert page.status_code == 200 and 'id="confirm-promotion"' in page.content.decode()
    staged.refresh_from_db()
    assert staged.status == VersionStatus.STAGED
    admin_client.post("/admin/metadata/modelversion/", {"action": "promote", "_selected_action": [staged.pk],
                                                         "confirmed": "yes"})
    staged.refresh_from_db()
    assert staged.status == VersionStatus.ACTIVE

"""Feeding the suffix drafter from the platform's own history, per tenant (real PostgreSQL, Redis,
Celery worker).

Warm-up reads the token table within its count and age bounds and never puts one tenant's
outputs in another's corpus; a worker warms its index at start and teaches it every generation
it finishes, so a tenant's repeated request drafts from its earlier answer and another tenant's
identical request drafts from its own tokens only.
"""
from __future__ import annotations

import itertools
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder
from inference.engine.drafters.suffix import SuffixCorpora, SuffixDrafter
from inference.engine.lm.loading import load_causal_lm
from inference.worker import suffix_feed
from metadata.models import Session, SessionStatus, Tenant, TenantMembership, TokenKind, TokenRecord
from specops.celery import app
from tests.helpers import wait_for
from tests.inference.worker.test_crash_safety import target_greedy
from tests.worker_process import start_worker, stop_worker

_tokens = itertools.count(300)


def past_session(tenant, target, minutes_ago: float, tokens: list[int] | None = None,
                 status: str = SessionStatus.SUCCEEDED, prompt: str = "x = 1\n") -> tuple[Session, list[int]]:
    """A finished session as the worker leaves it: the session row and its token rows."""
    tokens = tokens if tokens is not None else [next(_tokens) for _ in range(12)]
    created = timezone.now() - timedelta(minutes=minutes_ago)
    session = Session.objects.create(
        tenant=tenant, target=target, drafter="none", queue="cpu", prompt=prompt, prompt_tokens=3,
        params={"max_new_tokens": len(tokens)}, status=status, token_count=len(tokens),
        created_at=created, finished_at=created)
    TokenRecord.objects.bulk_create(
        TokenRecord(session_id=session.pk, session_created_at=session.created_at, position=position, step=position,
                    token_id=token_id, piece="", kind=TokenKind.TARGET)
        for position, token_id in enumerate(tokens))
    return session, tokens


def indexed(corpora: SuffixCorpora, key, tokens: list[int]) -> bool:
    """Whether the corpus of `key` continues the first two of `tokens` with the next one."""
    index = corpora.index(key)
    return index is not None and [tokens[2]] in [c[:1] for c in index.match(tokens[:2], 4)[1]]


@pytest.mark.django_db
def test_warm_up_reads_the_newest_sessions_per_tenant_within_the_age_and_never_mixes_tenants(tiny_model):
    acme, globex = Tenant.objects.create(name="acme"), Tenant.objects.create(name="globex")
    acme_recent = [past_session(acme, tiny_model, minutes)[1] for minutes in (5, 4, 3, 2, 1)]
    acme_old = past_session(acme, tiny_model, 120)[1]  # older than the age bound
    acme_failed = past_session(acme, tiny_model, 1, status=SessionStatus.FAILED)[1]
    globex_recent = [past_session(globex, tiny_model, minutes)[1] for minutes in (3, 2)]
    loaded = load_causal_lm(tiny_model.directory)
    corpora = SuffixCorpora()

    fed = suffix_feed.warm_up({tiny_model.pk: loaded}, per_corpus=3, max_age_s=3600, corpora=corpora)

    assert fed == 3 + 2
    acme_key, globex_key = (acme.pk, tiny_model.pk), (globex.pk, tiny_model.pk)
    assert len(corpora) == 2 and len(corpora.index(acme_key)) == 3 and len(corpora.index(globex_key)) == 2
    assert [indexed(corpora, acme_key, tokens) for tokens in acme_recent] == [False, False, True, True, True]
    assert not indexed(corpora, acme_key, acme_old) and not indexed(corpora, acme_key, acme_failed)
    assert all(indexed(corpora, globex_key, tokens) for tokens in globex_recent)
    for tokens in acme_recent + [acme_old]:  # nothing of acme's in globex's corpus, and back
        assert not indexed(corpora, globex_key, tokens)
    assert not any(indexed(corpora, acme_key, tokens) for tokens in globex_recent)
    # the prompt's tail is indexed before the output: "x = 1\n" then the first token
    prompt_ids = loaded.tokenizer("x = 1\n")["input_ids"]
    assert any(c[:1] == [acme_recent[-1][0]]
               for c in corpora.index(acme_key).match(prompt_ids, 2)[1])


@pytest.mark.django_db
def test_warm_up_honours_a_zero_count_unknown_models_and_the_total_bound(tiny_model):
    acme = Tenant.objects.create(name="acme")
    tokens = past_session(acme, tiny_model, 1)[1]
    loaded = load_causal_lm(tiny_model.directory)
    corpora = SuffixCorpora()
    assert suffix_feed.warm_up({tiny_model.pk: loaded}, per_corpus=0, corpora=corpora) == 0
    assert suffix_feed.warm_up({tiny_model.pk + 1000: loaded}, per_corpus=5, corpora=corpora) == 0
    assert len(corpora) == 0
    newer = {}
    for minutes in (4, 3, 2):  # other tenants' newer sessions
        tenant = Tenant.objects.create(name=f"t{minutes}")
        newer[tenant.pk] = past_session(tenant, tiny_model, minutes / 10)[1]
    corpora = SuffixCorpora(max_corpora=2)
    # at most per_corpus x max_corpora sessions in all: the two newest
    assert suffix_feed.warm_up({tiny_model.pk: loaded}, per_corpus=1, corpora=corpora) == 2
    kept = [pk for pk, tokens in newer.items() if indexed(corpora, (pk, tiny_model.pk), tokens)]
    assert kept == list(newer)[1:] and not indexed(corpora, (acme.pk, tiny_model.pk), tokens)


def test_only_a_success_with_tokens_is_fed():
    corpora = SuffixCorpora()
    session = SimpleNamespace(tenant_id=7, target_id=3)

    def job(status, tokens):
        return SimpleNamespace(status=status, session=session, recorder=SimpleNamespace(token_ids=tokens),
                               request=SimpleNamespace(prompt_ids=list(range(100, 130))))

    assert not suffix_feed.feed_finished(job(SessionStatus.FAILED, [1, 2, 3, 4]), corpora)
    assert not suffix_feed.feed_finished(job(SessionStatus.CANCELLED, [1, 2, 3, 4]), corpora)
    assert not suffix_feed.feed_finished(job(SessionStatus.SUCCEEDED, []), corpora)
    assert len(corpora) == 0
    assert suffix_feed.feed_finished(job(SessionStatus.SUCCEEDED, [1, 2, 3, 4]), corpora)
    index = corpora.index((7, 3))
    assert index.token_count == suffix_feed.PROMPT_TAIL + 4  # the prompt's tail, then the output
    assert index.match([128, 129], 3)[1] == [[1, 2, 3]]


# ---- a real worker ------------------------------------------------------------------------------


def client_of(name: str) -> APIClient:
    user = get_user_model().objects.create_user(name, password=f"pw-{name}-123")
    TenantMembership.objects.create(user=user, tenant=Tenant.objects.create(name=f"{name}-corp"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def generate(client: APIClient, prompt: str, max_new_tokens: int, drafter: str) -> dict:
    created = client.post("/api/v1/generations/", {"prompt": prompt, "max_new_tokens": max_new_tokens,
                                                   "drafter": drafter}, format="json")
    assert created.status_code == 202, created.content
    session_id = created.json()["id"]

    def finished():
        body = client.get(f"/api/v1/sessions/{session_id}/").json()
        return body if body["status"] in ("succeeded", "failed", "cancelled") else None

    body = wait_for(finished, timeout=120, what="the generation to finish")
    assert body["status"] == "succeeded", body["error"]
    body["token_ids"] = list(TokenRecord.objects.filter(session_id=session_id)
                             .order_by("position").values_list("token_id", flat=True))
    return body


def own_tokens_only_accepted(model_dir, prompt: str, max_new_tokens: int) -> int:
    """What the suffix drafter accepts on `prompt` with no corpus (its own tokens only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = load_causal_lm(model_dir)
        decoder = SpeculativeDecoder(loaded, SuffixDrafter(DraftConfig(), corpora=SuffixCorpora()))
        ids = loaded.tokenizer(prompt)["input_ids"]
        return decoder.generate(ids, GenerationConfig(max_new_tokens=max_new_tokens)).stats.accepted
    finally:
        torch.set_num_threads(threads)


@pytest.mark.django_db(transaction=True)
def test_a_worker_drafts_from_its_tenants_history_and_learns_from_what_it_finishes(tiny_model, tmp_path):
    prompt, new = "def parse(text):\n    ", 24
    expected = target_greedy(tiny_model.directory, prompt, new)
    acme, globex = client_of("alice"), client_of("bob")
    acme_tenant = TenantMembership.objects.get(user__username="alice").tenant
    past_session(acme_tenant, tiny_model, 10, tokens=expected, prompt=prompt)  # acme asked before
    own_only = own_tokens_only_accepted(tiny_model.directory, prompt, new)
    assert own_only <= new - 8  # the history must make a difference to be seen

    app.control.purge()
    log = tmp_path / "worker.log"
    # A fixed draft depth: what this test counts is what the corpus lets the drafter propose; with the
    # policy on, how many of those positions a step verifies follows the forwards' measured cost, which
    # a loaded machine moves (the policy's own tests, and test_policy_first_request, run it on).
    worker = start_worker("cpu", "suffix-cpu", log, extra_env={"SPECOPS_SPECULATION_POLICY": "false"})
    try:
        wait_for(lambda: "suffix index warmed from 1 session(s) into 1 corpora" in log.read_text(),
                 timeout=60, what="the warm-up at worker start")
        warmed = generate(acme, prompt, new, "suffix")
        stranger = generate(globex, prompt, new, "suffix")
        assert warmed["token_ids"] == stranger["token_ids"] == expected  # greedy: the target's tokens
        assert warmed["stats"]["accepted"] >= new - 6  # drafted from acme's earlier answer
        # globex drafted from its own tokens only: the worker's depth policy may cut a draft short
        # where the lone decoder did not, so the count is bounded by what history alone would add.
        assert stranger["stats"]["accepted"] <= new - 8 < warmed["stats"]["accepted"]

        other_prompt = "class Node:\n    def"
        first = generate(globex, other_prompt, new, "none")  # a success the worker indexes
        again = generate(globex, other_prompt, new, "suffix")
        assert again["token_ids"] == first["token_ids"]
        assert again["stats"]["accepted"] >= new - 6
        assert again["stats"]["accepted"] > own_tokens_only_accepted(tiny_model.directory, other_prompt, new)
    finally:
        stop_worker(worker)

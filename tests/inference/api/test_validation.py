"""Nothing is accepted that then fails: strict types, sampling bounds, forged cursors; safe warping.

Every bad input below is a 400 that names the field (REST: the key; OpenAI: ``param``) and
leaves nothing behind: no session row, no task on the broker. The engine's warping is checked
on its own and through the worker's batch engine with the real tiny float32 pair: tiny
temperatures and top-p values that once made "probability tensor contains inf/nan" (and, with
the tree drafter, "cannot reshape tensor of 0 elements") now generate.
"""
from __future__ import annotations

import base64
import json
import math

import pytest
import torch
from django.test import Client
from rest_framework.authtoken.models import Token

from inference.engine import DRAFTERS as ENGINE_DRAFTERS
from inference.engine import DraftConfig, GenerationConfig
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.lm.loading import load_causal_lm
from inference.engine.decode.sampling import SamplingParams, warp_probs
from metadata.models import Session, TokenRecord
from tests.helpers import empty_queue, queued_messages

URL = "/api/v1/generations/"
DRAFTERS = tuple(ENGINE_DRAFTERS)  # every drafter the API accepts, the suffix drafter included




@pytest.fixture(autouse=True)
def empty_cpu_queue():
    empty_queue("cpu")
    yield
    empty_queue("cpu")


def assert_nothing_written() -> None:
    assert Session.objects.count() == 0
    assert queued_messages() == 0


# ---- POST /api/v1/generations/ ------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("body, field, rule", [
    ({"prompt": 123}, "prompt", "must be a string; got a number"),
    ({"prompt": ["def f():"]}, "prompt", "must be a string; got a list"),
    ({"prompt": True}, "prompt", "must be a string; got a boolean"),
    ({"prompt": "x", "model": 7}, "model", "must be a string"),
    ({"prompt": "x", "stop": [1, 2]}, "stop", "must be a string; got a number"),
    ({"prompt": "x", "stop": "end"}, "stop", "list"),
    ({"prompt": "x", "temperature": True}, "temperature", "must be a valid number; got a boolean"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature", "must be a valid number; got a string"),
    ({"prompt": "x", "temperature": 1e-40}, "temperature", "must be 0 (greedy) or from 0.001 to 5"),
    ({"prompt": "x", "temperature": 5e-324}, "temperature", "must be 0 (greedy)"),
    ({"prompt": "x", "top_p": 1e-300}, "top_p", "at least 1e-06"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "top_p": False}, "top_p", "got a boolean"),
    ({"prompt": "x", "max_new_tokens": True}, "max_new_tokens", "must be a valid integer; got a boolean"),
    ({"prompt": "x", "max_new_tokens": "8"}, "max_new_tokens", "got a string"),
    ({"prompt": "x", "max_new_tokens": 8.5}, "max_new_tokens", "valid integer"),
    ({"prompt": "x", "seed": True}, "seed", "got a boolean"),
    ({"prompt": "x", "seed": 2**64}, "seed", "less than or equal to"),
    ({"prompt": "x", "top_k": 10**30}, "top_k", "less than or equal to"),
    ({"prompt": "x", "drafter": "tree", "tree_width": True}, "tree_width", "got a boolean"),
    ({"prompt": "x", "drafter": 3}, "drafter", "not a valid choice"),
])
def test_bad_input_is_400_naming_the_field_and_nothing_is_written(api_client, tiny_model, body, field, rule):
    response = api_client.generic("POST", URL, json.dumps(body), content_type="application/json")

    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert rule in json.dumps(response.json()[field])  # a list's errors are by index: {"0": [...]}
    assert_nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize("number", ["1e400", "-1e400"])
def test_a_number_beyond_a_float_is_400(api_client, tiny_model, number):
    """Python's JSON reads 1e400 as infinity: not a temperature."""
    body = f'{{"prompt": "x", "temperature": {number}}}'
    response = api_client.generic("POST", URL, body, content_type="application/json")
    assert response.status_code == 400 and "temperature" in response.json(), response.content
    assert_nothing_written()


@pytest.mark.django_db
def test_form_fields_are_still_parsed_from_their_strings(api_client, tiny_model):
    """A form sends every value as a string: numbers are read from it there, and only there."""
    response = api_client.post(URL, {"prompt": "import os\n", "max_new_tokens": "4", "temperature": "0.5",
                                     "top_p": "0.9", "seed": "3"})
    assert response.status_code == 202, response.content
    session = Session.objects.get()
    assert (session.params["max_new_tokens"], session.params["temperature"], session.params["top_p"]) == (4, 0.5, 0.9)


@pytest.mark.django_db
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.001, 1e-6), (5.0, 1.0)])
def test_the_bounds_themselves_are_accepted(api_client, tiny_model, temperature, top_p):
    response = api_client.post(URL, {"prompt": "import os\n", "temperature": temperature, "top_p": top_p},
                               format="json")
    assert response.status_code == 202, response.content


# ---- the OpenAI protocol ------------------------------------------------------------------------

@pytest.fixture
def openai_client(api_user) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=api_user).key}")


@pytest.mark.django_db
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": 123}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "1"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e-40}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 10**400}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1e-300}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": False}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [None]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-40},
     "temperature"),
])
def test_openai_bad_input_is_400_naming_the_param_and_nothing_is_written(openai_client, tiny_model, path, body,
                                                                       param):
    response = openai_client.post(path, json.dumps({"model": "tiny", **body}), content_type="application/json")

    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == param, response.json()
    assert_nothing_written()


# ---- forged pagination cursors ------------------------------------------------------------------

def forged(values) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")


FORGED_CURSORS = [
    forged(["abc"]), forged(["abc", "def", "ghi"]), forged([None, None, None]), forged([float("nan"), 1, 1]),
    forged([{"dt": "not a time"}, {"uuid": "x"}]), forged([{"dt": 5}, {"uuid": 5}]), forged([{"uuid": []}]),
    forged({"a": 1}), forged("abc"), forged([[1]]), forged([2**70]), "!!!", "é", "a" * 5000,
    base64.urlsafe_b64encode(b"\xff\xfe").decode(), forged(["2024-01-01T00:00:00", "x"]),
]


@pytest.mark.django_db
@pytest.mark.parametrize("cursor", FORGED_CURSORS)
def test_a_forged_cursor_is_400_naming_cursor(api_client, tenant, tiny_model, cursor):
    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu", prompt="x",
                                     prompt_tokens=1)
    for path in (f"/api/v1/sessions/{session.pk}/tokens/", f"/api/v1/sessions/{session.pk}/candidates/",
                 "/api/v1/sessions/"):
        response = api_client.get(path, {"cursor": cursor})
        assert response.status_code == 400, (path, cursor, response.content)
        assert "cursor" in response.json() and "not a cursor this API issued" in response.json()["cursor"][0]


@pytest.mark.django_db
def test_an_issued_cursor_still_pages(api_client, tenant, tiny_model):
    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu", prompt="x",
                                     prompt_tokens=1)
    TokenRecord.objects.bulk_create([TokenRecord(session=session, session_created_at=session.created_at, position=p,
                                                 step=p, token_id=p, piece="x", kind=0) for p in range(5)])
    first = api_client.get(f"/api/v1/sessions/{session.pk}/tokens/?page_size=2").json()
    second = api_client.get(first["next"]).json()
    assert [t["position"] for t in second["results"]] == [2, 3]
    assert api_client.get("/api/v1/sessions/?page_size=²").status_code == 400


# ---- the engine: finite warping, and generation with tiny temperatures and top-p ----------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("temperature, top_p, top_k", [
    (1e-40, 1.0, 0), (1e-300, 1.0, 0), (5e-324, 1.0, 0), (1.0, 1e-300, 0), (1e-40, 1e-300, 3), (1.0, 1e-7, 0),
    (3.0, 0.5, 2),
])
def test_warp_probs_is_finite_and_keeps_the_top_token(dtype, temperature, top_p, top_k):
    torch.manual_seed(0)
    logits = (torch.randn(4, 257) * 30).to(dtype)
    logits[1, :] = 7.0  # every token tied
    probs = warp_probs(logits, SamplingParams(temperature, top_k, top_p))

    assert probs.dtype == dtype and probs.shape == logits.shape
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.double().sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-2)
    best = logits == logits.amax(-1, keepdim=True)  # a tie keeps one of the tied tokens
    assert ((probs.double() * best).sum(-1) > 0).all()
    for row in (0, 2, 3):
        torch.multinomial(probs[row].float(), 1)  # what failed with "inf/nan"


def test_warp_probs_is_unchanged_for_ordinary_settings():
    torch.manual_seed(1)
    logits = torch.randn(3, 50, dtype=torch.float64) * 4
    for params in (SamplingParams(1.0), SamplingParams(0.7, 5, 0.9), SamplingParams(1.3, 0, 0.5)):
        scores = logits / params.temperature
        if params.top_k:
            scores = scores.masked_fill(scores < torch.topk(scores, params.top_k).values[..., -1:], -math.inf)
        if params.top_p < 1:
            ordered, order = scores.sort(descending=True)
            sorted_probs = ordered.softmax(-1)
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
            scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        assert torch.allclose(warp_probs(logits, params), scores.softmax(-1), atol=1e-12)


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dirs):
    """The tiny pair in float32, loaded as the worker loads it."""
    target_dir, draft_dir = tiny_model_dirs
    return load_causal_lm(target_dir), load_causal_lm(draft_dir)


@pytest.fixture(scope="module")
def tiny_dspark(tiny_pair, tmp_path_factory):
    """A DSpark drafter for the tiny target (random weights: it only has to run)."""
    from inference.engine.drafters.dspark import load_dspark
    from tests.inference.engine.dspark_models import write_deepspec_checkpoint

    target = tiny_pair[0].model
    return load_dspark(write_deepspec_checkpoint(tmp_path_factory.mktemp("dspark") / "tiny", target,
                                                 target_layer_ids=(-1, 0)), target)


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("temperature, top_p", [(1e-40, 1.0), (1.0, 1e-300), (1e-300, 1e-300)])
def test_the_worker_engine_generates_with_tiny_temperature_and_top_p(tiny_pair, tiny_dspark, drafter, temperature,
                                                                    top_p):
    target, draft = tiny_pair
    prompt = target.tokenizer("def parse(text):\n    ")["input_ids"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def run(config: GenerationConfig):
            engine = BatchedSpeculativeEngine(target, draft, max_rows=2, dspark=tiny_dspark)
            return engine.run([BatchRequest(0, prompt, config, drafter, DraftConfig(tree_width=3))])[0]

        sampled = run(GenerationConfig(max_new_tokens=10, temperature=temperature, top_p=top_p, seed=5,
                                       eos_token_id=()))
        greedy = run(GenerationConfig(max_new_tokens=10, eos_token_id=()))
    finally:
        torch.set_num_threads(threads)
    assert sampled.finish_reason == "length", sampled
    assert len(sampled.token_ids) == 10
    if temperature < 1e-30 or top_p < 1e-30:  # one token left per step: the greedy one
        assert sampled.token_ids == greedy.token_ids

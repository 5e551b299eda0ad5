"""From an OpenAI request's body to its session: parse, validate, submit (or replay).

Parsing a body compiles its ``response_format`` and tools (llguidance): that runs off the event
loop, on a pool of its own (``PARSE_THREADS``), under a wall-clock limit (``PARSE_TIMEOUT_S``, a
backstop: the compile's own limits bound it first), so a burst of schemas waits there instead of
stalling every stream of the web process. Submitting goes through ``sessions.submission`` like
any generation; its refusals become OpenAI errors here. With ``Idempotency-Key``, a retry is
answered from the session its first try made (``inference.idempotency``); the constraints a
request compiled are remembered only once it is accepted.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from core.latency_budget import measure
from core.parsers import BodyNotJSON, loads_json
from inference import idempotency
from inference.api.openai.chat_template import render_chat
from inference.api.openai.errors import OpenAIError, bad_param
from inference.api.openai.serializers import COMPLETION, OpenAIRequest, generation_error, parse_request
from inference.api.serializers import GenerationRequestSerializer
from inference.tokenizers import tokenizer_for, tokenizer_of
from inference.served_targets import ModelBuilding, ModelNotServed, ModelUnavailable, served_target
from metadata.api.async_views import Caller
from metadata.models import Session
from sessions.submission import GenerationRefused, start_generation

RETRY_AFTER_S = 5  # what a client is told to wait when the refusal does not say
PARSE_THREADS = 2
PARSE_TIMEOUT_S = 10.0
_parse_pool = ThreadPoolExecutor(max_workers=PARSE_THREADS, thread_name_prefix="specops-parse")


def refusal_error(refusal: GenerationRefused) -> OpenAIError:
    """The OpenAI protocol's answer to a refused generation.

    An unknown model is a 404; anything else has the refusal's own status (429 past a tenant's
    quota; a model still being built or its files missing, the task queue down: 503) and a
    Retry-After, the refusal's own when it knows one.
    """
    if isinstance(refusal, ModelNotServed):
        return OpenAIError(404, f"The model '{refusal.name}' does not exist or is not active (GET /v1/models lists "
                           "them).", param="model", code="model_not_found")
    return OpenAIError(refusal.http_status, refusal.message,
                       param="model" if isinstance(refusal, (ModelBuilding, ModelUnavailable)) else None,
                       code=refusal.code,
                       headers={"Retry-After": str(refusal.retry_after_s or RETRY_AFTER_S)})


@dataclass(frozen=True)
class Submission:
    session_id: str
    prompt_tokens: int
    directory: str
    cached: dict | None  # a prediction-cache hit: {"text", "token_count", "finish_reason"}
    staff: bool = False  # whether a failure's stored detail may be shown
    replayed: bool = False  # an Idempotency-Key's retry: the session may have steps to read first

    def decoder(self) -> Callable[[list[int]], str]:
        tokenizer = tokenizer_for(self.directory)
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def encoder(self) -> Callable[[str], list[int]]:
        tokenizer = tokenizer_for(self.directory)
        return lambda text: tokenizer(text)["input_ids"]


def _cached_reply(session: Session) -> dict:
    return {"text": session.text, "token_count": session.token_count, "finish_reason": session.finish_reason}


def submit(request: OpenAIRequest, caller: Caller, key: idempotency.Claim | None = None) -> Submission:
    """Validate against the model, then answer from the prediction cache or enqueue (sync); a
    refusal releases the request's ``Idempotency-Key`` claim, an accepted request completes it."""
    try:
        with measure("validation"):
            target = served_target(request.model)
            directory = str(target.directory)
            prompt = request.prompt if request.kind == COMPLETION else render_chat(
                tokenizer_of(target), request.messages, request.calling.tools() if request.calling else None)
            checked = request.checked_constraints()
            serializer = GenerationRequestSerializer(data=request.generation_data(prompt),
                                                     context={"checked_constraints": checked})
            if not serializer.is_valid():
                raise generation_error(serializer.errors, request)
        generation = start_generation(serializer, caller.tenant, caller.user)
    except BaseException as exc:
        if key is not None:
            key.release()
        if isinstance(exc, GenerationRefused):
            raise refusal_error(exc) from None
        raise
    serializer.remember_constraints(*checked)
    session = generation.session
    if key is not None:
        key.complete(session.pk, 200 if generation.cached else 202)
    return Submission(str(session.pk), serializer.validated_data["prompt_tokens"], directory,
                      _cached_reply(session) if generation.cached else None, staff=bool(caller.user.is_staff))


def submit_once(request: OpenAIRequest, caller: Caller, key: str | None, endpoint: str, body: bytes) -> Submission:
    """``submit``, or with an ``Idempotency-Key`` its first try's session (sync)."""
    if key is None:
        return submit(request, caller)
    try:
        claim = idempotency.claim(caller.user.pk, key, endpoint, body)
    except idempotency.IdempotencyRefused as exc:
        raise idempotency_error(exc) from None
    if isinstance(claim, idempotency.Claim):
        return submit(request, caller, claim)
    session = (Session.objects.using("default").select_related("target")
               .filter(pk=claim.session_id, tenant=caller.tenant).first())
    if session is None:  # its day was archived: the key outlived it
        raise OpenAIError(422, f"{idempotency.HEADER}: the session this key made ({claim.session_id}) is no "
                          "longer in the database; send a new key.", code="idempotency_key_expired")
    return Submission(str(session.pk), session.prompt_tokens, str(session.target.directory),
                      _cached_reply(session) if claim.status_code == 200 else None,
                      staff=bool(caller.user.is_staff), replayed=True)


def idempotency_error(refusal: idempotency.IdempotencyRefused) -> OpenAIError:
    headers = {"Retry-After": str(refusal.retry_after_s)} if refusal.retry_after_s else None
    return OpenAIError(refusal.status, refusal.message, code=refusal.code, headers=headers)


def _parse_body(body: bytes, kind: str) -> OpenAIRequest:
    try:
        data = loads_json(body)
    except BodyNotJSON as exc:
        raise bad_param(exc.param, str(exc), code="invalid_value" if exc.param else "invalid_body") from None
    return parse_request(data, kind)


async def parse(body: bytes, kind: str) -> OpenAIRequest:
    """The body parsed and its schemas compiled, on the parse pool (the module's docstring says why)."""
    parsing = asyncio.get_running_loop().run_in_executor(_parse_pool, _parse_body, body, kind)
    try:
        return await asyncio.wait_for(parsing, PARSE_TIMEOUT_S)
    except TimeoutError:
        raise OpenAIError(503, f"the request's response_format and tools could not be compiled within "
                          f"{PARSE_TIMEOUT_S:g} s; try again shortly.", code="compile_timeout",
                          headers={"Retry-After": str(RETRY_AFTER_S)}) from None

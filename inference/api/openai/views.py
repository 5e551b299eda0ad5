"""The OpenAI-compatible endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``/v1/chat/completions``.

Plain async views (a streaming reply holds no thread; a non-streaming one waits on the session's
Redis stream, not on a thread or a database poll). A request is a generation like any other:
the same tokens (``Authorization: Bearer <DRF token>``), tenant, throttles, validation
(``GenerationRequestSerializer``), prediction cache and session row as ``POST /api/v1/generations/``:
both go through ``sessions.submission``, and its refusals become OpenAI errors here.

From a request's body to its session (parsing off the event loop, ``Idempotency-Key``):
``submission``; this module answers: the reply, whole or streamed.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import wraps

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from redis.exceptions import RedisError

from core.conf import conf as project_conf
from core.latency_budget import measure, observe
from core.sse import HEARTBEAT, sse_response
from inference.api.openai.completion_text import CompletionText
from inference.api.openai.errors import OpenAIError
from inference.api.openai.responses import (
    ReplyHeader,
    chunk,
    openai_finish_reason,
    reply,
    tool_call_chunk,
    tool_call_reply,
    usage_chunk,
)
from inference.api.openai.serializers import CHAT, COMPLETION, OpenAIRequest
from inference.api.openai.submission import (
    RETRY_AFTER_S,
    Submission,
    idempotency_error,
    parse,
    refusal_error,
    submit_once,
)
from inference.api.openai.tools import NAMED, CallStream, call_object
from inference.conf import conf
from inference import idempotency
from inference.served_targets import served_target
from metadata.api.async_views import Caller, Refused, authorize, run_db
from metadata.models import ModelRole, ModelVersion, Session, SessionStatus, VersionStatus
from sessions.api import public_error
from sessions.runs import cancel_sessions
from sessions.streams import follow, token_stream
from sessions.submission import GenerationRefused

DONE = "data: [DONE]\n\n"


def openai_endpoint(*methods: str) -> Callable:
    """Allow ``methods`` only, and render any ``OpenAIError`` raised by the view."""
    def decorate(view):
        @csrf_exempt  # bearer tokens only; no cookie session reaches these views
        @wraps(view)
        async def endpoint(request: HttpRequest, *args, **kwargs):
            try:
                if request.method not in methods:
                    raise OpenAIError(405, f"{request.method} is not allowed here; use {' or '.join(methods)}.",
                                      code="method_not_allowed", headers={"Allow": ", ".join(methods)})
                return await view(request, *args, **kwargs)
            except OpenAIError as exc:
                return exc.response()
        return endpoint
    return decorate


async def _caller(request: HttpRequest, generation: bool = False) -> Caller:
    try:
        with measure("auth"):
            return await run_db(authorize, request, keywords=("Bearer", "Token"), generation=generation)
    except Refused as exc:
        raise OpenAIError(exc.status, exc.message, code=exc.code, headers=exc.headers) from None


def _active_targets(name: str | None = None) -> list[ModelVersion]:
    targets = ModelVersion.objects.filter(role=ModelRole.TARGET, status=VersionStatus.ACTIVE)
    if name is not None:
        targets = targets.filter(name=name)
    return list(targets.order_by("name", "-promoted_at"))


def _model_object(target: ModelVersion) -> dict:
    created = target.promoted_at or target.created_at
    return {"id": target.name, "object": "model", "created": int(created.timestamp()), "owned_by": "specops"}


@openai_endpoint("GET")
async def list_models(request: HttpRequest) -> JsonResponse:
    """The active target models, by name."""
    await _caller(request)
    targets = await run_db(_active_targets)
    return JsonResponse({"object": "list", "data": [_model_object(t) for t in targets]})


@openai_endpoint("GET")
async def retrieve_model(request: HttpRequest, model: str) -> JsonResponse:
    await _caller(request)
    try:
        target = await run_db(served_target, model)
    except GenerationRefused as exc:
        raise refusal_error(exc) from None
    return JsonResponse(_model_object(target))


@openai_endpoint("POST")
async def completions(request: HttpRequest):
    return await _generate(request, COMPLETION)


@openai_endpoint("POST")
async def chat_completions(request: HttpRequest):
    return await _generate(request, CHAT)


async def _generate(request: HttpRequest, kind: str):
    caller = await _caller(request, generation=True)
    try:
        key = idempotency.key_of(request.META)
    except idempotency.IdempotencyRefused as exc:
        raise idempotency_error(exc) from None
    openai_request = await parse(request.body, kind)
    submission = await run_db(submit_once, openai_request, caller, key, request.path, request.body)
    header = ReplyHeader(kind, submission.session_id, openai_request.model, int(time.time()))
    headers = {"X-SpecOps-Session": submission.session_id}
    if submission.replayed:
        headers[idempotency.REPLAYED_HEADER] = "true"
    if openai_request.stream:
        return sse_response(_stream(header, openai_request, submission), headers)
    response = JsonResponse(await _wait(header, openai_request, submission))
    for name, value in headers.items():
        response[name] = value
    return response


def _failure(done: dict, session_id: str, staff: bool = False) -> OpenAIError | None:
    """The error of a session that did not succeed, else None (its stored detail for staff only)."""
    if done["status"] == SessionStatus.SUCCEEDED:
        return None
    if done["status"] == SessionStatus.CANCELLED:
        return OpenAIError(409, f"the generation (session {session_id}) was cancelled.", code="generation_cancelled")
    error = public_error(done.get("error") or "", staff=staff)
    return OpenAIError(500, f"the generation (session {session_id}) failed: {error['error'] or 'unknown error'}",
                       code=error["error_code"] or "generation_failed")


class _Progress:
    """The text and token count of one reply as its session's events arrive."""

    def __init__(self, request: OpenAIRequest, submission: Submission) -> None:
        self.text = CompletionText(submission.decoder(), request.stop)
        self.encode = submission.encoder()
        self.completion_tokens = 0
        self.done: dict | None = None
        if submission.cached is not None:  # answered from the prediction cache: already done
            self.add([], submission.cached["text"])
            self.completion_tokens = submission.cached["token_count"]
            self.done = {"status": SessionStatus.SUCCEEDED, "finish_reason": submission.cached["finish_reason"]}

    def add(self, token_ids: list[int], text: str) -> None:
        # A cached result comes as text alone: tokenize it so special tokens are skipped alike.
        ids = token_ids or (self.encode(text) if text else [])
        self.text.add(ids, "")
        self.completion_tokens += len(token_ids)

    def on(self, entry: token_stream.StreamEntry) -> None:
        if entry.event == "tokens":
            self.add(entry.data.get("token_ids") or [], entry.data.get("text") or "")
        elif entry.event == "done":
            self.done = entry.data

    def finish_reason(self) -> str:
        return openai_finish_reason(self.done.get("finish_reason") or "", self.text.stopped)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the worker's prefix cache held (its done event says; 0 when it does not)."""
        return int((self.done or {}).get("cached_tokens") or 0)


def _cancel_session(session_id: str) -> None:
    cancel_sessions(Session.objects.filter(pk=session_id))


async def _cancel_abandoned(submission: Submission, progress: _Progress) -> None:
    """The client went away before its reply ended (Django cancels the view, or closes the stream):
    nobody will read the generation, so it stops (SPECOPS_CANCEL_ON_DISCONNECT)."""
    if conf.CANCEL_ON_DISCONNECT and progress.done is None:
        await run_db(_cancel_session, submission.session_id)


async def _wait(header: ReplyHeader, request: OpenAIRequest, submission: Submission) -> dict:
    """Follow the session's stream to its end (at most SPECOPS_OPENAI_TIMEOUT_S): the whole reply.

    A client that disconnects meanwhile cancels the generation (``_cancel_abandoned``).
    """
    progress = _Progress(request, submission)
    timeout = conf.OPENAI_TIMEOUT_S
    if progress.done is None:
        try:
            async with asyncio.timeout(timeout), aclosing(follow(  # just submitted: no step to read first
                    submission.session_id, idle_limit_s=timeout + 1, history_first=submission.replayed)) as items:
                async for item in items:
                    if isinstance(item, token_stream.StreamEntry):
                        progress.on(item)
            if progress.done is None:  # the follow's idle limit (timeout + 1 s) ended it: no end came in time
                raise TimeoutError
        except TimeoutError:
            raise OpenAIError(504, f"the generation did not finish within {timeout:g} s (SPECOPS_OPENAI_TIMEOUT_S); "
                              f"it goes on as session {submission.session_id}.", code="timeout") from None
        except RedisError:
            raise OpenAIError(503, "the token stream is unavailable; try again shortly.",
                              code="stream_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except asyncio.CancelledError:
            await _cancel_abandoned(submission, progress)
            raise
    failure = _failure(progress.done, submission.session_id, submission.staff)
    if failure is not None:
        raise failure
    text = progress.text.full(final=True)
    calls, whole = request.calling.parse(text, submission.session_id) if request.calling else ([], False)
    if calls:
        return tool_call_reply(header, calls, "tool_calls" if whole else progress.finish_reason(),
                               submission.prompt_tokens, progress.completion_tokens, progress.cached_tokens)
    return reply(header, text, progress.finish_reason(), submission.prompt_tokens, progress.completion_tokens,
                 progress.cached_tokens)


class _Deltas:
    """The chunks of a reply's stream as its text grows: text deltas, a named function's arguments
    (its id and name first), or an "auto"/"required" reply's text or whole calls (tools.CallStream)."""

    def __init__(self, header: ReplyHeader, request: OpenAIRequest, submission: Submission) -> None:
        self.header = header
        self.calling = request.calling
        self.named = self.calling is not None and self.calling.choice == NAMED
        self.calls = CallStream(self.calling, submission.session_id) if self.calling and not self.named else None
        self.session_id = submission.session_id
        self.with_usage = request.include_usage
        self.sent_calls = 0

    def start(self) -> list[dict]:
        if not self.named:
            return []
        return [tool_call_chunk(self.header, call_object(self.session_id, 0, self.calling.named, ""),
                                include_usage=self.with_usage)]

    def more(self, text: CompletionText, final: bool = False) -> list[dict]:
        """The chunks for what ``text`` gained since the last call."""
        if self.calls is None:
            piece = text.delta(final)
            if not piece:
                return []
            if self.named:
                return [tool_call_chunk(self.header, {"function": {"arguments": piece}}, include_usage=self.with_usage)]
            return [chunk(self.header, piece, include_usage=self.with_usage)]
        full = text.full(final)
        chunks = []
        for call in self.calls.calls(full):
            chunks.append(tool_call_chunk(self.header, call, self.sent_calls, self.with_usage))
            self.sent_calls += 1
        piece = self.calls.text(full, final)
        if piece:
            chunks.append(chunk(self.header, piece, include_usage=self.with_usage))
        return chunks

    def finish_reason(self, text: CompletionText, progress_reason: str) -> str:
        """"tool_calls" when the reply is whole calls, else the generation's own reason."""
        if self.calling is None:
            return progress_reason
        output = text.full(final=True)
        whole = self.calling.parse(output, self.session_id)[1] if self.named else self.calls.whole(output)
        return "tool_calls" if whole else progress_reason


def _data(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _stream(header: ReplyHeader, request: OpenAIRequest, submission: Submission) -> AsyncIterator[str]:
    """OpenAI's stream: deltas as steps arrive, the finish chunk, the usage chunk, ``[DONE]``.

    A failure, a cancellation or the idle limit ends it with an ``{"error": ...}`` chunk (the
    official client raises it) and ``[DONE]``: never a silent close. A client that closes it
    first cancels the generation (``_cancel_abandoned``).
    """
    progress = _Progress(request, submission)
    with_usage = request.include_usage
    deltas = _Deltas(header, request, submission)
    if header.kind == CHAT:
        yield _data(chunk(header, "", role=True, include_usage=with_usage))
    for body in deltas.start():  # a named function's id and name, before any argument
        yield _data(body)
    error = None
    if progress.done is None:
        try:
            items = follow(submission.session_id, idle_limit_s=project_conf.STREAM_IDLE_LIMIT_S,
                           history_first=submission.replayed)  # just submitted: no committed step to read first
            async with aclosing(items):
                async for item in items:
                    if item == token_stream.HEARTBEAT:
                        yield HEARTBEAT
                    elif item == token_stream.IDLE_LIMIT:
                        error = OpenAIError(504, f"no progress for {project_conf.STREAM_IDLE_LIMIT_S:g} s "
                                            "(SPECOPS_STREAM_IDLE_LIMIT_S); the generation goes on as session "
                                            f"{submission.session_id}.", code="timeout")
                    else:
                        received = time.perf_counter()
                        progress.on(item)
                        for body in deltas.more(progress.text):
                            yield _data(body)
                        if item.event == "tokens":  # resumed once the server has sent the chunk
                            observe("streaming", time.perf_counter() - received)
        except RedisError:
            error = OpenAIError(503, "the token stream is unavailable.", code="stream_unavailable")
        except (asyncio.CancelledError, GeneratorExit):  # the client closed the stream
            await _cancel_abandoned(submission, progress)
            raise
    error = error or _failure(progress.done, submission.session_id, submission.staff)
    if error is not None:
        yield _data(error.body())
        yield DONE
        return
    for body in deltas.more(progress.text, final=True):
        yield _data(body)
    finish = deltas.finish_reason(progress.text, progress.finish_reason())
    yield _data(chunk(header, None, finish, include_usage=with_usage))
    if with_usage:
        yield _data(usage_chunk(header, submission.prompt_tokens, progress.completion_tokens, progress.cached_tokens))
    yield DONE

"""A body over DATA_UPLOAD_MAX_MEMORY_SIZE is refused by the ASGI application before Django reads it:
at its declared Content-Length without reading a byte, or, streamed in without one, at the first
chunk past the limit. A JSON 413 naming the limit, in each API's shape. Every content type alike,
multipart included; and a request without valid credentials is refused past 64 KiB (the check of
the credentials themselves is ``metadata.api.credentials``'s: tests/metadata/test_preauth_body.py)."""
from __future__ import annotations

import asyncio
import json

import pytest
from django.core.asgi import get_asgi_application

from core.body_limit import PREAUTH_BODY_LIMIT, BodyLimit

LIMIT = 10_000


@pytest.fixture(autouse=True)
def small_limit(settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = LIMIT


def scope(path: str, headers: dict[str, str]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}


def call(path: str, headers: dict[str, str], chunks: list[bytes], credentials_valid=None) -> tuple[int, dict, int]:
    """Send ``chunks`` as the body; return (status, JSON body, how many chunks the app read)."""
    reads = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal reads
        if reads >= len(chunks):
            await asyncio.sleep(3600)  # the client waits for the answer (a disconnect only at the end)
        reads += 1
        return {"type": "http.request", "body": chunks[reads - 1], "more_body": reads < len(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        app = BodyLimit(get_asgi_application()) if credentials_valid is None else \
            BodyLimit(get_asgi_application(), credentials_valid=credentials_valid)
        await asyncio.wait_for(app(scope(path, headers), receive, send), 30)

    asyncio.run(run())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), reads


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("path", ["/api/v1/generations/", "/v1/completions"])
def test_a_declared_length_over_the_limit_is_refused_unread(path):
    status, body, reads = call(path, {**JSON, "content-length": str(LIMIT + 1)}, [b"x" * (LIMIT + 1)])
    assert (status, reads) == (413, 0)
    message = body["detail"] if path.startswith("/api/") else body["error"]["message"]
    assert f"{LIMIT} bytes" in message and "DATA_UPLOAD_MAX_MEMORY_SIZE" in message
    assert f"{LIMIT + 1} bytes" in message


def test_a_streamed_body_is_cut_off_at_the_first_chunk_past_the_limit():
    chunks = [b"x" * 4000] * 50  # 200 kB without a Content-Length (chunked)
    status, body, reads = call("/v1/chat/completions", JSON, chunks)
    assert (status, reads) == (413, 3)  # 12,000 bytes read, not 200,000
    assert body["error"]["code"] == "request_too_large" and f"{LIMIT} bytes" in body["error"]["message"]


@pytest.mark.django_db(transaction=True)
def test_a_body_within_the_limit_reaches_the_api():
    payload = json.dumps({"model": "tiny", "prompt": "x"}).encode()
    status, body, reads = call("/v1/completions", {**JSON, "content-length": str(len(payload))}, [payload])
    assert status == 401 and body["error"]["code"] == "missing_api_key" and reads == 1  # Django answered


MULTIPART = {"content-type": "multipart/form-data; boundary=xyz"}


@pytest.mark.parametrize("path", ["/api/v1/sessions/", "/api/v1/generations/", "/admin/login/"])
def test_a_multipart_body_over_the_limit_is_refused_unread(path):
    status, body, reads = call(path, {**MULTIPART, "content-length": str(300_000_000)}, [b"x" * 4000] * 10)
    assert (status, reads) == (413, 0)
    assert f"{LIMIT} bytes" in body["detail"]


def test_a_streamed_multipart_body_is_cut_off_at_the_limit():
    status, body, reads = call("/api/v1/sessions/", MULTIPART, [b"x" * 4000] * 50)
    assert (status, reads) == (413, 3)


@pytest.fixture
def large_limit(settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2_621_440


@pytest.mark.parametrize("headers", [JSON, MULTIPART, {"content-type": "text/plain"}])
def test_without_credentials_a_declared_body_past_64_kib_is_refused_unread(large_limit, headers):
    length = PREAUTH_BODY_LIMIT + 1
    status, body, reads = call("/api/v1/sessions/", {**headers, "content-length": str(length)}, [b"x" * length])
    assert (status, reads) == (413, 0)
    assert f"at most {PREAUTH_BODY_LIMIT} bytes" in body["detail"] and "without valid credentials" in body["detail"]


def test_without_credentials_a_streamed_body_is_cut_off_past_64_kib(large_limit):
    chunks = [b"x" * 16_384] * 100  # 1.6 MB, within the limit of every body
    status, body, reads = call("/v1/chat/completions", JSON, chunks)
    assert (status, reads) == (413, 4)  # 65,536 bytes read, and more to come: no more is read
    assert body["error"]["code"] == "request_too_large"


def test_a_body_past_64_kib_is_read_once_the_credentials_check_passes(large_limit):
    asked: list[dict] = []

    async def valid(scope) -> bool:
        asked.append(scope)
        return True

    chunks = [b"x" * 16_384] * 10
    status, _body, reads = call("/v1/chat/completions", JSON, chunks, credentials_valid=valid)
    assert reads == 10 and status != 413  # Django answered (no token of its own: a 401)
    assert len(asked) == 1  # asked once, past the bound


@pytest.mark.django_db(transaction=True)
def test_a_small_body_is_never_checked_for_credentials(large_limit):
    async def refuse(scope) -> bool:
        raise AssertionError("a body within 64 KiB needs no credentials check")

    payload = json.dumps({"model": "tiny", "prompt": "x"}).encode()
    status, _body, reads = call("/v1/completions", {**JSON, "content-length": str(len(payload))}, [payload],
                                credentials_valid=refuse)
    assert status == 401 and reads == 1

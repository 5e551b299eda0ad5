"""A body over DATA_UPLOAD_MAX_MEMORY_SIZE is refused by the ASGI application before Django reads it:
at its declared Content-Length without reading a byte, or, streamed in without one, at the first
chunk past the limit. A JSON 413 naming the limit, in each API's shape."""
from __future__ import annotations

import asyncio
import json

import pytest
from django.core.asgi import get_asgi_application

from core.body_limit import BodyLimit

LIMIT = 10_000


@pytest.fixture(autouse=True)
def small_limit(settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = LIMIT


def scope(path: str, headers: dict[str, str]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}


def call(path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, dict, int]:
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
        await asyncio.wait_for(BodyLimit(get_asgi_application())(scope(path, headers), receive, send), 30)

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

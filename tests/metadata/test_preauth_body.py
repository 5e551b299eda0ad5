"""A request without valid credentials never gets more than 64 KiB of its body read.

``core.body_limit.BodyLimit`` asks ``metadata.api.credentials.credentials_valid`` (as
``specops/asgi.py`` wires it) before reading past 64 KiB: a valid API token or admin session
gets its body read (up to DATA_UPLOAD_MAX_MEMORY_SIZE), a missing, made-up or revoked token a 413
before the body is read, whatever its content type.
"""
from __future__ import annotations

import asyncio
import json

import pytest
from django.contrib.auth import get_user_model
from django.core.asgi import get_asgi_application
from django.test import Client
from rest_framework.authtoken.models import Token

from core.body_limit import PREAUTH_BODY_LIMIT, BodyLimit
from metadata.api.credentials import credentials_valid

LARGE = 1_000_000  # within DATA_UPLOAD_MAX_MEMORY_SIZE, past the pre-auth bound


def post(path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, dict, int]:
    """POST ``chunks`` through the web's ASGI stack; (status, JSON body, chunks read)."""
    reads, sent = 0, []

    async def receive() -> dict:
        nonlocal reads
        if reads >= len(chunks):
            await asyncio.sleep(3600)
        reads += 1
        return {"type": "http.request", "body": chunks[reads - 1], "more_body": reads < len(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    app = BodyLimit(get_asgi_application(), credentials_valid=credentials_valid)
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        return status, json.loads(body), reads
    except ValueError:  # an HTML page (the admin's)
        return status, {}, reads


MULTIPART = "multipart/form-data; boundary=xyz"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("authorization", [None, "Token " + "f" * 40, "Bearer nope", "Basic YTpi", "Token"])
@pytest.mark.parametrize("content_type", [MULTIPART, "application/json"])
def test_without_valid_credentials_a_large_body_is_refused_unread(authorization, content_type):
    headers = {"Content-Type": content_type, "Content-Length": str(LARGE)}
    if authorization:
        headers["Authorization"] = authorization
    status, body, reads = post("/api/v1/sessions/", headers, [b"x" * 65_536] * 16)
    assert (status, reads) == (413, 0)
    assert f"at most {PREAUTH_BODY_LIMIT} bytes" in body["detail"]


@pytest.mark.django_db(transaction=True)
def test_the_issues_300_mb_multipart_post_is_refused_unread():
    status, _body, reads = post("/api/v1/sessions/", {"Content-Type": MULTIPART, "Content-Length": "314614676"},
                                [b"x" * 65_536] * 16)
    assert (status, reads) == (413, 0)


@pytest.mark.django_db(transaction=True)
def test_a_streamed_body_without_credentials_is_cut_off_past_64_kib():
    status, _body, reads = post("/v1/chat/completions", {"Content-Type": "application/json"}, [b" " * 8192] * 100)
    assert status == 413 and reads * 8192 == PREAUTH_BODY_LIMIT


@pytest.mark.django_db(transaction=True)
def test_a_valid_token_gets_its_large_body_read(api_user):
    key = Token.objects.create(user=api_user).key
    payload = json.dumps({"prompt": "x" * 100_000}).encode()  # past 64 KiB, within the limit
    status, body, reads = post("/api/v1/generations/", {
        "Content-Type": "application/json", "Content-Length": str(len(payload)),
        "Authorization": f"Token {key}"}, [payload])
    assert reads == 1 and status == 400  # read and validated (no model is registered)
    assert "model" in body or "prompt" in body


@pytest.mark.django_db(transaction=True)
def test_an_inactive_users_token_is_no_credential(api_user):
    key = Token.objects.create(user=api_user).key
    api_user.is_active = False
    api_user.save()
    status, _body, reads = post("/api/v1/generations/", {
        "Content-Type": "application/json", "Content-Length": str(100_000), "Authorization": f"Token {key}"},
        [b"x" * 100_000])
    assert (status, reads) == (413, 0)


@pytest.mark.django_db(transaction=True)
def test_an_admin_session_cookie_is_a_credential():
    staff = get_user_model().objects.create_user("ops", password="pw-ops-12345", is_staff=True)
    client = Client()
    client.force_login(staff)
    cookie = f"sessionid={client.cookies['sessionid'].value}"
    body = b"q=" + b"x" * 100_000
    status, _body, reads = post("/admin/login/", {
        "Content-Type": "application/x-www-form-urlencoded", "Content-Length": str(len(body)), "Cookie": cookie},
        [body])
    assert reads == 1 and status != 413
    forged = "sessionid=" + "a" * 32
    status, _body, reads = post("/admin/login/", {
        "Content-Type": "application/x-www-form-urlencoded", "Content-Length": str(len(body)), "Cookie": forged},
        [body])
    assert (status, reads) == (413, 0)

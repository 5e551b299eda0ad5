"""Start the real ASGI web server (uvicorn, one process) against the test database.

Also a pytest plugin (``pytest_plugins = ["tests.web_process"]`` in a test module): its
``live_web`` fixture is one server for the whole run, shared by every module that uses it
(starting one costs seconds: Django, transformers and torch are imported).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connection

from tests.helpers import dies_with_this_run, wait_for
from tests.worker_process import ROOT, database_url

# The live server's stream timings: short, so heartbeats and the idle limit are seen in tests.
HEARTBEAT_S = 0.3
IDLE_LIMIT_S = 6.0


@dataclass
class WebServer:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:<port>
    log_path: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_web(log_path: Path, **env_overrides: str) -> WebServer:
    """``uvicorn specops.asgi:application`` on a free port; return once it answers HTTP."""
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        # Reads on the primary: a token or session a test committed a moment ago must be found
        # at once, and a client here does not send back X-SpecOps-LSN.
        "DATABASE_REPLICA_URLS": "",
        "HF_HUB_OFFLINE": "1",
        **env_overrides,
    }
    log = open(log_path, "w")  # noqa: SIM115 (the child process writes it)
    process = subprocess.Popen(
        dies_with_this_run(["-m", "uvicorn", "specops.asgi:application", "--host", "127.0.0.1", "--port", str(port),
                            "--lifespan", "off", "--no-access-log", "--timeout-graceful-shutdown", "2"]),
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = WebServer(process, f"http://127.0.0.1:{port}", log_path)

    def answers() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"web server exited early; see {log_path}:\n{log_path.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{server.url}/v1/models", timeout=2)
        except urllib.error.HTTPError:
            return True  # 401 without a token: it serves
        except OSError:
            return False
        return True

    try:
        wait_for(answers, timeout=60, interval=0.2, what="the uvicorn web server")
    except BaseException:
        stop_web(server)
        raise
    return server


def stop_web(server: WebServer) -> None:
    if server.process.poll() is not None:
        return
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


@pytest.fixture(scope="session")
def live_web(django_db_setup, tmp_path_factory) -> WebServer:
    server = start_web(tmp_path_factory.mktemp("web") / "web.log", SPECOPS_STREAM_HEARTBEAT_S=str(HEARTBEAT_S),
                       SPECOPS_STREAM_IDLE_LIMIT_S=str(IDLE_LIMIT_S))
    yield server
    stop_web(server)

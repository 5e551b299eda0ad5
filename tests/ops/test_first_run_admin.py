"""`make run`'s script on a fresh checkout: the admin is styled from the web's first request, and
Ctrl-C stops everything it started with exit status 0.

The checkout is a copy of this one's files but what git ignores (no `var/`: no static files
collected, no secret key, no metrics token), with this one's `.venv`, run by `scripts/run.sh` as `make run`
runs it, against the test database and Redis database on a free port. WhiteNoise indexes
`STATIC_ROOT` when a web process starts: a web started before `collectstatic` answered every
static file with a 404 until restarted. The first HTTP request the web gets here is the admin's
stylesheet; then an operator signs in (the credentials `make run` prints once) and the dashboard
draws its charts in Debian's Chromium (tests/ops/test_admin_browser.py has the set-up); then the
process group gets a SIGINT, as a terminal's Ctrl-C sends it.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from django.db import connection

from tests.helpers import wait_for
from tests.ops.test_admin_browser import OperatorPage, browser  # noqa: F401 (the fixture)
from tests.web_process import free_port
from tests.worker_process import ROOT, database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def fresh_checkout(destination: Path) -> Path:
    """This checkout's files as they are now, what git ignores left out (`var/`, `models/`), and
    its virtual environment."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    for name in sorted(set(filter(None, listed.decode().split("\0")))):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    (destination / ".venv").symlink_to(ROOT / ".venv")
    return destination


class Run:
    """`scripts/run.sh` in its own process group, its output in a file."""

    def __init__(self, checkout: Path, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out_path = tmp_path / "run.out"
        env = {
            **os.environ,
            "PYTHONPATH": str(checkout),  # scripts/test.sh puts this checkout first: the copy's own code instead
            "DATABASE_URL": database_url(connection.settings_dict),
            "DATABASE_REPLICA_URLS": "",
            "SPECOPS_PORT": str(self.port), "WEB_WORKERS": "1", "SPECOPS_WORKER_THREADS": "2",
            "SPECOPS_MODEL_DIR": str(tmp_path / "models"), "SPECOPS_CACHE_DIR": str(tmp_path / "cache"),
        }
        for name in ("SECRET_KEY_FILE", "SPECOPS_METRICS_TOKEN", "PROMETHEUS_MULTIPROC_DIR"):
            env.pop(name, None)
        self.process = subprocess.Popen(["scripts/run.sh"], cwd=checkout, env=env, stdout=open(self.out_path, "w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def output(self) -> str:
        return self.out_path.read_text()

    def printed(self, text: str) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"run.sh exited with {self.process.returncode}:\n{self.output}")
        return text in self.output

    def accepts_connections(self) -> bool:
        self.printed("")  # still running
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        if self.group_alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def first_run(tmp_path):
    run = Run(fresh_checkout(tmp_path / "checkout"), tmp_path)
    yield run
    run.kill()


def test_the_first_run_serves_a_styled_admin_from_its_first_request_and_ctrl_c_ends_it(first_run, browser):  # noqa: F811
    run = first_run
    wait_for(lambda: run.printed("started web"), timeout=300, interval=0.2, what="run.sh to start the web")
    wait_for(run.accepts_connections, timeout=300, interval=0.1, what="the web to listen")

    with urllib.request.urlopen(run.url + "/static/admin/css/base.css", timeout=120) as first_answer:
        assert first_answer.status == 200 and b"body" in first_answer.read()

    wait_for(lambda: run.printed("database ready"), timeout=300, interval=0.2, what="the database to be ready")
    password = re.search(r"password: (\S+)", run.output).group(1)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(120_000)
    ops = OperatorPage(page, run.url)
    ops.open("/admin/login/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", password)
    with page.expect_navigation():
        page.click("input[type=submit]")
    assert page.locator("#user-tools").count() == 1, page.content()[:2000]
    header = page.eval_on_selector("#header", "header => getComputedStyle(header).backgroundColor")
    assert header not in ("", "transparent", "rgba(0, 0, 0, 0)")  # base.css applied
    ops.open("/admin/dashboard/")
    assert page.locator("svg.chart").count() >= 12
    ops.shot("first-run-dashboard")
    ops.assert_clean()
    context.close()

    os.killpg(run.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    assert run.process.wait(timeout=120) == 0, run.output
    assert run.output.rstrip().splitlines()[-1].startswith("SpecOps stopped:"), run.output
    assert "exited on its own" not in run.output
    deadline = time.monotonic() + 30
    while run.group_alive() and time.monotonic() < deadline:  # run.sh waited for them; the kernel reaps
        time.sleep(0.2)
    assert not run.group_alive(), subprocess.run(["ps", "-o", "pid,cmd", "-g", str(run.process.pid)],
                                                 capture_output=True, text=True).stdout

"""deploy/loadtest: a bounded locust run judged against the SLO, and the SLO checker."""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
LOADTEST = DEPLOY / "loadtest"
RUN_SH = LOADTEST / "run.sh"


def run_sh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUN_SH), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPECOPS_TOKEN": "t", **(env or {})})


def test_locustfile_defines_the_two_users():
    locust = Path(sys.executable).parent / "locust"
    result = subprocess.run([str(locust), "-f", str(LOADTEST / "locustfile.py"), "--list"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert {"GenerationUser", "BurstReader"} <= set(result.stdout.split())


def test_run_sh_builds_a_bounded_headless_command():
    result = run_sh("--dry-run", "-u", "3", "-r", "1.5", "-t", "1m30s", "-n", "500", "-o", "/tmp/x", "BurstReader")
    assert result.returncode == 0, result.stderr
    command = result.stdout
    for part in ("SPECOPS_LOAD_MAX_REQUESTS=500", "--headless", "--host http://127.0.0.1:8000", "-u 3",
                 "-r 1.5", "-t 1m30s", "--csv /tmp/x/locust", "BurstReader"):
        assert part in command, part


@pytest.mark.parametrize(("args", "env", "message"), [
    (["-H", "http://10.1.2.3:8000"], {}, "not a loopback address"),
    (["-H", "http://example.com"], {}, "not a loopback address"),
    (["-u", "0"], {}, "--users must be a positive integer"),
    (["-r", "0"], {}, "--spawn-rate must be a number greater than 0"),
    (["-t", "2h"], {}, "--run-time must be from 1s to 1h"),
    (["-t", "soon"], {}, "--run-time must look like"),
    (["-n"], {}, "-n needs a value"),
    (["--frobnicate"], {}, "unknown option --frobnicate"),
    (["Spammer"], {}, "unknown user class Spammer"),
    ([], {"SPECOPS_TOKEN": ""}, "SPECOPS_TOKEN is not set"),
])
def test_run_sh_refuses_bad_arguments_with_one_line(args, env, message):
    result = run_sh(*args, env=env)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_run_sh_allows_a_remote_host_only_when_told():
    result = run_sh("--dry-run", "-H", "http://10.1.2.3:8000", env={"SPECOPS_LOAD_ALLOW_REMOTE": "1"})
    assert result.returncode == 0 and "--host http://10.1.2.3:8000" in result.stdout


STATS_HEADER = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time",
                "Average Response Time", "Min Response Time", "Max Response Time", "Average Content Size",
                "Requests/s", "Failures/s", "50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%",
                "99.9%", "99.99%", "100%"]


def write_stats(path: Path, requests: int, failures: int, p95: str, p99: str) -> Path:
    rows = [["GET", "/api/v1/sessions/[id]/", requests, failures, 40, 50, 5, 900, 100, 10, 0, 40, 50, 60, 70,
             80, p95, 400, p99, 900, 900, 900],
            ["", "Aggregated", requests, failures, 40, 50, 5, 900, 100, 10, 0, 40, 50, 60, 70, 80, p95, 400, p99,
             900, 900, 900]]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(STATS_HEADER)
        writer.writerows(rows)
    return path


@pytest.mark.parametrize(("requests", "failures", "p95", "p99", "status", "verdict"), [
    (10_000, 49, "290", "590", 0, "slo: held"),
    (10_000, 50, "290", "590", 1, "errors 0.500% (FAIL"),  # 0.5 % is not < 0.5 %
    (10_000, 0, "300", "590", 1, "p95 300 ms (FAIL"),
    (10_000, 0, "290", "610", 1, "p99 610 ms (FAIL"),
    (10_000, 0, "N/A", "N/A", 1, "p95 - ms (FAIL"),
    (5, 0, "10", "10", 2, "cannot judge"),
    (5, 5, "10", "10", 1, "errors 100.000% of only 5 requests"),  # too few, but all failed: broken
])
def test_slo_check_verdicts(tmp_path, requests, failures, p95, p99, status, verdict):
    stats = write_stats(tmp_path / "locust_stats.csv", requests, failures, p95, p99)
    result = subprocess.run([sys.executable, str(LOADTEST / "slo_check.py"), str(stats)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == status, result.stdout + result.stderr
    assert verdict in result.stdout + result.stderr


def test_slo_check_lists_the_most_frequent_failures(tmp_path):
    stats = write_stats(tmp_path / "locust_stats.csv", 1000, 20, "100", "200")
    (tmp_path / "locust_failures.csv").write_text(
        "Method,Name,Error,Occurrences,First Seen,Last Seen\n"
        "GET,/api/v1/sessions/[id]/,CatchResponseError('HTTP 503: down'),15,x,y\n"
        "POST,/api/v1/generations/,CatchResponseError('HTTP 500: boom'),5,x,y\n")
    result = subprocess.run([sys.executable, str(LOADTEST / "slo_check.py"), str(stats)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if "HTTP 503" in line)
    assert "15 x GET /api/v1/sessions/[id]/" in lines[first] and "HTTP 500" in lines[first + 1]


def test_slo_check_without_a_stats_file(tmp_path):
    result = subprocess.run([sys.executable, str(LOADTEST / "slo_check.py"), str(tmp_path / "none.csv")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "no stats file" in result.stderr


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_load_test_runs_end_to_end_against_a_live_server(live_server, api_user, tiny_model, tmp_path):
    """A short real run: create, poll, page tokens by cursor, bursts of reads; no request may fail."""
    from rest_framework.authtoken.models import Token

    from specops.celery import app
    from tests.worker_process import start_worker, stop_worker

    app.control.purge()
    worker = start_worker("cpu", "loadtest-cpu", tmp_path / "worker.log")
    try:
        result = run_sh("-H", live_server.url, "-u", "4", "-r", "4", "-t", "10s", "-n", "3000",
                        "-o", str(tmp_path / "run"),
                        env={"SPECOPS_TOKEN": Token.objects.create(user=api_user).key,
                             "SPECOPS_LOAD_MAX_NEW_TOKENS": "12", "SPECOPS_LOAD_TOKEN_PAGE_SIZE": "5"})
    finally:
        stop_worker(worker)
    log = (tmp_path / "run" / "locust.log").read_text() if (tmp_path / "run" / "locust.log").exists() else ""
    assert result.returncode in (0, 1), result.stdout + result.stderr + log  # judged (latency varies in CI)
    with (tmp_path / "run" / "locust_stats.csv").open() as handle:
        rows = {row["Name"]: row for row in csv.DictReader(handle)}
    for name in ("/api/v1/generations/", "/api/v1/sessions/[id]/", "/api/v1/sessions/[id]/tokens/",
                 "/api/v1/sessions/[id]/ (burst)"):
        assert int(rows[name]["Request Count"]) > 0, (name, result.stdout)
    assert rows["Aggregated"]["Failure Count"] == "0", result.stdout + log
    assert re.search(r"generations: \d+ finished or timed out, [1-9]\d* succeeded", result.stdout), result.stdout

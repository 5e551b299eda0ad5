"""The operations files in deploy/: alert rules, dashboard, service units and the load test.

Checks what a reviewer would miss: a rule or panel that names a metric the app does not export
(it would never fire / stay empty), an API view the SLO selector does not cover, a unit whose
``%h`` systemd expands to a home directory, a load test that cannot judge its own run.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "specops.json"
UNITS = DEPLOY / "systemd"
LOADTEST = DEPLOY / "loadtest"
RUN_SH = LOADTEST / "run.sh"

# Metrics the rules and the dashboard use that no app module exports yet, and why each is listed.
# Keep this short: a name here is an alert that cannot fire until its exporter lands.
PLANNED_METRICS: dict[str, str] = {
    "specops_celery_queue_length": "gauge{queue}: tasks waiting per Celery queue (LLEN on the Redis broker)",
    "specops_partition_default_rows": "gauge{table}: rows in each partitioned table's DEFAULT partition",
    "specops_archival_jobs": "gauge{step}: partition archival jobs per step (step='failed' alerts)",
    "specops_db_reads_total": "counter{target=primary|replica, reason}: routed reads, for the fallback rate",
}
# Metrics that other exporters provide, scraped as other jobs in deploy/prometheus/prometheus.yml.
EXTERNAL_METRICS: dict[str, str] = {
    "up": "Prometheus, per scrape target",
    "node_systemd_unit_state": "node_exporter --collector.systemd",
}
# Modules that define Prometheus metrics outside the web's request path (workers, probes).
METRIC_MODULE_ROOTS = ("inference", "metadata", "specops")

PROMQL_WORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
    "bool", "inf", "nan", "le",
}


# ---------------------------------------------------------------------------- helpers

def alert_groups() -> list[dict]:
    return yaml.safe_load(ALERTS.read_text())["groups"]


def all_rules() -> list[dict]:
    return [rule for group in alert_groups() for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels and durations removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges: [5m], [$__rate_interval]
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[smhdwy]?\b", " ", text)  # numbers, durations
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        followed_by_call = re.match(r"\s*\(", text[match.end():])
        if word.lower() in PROMQL_WORDS or followed_by_call:
            continue
        names.add(word)
    return names


def used_metric_names() -> dict[str, set[str]]:
    """{metric name: where it is used}, for every alert, recording rule and dashboard target."""
    used: dict[str, set[str]] = {}
    for rule in all_rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(f"alerts.yml {rule.get('alert') or rule.get('record')}")
    for panel in dashboard_panels():
        for target in panel["targets"]:
            for name in metric_names(target["expr"]):
                used.setdefault(name, set()).add(f"dashboard panel {panel['title']!r}")
    return used


def recorded_names() -> set[str]:
    return {rule["record"] for rule in all_rules() if "record" in rule}


def exposition_names(body: str) -> set[str]:
    """Every series name a scrape of ``body`` can yield, including the families' declared names."""
    names = set()
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()[:4]
            names.add(family)
            if kind == "histogram":
                names.update({f"{family}_bucket", f"{family}_count", f"{family}_sum"})
            elif kind == "counter" and not family.endswith("_total"):
                names.add(f"{family}_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def import_metric_modules() -> None:
    """Import the app modules that define Prometheus metrics, as the workers do.

    In production the web's /metrics shows every process's metrics (multiprocess mode), so a
    metric a worker registers counts as exported even if the web never imports its module.
    """
    import importlib

    for root in METRIC_MODULE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            if "engine" in path.parts or "migrations" in path.parts:
                continue
            if "prometheus_client" in path.read_text():
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                importlib.import_module(module)


def api_view_selector() -> re.Pattern:
    """The ``view=~"..."`` regex the SLO recording rules select API views with."""
    exprs = [rule["expr"] for rule in all_rules() if rule.get("record", "").startswith("specops:api_")]
    regexes = {m for expr in exprs for m in re.findall(r'view=~"([^"]+)"', expr)}
    assert len(regexes) == 1, f"the API recording rules should share one view selector, found {regexes}"
    return re.compile(regexes.pop())  # PromQL regexes are anchored: use fullmatch


def api_route_names() -> set[str]:
    from django.urls import URLPattern, URLResolver, get_resolver

    names: set[str] = set()

    def walk(patterns, prefix: str) -> None:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern) and (prefix + str(pattern.pattern)).startswith("api/v1/"):
                names.add(pattern.name)

    walk(get_resolver().url_patterns, "")
    return names


# ---------------------------------------------------------------------------- alert rules

def test_every_rule_is_complete():
    rules = all_rules()
    alerts = [r for r in rules if "alert" in r]
    assert len(alerts) >= 15
    for rule in rules:
        assert ("alert" in rule) != ("record" in rule), rule
        assert rule.get("expr", "").strip(), rule
    for alert in alerts:
        name = alert["alert"]
        assert re.fullmatch(r"\d+[smh]", str(alert.get("for", ""))), f"{name}: needs for: (e.g. 5m)"
        assert alert.get("labels", {}).get("severity") in ("critical", "warning", "info"), name
        annotations = alert.get("annotations", {})
        assert annotations.get("summary"), f"{name}: needs annotations.summary"
        assert annotations.get("runbook"), f"{name}: needs a runbook hint"
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names)), "duplicate alert names"


def test_alerts_cover_the_slos_and_the_operational_risks():
    by_name = {r["alert"]: r for r in all_rules() if "alert" in r}
    thresholds = {
        "SpecOpsApiLatencyP95SLOBreach": "> 0.3",
        "SpecOpsApiLatencyP99SLOBreach": "> 0.6",
        "SpecOpsApiErrorRatioSLOBreach": "> 0.005",
        "SpecOpsMetadataQueryLatencyHigh": "> 0.02",
    }
    for name, threshold in thresholds.items():
        assert threshold in by_name[name]["expr"], f"{name} should compare with {threshold}"
    for name in ("SpecOpsReplicaLagHigh", "SpecOpsReplicaFallbackRateHigh", "SpecOpsCacheHitRateDrop",
                 "SpecOpsCeleryQueueBacklog", "SpecOpsCeleryWorkerDown", "SpecOpsCeleryBeatNotExactlyOne",
                 "SpecOpsDefaultPartitionNotEmpty", "SpecOpsArchivalJobFailed"):
        assert name in by_name


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (alias, le) (rate(django_db_query_duration_seconds_bucket'
            '{job="specops", view=~"a|b"}[5m]))) > 0.02 and on(alias) foo:bar:rate5m offset 1h '
            '> 16 * 1024 and max(x_total{le="+Inf"}[$__rate_interval]) or vector(0)')
    assert metric_names(expr) == {"django_db_query_duration_seconds_bucket", "foo:bar:rate5m", "x_total"}


@pytest.mark.django_db
def test_every_metric_used_is_exported_planned_or_external(api_client):
    import_metric_modules()
    api_client.get("/api/v1/sessions/")  # a request that runs SQL, so the DB metrics have samples
    api_client.post("/api/v1/generations/", {"prompt": "x"}, format="json")
    exported = exposition_names(api_client.get("/metrics").content.decode())
    assert "django_http_requests_latency_seconds_by_view_method_bucket" in exported

    used = used_metric_names()
    assert len(used) >= 15, "the extraction found too few metric names to be trusted"
    known = exported | recorded_names() | set(PLANNED_METRICS) | set(EXTERNAL_METRICS)
    unknown = {name: sorted(where) for name, where in used.items() if name not in known}
    hint = ""
    if any(name.startswith("django_db_") for name in unknown):
        hint = (" django_db_* come only from django-prometheus's database backend: set ENGINE to "
                "'django_prometheus.db.backends.postgresql' in specops/database_config.py.")
    assert not unknown, f"metrics that nothing exports: {unknown}.{hint}"


def test_planned_metrics_stay_a_short_explicit_list():
    used = set(used_metric_names())
    assert len(PLANNED_METRICS) <= 6
    assert set(PLANNED_METRICS) <= used, "a planned metric no rule or panel uses: drop it from the list"
    assert all(len(reason) > 20 for reason in PLANNED_METRICS.values())


def test_the_slo_view_selector_covers_every_api_route_and_nothing_else():
    selector = api_view_selector()
    routes = api_route_names()
    assert {"generation-list", "session-detail", "session-tokens", "session-candidates"} <= routes
    uncovered = sorted(name for name in routes if not selector.fullmatch(name))
    assert not uncovered, f"API routes outside the SLO rules' view selector {selector.pattern!r}: {uncovered}"
    for other in ("prometheus-django-metrics", "admin:index", "schema", "api-docs"):
        assert not selector.fullmatch(other), other


promtool = shutil.which("promtool")


@pytest.mark.parametrize("args", [
    ["check", "config", "prometheus.yml"],
    ["check", "rules", "alerts.yml"],
    ["test", "rules", "alerts_test.yml"],  # synthetic series: each alert fires on a breach, not below
])
def test_promtool_accepts_the_config_and_the_rule_tests_pass(args):
    assert promtool, "promtool missing: scripts/bootstrap.sh installs Debian's 'prometheus' package"
    result = subprocess.run([promtool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------- dashboard

def test_dashboard_panels_query_prometheus_and_do_not_overlap():
    board = dashboard()
    assert board["uid"] and board["title"] == "SpecOps"
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in board["templating"]["list"])
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}", panel["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_draws_the_slo_lines():
    def threshold_values(title_fragment: str) -> set[float]:
        panel = next(p for p in dashboard_panels() if title_fragment in p["title"])
        steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
        return {s["value"] for s in steps if s["value"] is not None}

    assert {0.3, 0.6} <= threshold_values("API latency vs SLO")
    assert {0.005} <= threshold_values("error ratio")
    assert {0.02} <= threshold_values("DB query latency")
    titles = " ".join(p["title"] for p in dashboard_panels())
    for topic in ("tokens/s", "acceptance", "Cache hit rate", "Replica lag"):
        assert topic in titles


# ---------------------------------------------------------------------------- systemd units

def read_unit(path: Path) -> dict[str, list[str]]:
    """``{"Section.Key": [values...]}``; repeated keys (Environment=) keep every value."""
    keys: dict[str, list[str]] = {}
    section, pending = "", ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        else:
            key, _, value = line.partition("=")
            keys.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return keys


def unit_env(unit: dict[str, list[str]]) -> dict[str, str]:
    env = {}
    for value in unit.get("Service.Environment", []):
        for pair in value.split():
            name, _, val = pair.partition("=")
            env[name] = val
    return env


def services() -> dict[str, dict[str, list[str]]]:
    return {path.name: read_unit(path) for path in sorted(UNITS.glob("*.service"))}


def test_units_share_one_multiprocess_dir_and_read_the_environment_file():
    units = services()
    assert {"specops-web.service", "specops-worker-cpu.service", "specops-worker-gpu@.service",
            "specops-worker-maintenance.service", "specops-beat.service"} <= set(units)
    metrics_dir = units.pop("specops-metrics-dir.service")
    shared = "/run/" + metrics_dir["Service.RuntimeDirectory"][0]
    for name, unit in units.items():
        assert unit.get("Service.EnvironmentFile") == ["/etc/specops/specops.env"], name
        assert unit_env(unit).get("PROMETHEUS_MULTIPROC_DIR") == shared, name
        assert "specops-metrics-dir.service" in " ".join(unit.get("Unit.Requires", [])), name
        exec_start = unit["Service.ExecStart"][0]
        # systemd expands %h to the user's home: celery's own %h must be written %%h (or use %H).
        assert not re.search(r"(?<!%)%h", exec_start), f"{name}: bare %h in ExecStart"


def test_workers_run_one_prefork_child_per_device_queue_and_one_beat():
    units = services()
    queues = {}
    for name, unit in units.items():
        exec_start = unit["Service.ExecStart"][0]
        if " worker " in exec_start:
            assert "--pool prefork --concurrency 1" in exec_start, name
            queues[name] = re.search(r"-Q (\S+)", exec_start).group(1)
            assert re.search(r"-n \S+@%H", exec_start), f"{name}: needs a unique node name"
            assert unit.get("Service.KillMode") == ["mixed"], f"{name}: warm shutdown needs KillMode=mixed"
    assert queues == {"specops-worker-cpu.service": "cpu", "specops-worker-gpu@.service": "gpu.%i",
                      "specops-worker-maintenance.service": "maintenance"}
    assert unit_env(units["specops-worker-gpu@.service"])["SPECOPS_WORKER_DEVICE"] == "cuda:%i"
    assert unit_env(units["specops-worker-cpu.service"])["SPECOPS_WORKER_DEVICE"] == "cpu"
    beats = [name for name, unit in units.items() if " beat " in unit["Service.ExecStart"][0]]
    assert beats == ["specops-beat.service"]
    web = units["specops-web.service"]["Service.ExecStart"][0]
    assert "gunicorn specops.wsgi:application" in web and "--worker-class gthread" in web


systemd_analyze = shutil.which("systemd-analyze")


def test_systemd_accepts_the_units(tmp_path):
    assert systemd_analyze, "systemd-analyze missing: scripts/bootstrap.sh installs Debian's 'systemd' package"
    for path in UNITS.iterdir():
        shutil.copy(path, tmp_path / path.name)
    template = tmp_path / "specops-worker-gpu@.service"
    shutil.copy(template, tmp_path / "specops-worker-gpu@0.service")
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != template.name)
    result = subprocess.run([systemd_analyze, "verify", "--man=no", *names], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    # The install paths (/opt/specops/.venv/...) do not exist on a developer's machine.
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line.strip() and "is not executable" not in line]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- load test

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

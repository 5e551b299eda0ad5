"""The monitoring files in deploy/: alert rules and the Grafana dashboard.

Checks what a reviewer would miss: a rule or panel that names a metric the app does not export
(it would never fire / stay empty), an API view the SLO selector does not cover, a unit whose
``%h`` systemd expands to a home directory, a load test that cannot judge its own run.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "specops.json"

# Metrics the rules and the dashboard use that no app module exports yet, and why each is listed.
# Keep this short: a name here is an alert that cannot fire until its exporter lands.
PLANNED_METRICS: dict[str, str] = {
    "specops_db_reads_total": "counter{target=primary|replica, reason}: routed reads, for the fallback rate",
}
# Metrics of the device workers' batching loop (inference/worker/metrics.py) that the serving rules
# and panels read. Exported today: none of them may be planned, and each must show on /metrics.
SERVING_METRICS: dict[str, str] = {
    "specops_time_to_first_token_seconds_bucket": "TTFT SLO alert and panel",
    "specops_inter_token_latency_seconds_bucket": "ITL SLO alert and panel",
    "specops_request_queue_time_seconds_bucket": "queue wait panel",
    "specops_e2e_request_latency_seconds_count": "generation failures alert",
    "specops_batch_rows_bucket": "batch rows per forward panel",
    "specops_batch_tokens_per_forward_sum": "tokens per forward panel",
    "specops_forward_seconds_bucket": "forward time panel",
    "specops_batch_running_rows": "running rows (multiprocess livesum gauge)",
    "specops_spec_decode_num_drafts_total": "mean acceptance length",
    "specops_spec_decode_num_draft_tokens_total": "acceptance rate recording rule",
    "specops_spec_decode_num_accepted_tokens_total": "acceptance rate recording rule",
    "specops_spec_decode_num_drafted_tokens_per_pos_total": "per-position acceptance",
    "specops_spec_decode_num_accepted_tokens_per_pos_total": "per-position acceptance",
    "specops_spec_decode_policy_depth_total": "policy depth panel",
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
    for name in ("SpecOpsTimeToFirstTokenP95SLOBreach", "SpecOpsInterTokenLatencyP95SLOBreach",
                 "SpecOpsSpeculativeAcceptanceLow", "SpecOpsGenerationFailures",
                 "SpecOpsReplicaLagHigh", "SpecOpsReplicaFallbackRateHigh", "SpecOpsCacheHitRateDrop",
                 "SpecOpsCeleryQueueBacklog", "SpecOpsCeleryWorkerDown", "SpecOpsCeleryBeatNotExactlyOne",
                 "SpecOpsDefaultPartitionNotEmpty", "SpecOpsArchivalJobFailed"):
        assert name in by_name


def test_serving_slo_alerts_compare_with_the_histograms_bucket_edges():
    """The TTFT/ITL thresholds are the worker's SLO constants, which are bucket edges (exact quantiles)."""
    from inference.worker import metrics

    by_name = {r["alert"]: r for r in all_rules() if "alert" in r}
    for name, slo, buckets in (
        ("SpecOpsTimeToFirstTokenP95SLOBreach", metrics.TTFT_SLO_SECONDS, metrics.TTFT_BUCKETS),
        ("SpecOpsInterTokenLatencyP95SLOBreach", metrics.ITL_SLO_SECONDS, metrics.ITL_BUCKETS),
    ):
        expr = by_name[name]["expr"]
        assert re.search(rf":p95_5m > {slo:g}\b", expr), f"{name} should compare the p95 with {slo:g}"
        assert slo in buckets, f"{name}: {slo:g} s is no bucket edge"
    records = recorded_names()
    for record in ("specops:spec_decode_acceptance_rate:rate5m", "specops:spec_decode_mean_acceptance_length:rate5m",
                   "specops:spec_decode_acceptance_rate_per_position:rate5m"):
        assert record in records, record


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (alias, le) (rate(django_db_query_duration_seconds_bucket'
            '{job="specops", view=~"a|b"}[5m]))) > 0.02 and on(alias) foo:bar:rate5m offset 1h '
            '> 16 * 1024 and max(x_total{le="+Inf"}[$__rate_interval]) or vector(0)')
    assert metric_names(expr) == {"django_db_query_duration_seconds_bucket", "foo:bar:rate5m", "x_total"}


@pytest.mark.django_db
def test_every_metric_used_is_exported_planned_or_external(api_client, settings):
    from django.test import Client

    settings.SPECOPS_METRICS_TOKEN = "t"  # core.metrics_view: Prometheus's bearer token, not an API token
    import_metric_modules()
    api_client.get("/api/v1/sessions/")  # a request that runs SQL, so the DB metrics have samples
    api_client.post("/api/v1/generations/", {"prompt": "x"}, format="json")
    exported = exposition_names(Client().get("/metrics", HTTP_AUTHORIZATION="Bearer t").content.decode())
    assert "django_http_requests_latency_seconds_by_view_method_bucket" in exported

    used = used_metric_names()
    assert len(used) >= 15, "the extraction found too few metric names to be trusted"
    exported_now = sorted(set(PLANNED_METRICS) & exported)
    assert not exported_now, f"exported now, drop them from PLANNED_METRICS: {exported_now}"
    assert not set(SERVING_METRICS) & set(PLANNED_METRICS), "a serving metric is exported, never planned"
    missing = sorted(set(SERVING_METRICS) - exported)
    assert not missing, f"serving metrics the worker should export but /metrics lacks: {missing}"
    known = exported | recorded_names() | set(PLANNED_METRICS) | set(EXTERNAL_METRICS)
    unknown = {name: sorted(where) for name, where in used.items() if name not in known}
    hint = ""
    if any(name.startswith("django_db_") for name in unknown):
        hint = (" django_db_* come only from django-prometheus's database backend: set ENGINE to "
                "'django_prometheus.db.backends.postgresql' in core/database_config.py.")
    assert not unknown, f"metrics that nothing exports: {unknown}.{hint}"


def test_every_serving_metric_is_read_by_a_rule_or_panel():
    used = set(used_metric_names())
    unused = sorted(set(SERVING_METRICS) - used)
    assert not unused, f"serving metrics no rule or panel reads (drop them from SERVING_METRICS): {unused}"


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
    ["check", "config", "--syntax-only", "prometheus.yml"],  # the scrape's token file is the host's
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
    assert {1.0} <= threshold_values("Time to first token vs SLO")
    assert {0.1} <= threshold_values("Inter-token latency vs SLO")
    titles = " ".join(p["title"] for p in dashboard_panels())
    for topic in ("tokens/s", "acceptance", "Cache hit rate", "Replica lag", "Batch rows per forward",
                  "Tokens per forward", "per draft position", "policy depth", "Queue wait"):
        assert topic in titles


def test_dashboard_shows_ttft_and_itl_p50_and_p95():
    for title in ("Time to first token vs SLO", "Inter-token latency vs SLO"):
        panel = next(p for p in dashboard_panels() if p["title"] == title)
        quantiles = {re.match(r"histogram_quantile\(([\d.]+),", t["expr"]).group(1) for t in panel["targets"]}
        assert quantiles == {"0.5", "0.95"}, title

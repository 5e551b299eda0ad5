"""Judge a locust run against the SpecOps SLO, endpoint by endpoint and on the time to first token.

    python deploy/loadtest/slo_check.py var/loadtest/<run>/locust_stats.csv [--p95-ms 300] ...

Every row of locust's ``--csv`` stats is judged on its own, so one slow endpoint cannot hide in
the aggregate of many fast reads:

- an API endpoint (``POST /api/v1/generations/``, ``GET /api/v1/sessions/[id]/``, ...):
  p95 < 300 ms, p99 < 600 ms, errors < 0.5 %;
- the ``TTFT`` rows the locustfile reports (POST to the stream's first tokens event):
  p95 < 1000 ms, errors < 0.5 %.

An endpoint with fewer than ``--min-requests`` requests is not judged (too few for a p95),
unless its errors alone break the SLO. The ``Aggregated`` row is shown, not judged (locust mixes
the TTFT rows into it). Prints a table, the most frequent failures and one verdict line. Exit
status: 0 the SLO held on every judged endpoint, 1 it was broken on one at least, 2 the run
cannot be judged (no file, or no endpoint with enough requests). Standard library only: it runs
without locust.
"""
from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

SLO_HELD, SLO_BROKEN, UNJUDGEABLE = 0, 1, 2
TTFT_TYPE = "TTFT"


@dataclass(frozen=True)
class EndpointStats:
    kind: str  # the locust request type: GET, POST, ..., or TTFT
    path: str
    requests: int
    failures: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None

    @property
    def name(self) -> str:
        return f"{self.kind} {self.path}".strip()

    @property
    def error_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Slo:
    """Latency limits (None: not judged) and the error ratio, for one kind of endpoint."""

    p95_ms: float | None
    p99_ms: float | None
    max_error_ratio: float


@dataclass(frozen=True)
class Verdict:
    endpoint: EndpointStats
    judged: bool
    broken: bool
    detail: str


def _ms(raw: str) -> float | None:
    return None if raw in ("", "N/A") else float(raw)


def read_stats(path: Path) -> tuple[list[EndpointStats], EndpointStats | None]:
    """Return (per-endpoint rows, the Aggregated row or None) from a locust ``_stats.csv``."""
    rows, aggregated = [], None
    with path.open(newline="") as handle:
        for raw in csv.DictReader(handle):
            stats = EndpointStats(
                kind=raw["Type"], path=raw["Name"], requests=int(raw["Request Count"]),
                failures=int(raw["Failure Count"]), p50_ms=_ms(raw["50%"]), p95_ms=_ms(raw["95%"]),
                p99_ms=_ms(raw["99%"]),
            )
            if raw["Name"] == "Aggregated":
                aggregated = stats
            else:
                rows.append(stats)
    return rows, aggregated


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def judge_endpoint(row: EndpointStats, slo: Slo, min_requests: int) -> Verdict:
    """One endpoint against its SLO: each check shown as ``p95 290 ms (ok, SLO < 300 ms)``."""
    if row.requests < min_requests:
        if row.failures and row.error_ratio >= slo.max_error_ratio:
            # Too few to judge latency, but an endpoint that mostly fails (server down, bad token) is broken.
            return Verdict(row, True, True, f"errors {row.error_ratio:.3%} of only {row.requests} requests")
        return Verdict(row, False, False, f"too few to judge: {row.requests} requests, at least {min_requests}")
    checks = []
    for label, value, limit in (("p95", row.p95_ms, slo.p95_ms), ("p99", row.p99_ms, slo.p99_ms)):
        if limit is not None:
            checks.append((label, value, limit, f"{_fmt(value)} ms", f"< {limit:g} ms"))
    checks.append(("errors", row.error_ratio, slo.max_error_ratio, f"{row.error_ratio:.3%}",
                   f"< {slo.max_error_ratio:.2%}"))
    failed = {label for label, value, limit, _, _ in checks if value is None or value >= limit}
    detail = ", ".join(f"{label} {shown} ({'FAIL' if label in failed else 'ok'}, SLO {rule})"
                       for label, _, _, shown, rule in checks)
    return Verdict(row, True, bool(failed), f"{detail}; {row.requests} requests")


def print_table(rows: list[EndpointStats], aggregated: EndpointStats | None) -> None:
    print(f"{'endpoint':<56} {'requests':>8} {'errors':>7} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7}")
    for row in rows + ([aggregated] if aggregated else []):
        name = row.name if row is not aggregated else "Aggregated (all rows, TTFT included; not judged)"
        print(f"{name:<56} {row.requests:>8} {row.error_ratio:>7.2%} {_fmt(row.p50_ms):>7} "
              f"{_fmt(row.p95_ms):>7} {_fmt(row.p99_ms):>7}")


def print_top_failures(stats_csv: Path, limit: int = 5) -> None:
    """The most frequent failures, from the ``_failures.csv`` locust writes beside the stats."""
    failures_csv = stats_csv.with_name(stats_csv.name.replace("_stats.csv", "_failures.csv"))
    if failures_csv == stats_csv or not failures_csv.is_file():
        return
    with failures_csv.open(newline="") as handle:
        rows = sorted(csv.DictReader(handle), key=lambda row: -int(row["Occurrences"]))
    for row in rows[:limit]:
        print(f"  {row['Occurrences']:>6} x {row['Method']} {row['Name']}: {row['Error'][:160]}")


def judge(stats_csv: Path, api: Slo, ttft: Slo, min_requests: int) -> int:
    if not stats_csv.is_file():
        print(f"slo: no stats file {stats_csv} (did locust run?)", file=sys.stderr)
        return UNJUDGEABLE
    try:
        rows, aggregated = read_stats(stats_csv)
    except (KeyError, ValueError) as exc:
        print(f"slo: {stats_csv} is not a locust stats CSV: {exc}", file=sys.stderr)
        return UNJUDGEABLE
    print_table(rows, aggregated)
    if any(row.failures for row in rows):
        print("failures:")
        print_top_failures(stats_csv)

    verdicts = [judge_endpoint(row, ttft if row.kind == TTFT_TYPE else api, min_requests) for row in rows]
    print("per endpoint (API: p95, p99, errors; TTFT: p95, errors):")
    for verdict in verdicts:
        mark = "BROKEN" if verdict.broken else "held" if verdict.judged else "-"
        print(f"  {mark:<6} {verdict.endpoint.name}: {verdict.detail}")

    judged = [v for v in verdicts if v.judged]
    broken = [v.endpoint.name for v in verdicts if v.broken]
    if broken:
        print(f"slo: BROKEN on {len(broken)} of {len(judged)} judged endpoints: {', '.join(broken)}")
        return SLO_BROKEN
    if not judged:
        count = sum(row.requests for row in rows)
        print(f"slo: cannot judge: no endpoint has {min_requests} requests ({count} in all)", file=sys.stderr)
        return UNJUDGEABLE
    ttft_judged = any(v.endpoint.kind == TTFT_TYPE for v in judged)
    print(f"slo: held on all {len(judged)} judged endpoints"
          f"{'' if ttft_judged else ' (TTFT not judged: too few streams)'}")
    return SLO_HELD


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stats_csv", type=Path, help="locust --csv PREFIX writes PREFIX_stats.csv")
    parser.add_argument("--p95-ms", type=float, default=300.0, help="API endpoints' p95 limit")
    parser.add_argument("--p99-ms", type=float, default=600.0, help="API endpoints' p99 limit")
    parser.add_argument("--max-error-ratio", type=float, default=0.005, help="every endpoint's error limit")
    parser.add_argument("--ttft-p95-ms", type=float, default=1000.0, help="time to first token p95 limit")
    parser.add_argument("--min-requests", type=int, default=20, help="requests an endpoint needs to be judged")
    args = parser.parse_args(argv)
    api = Slo(args.p95_ms, args.p99_ms, args.max_error_ratio)
    ttft = Slo(args.ttft_p95_ms, None, args.max_error_ratio)
    return judge(args.stats_csv, api, ttft, args.min_requests)


if __name__ == "__main__":
    sys.exit(main())

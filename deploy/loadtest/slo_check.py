"""Judge a locust run against the SpecOps SLO: p95 < 300 ms, p99 < 600 ms, errors < 0.5 %.

    python deploy/loadtest/slo_check.py var/loadtest/<run>/locust_stats.csv [--p95-ms 300] ...

Reads the ``Aggregated`` row of locust's ``--csv`` stats (all requests of the run), prints one
line per endpoint, the most frequent failures and a verdict. Exit status: 0 the SLO held, 1 it
was broken (also when fewer than ``--min-requests`` were made but they failed), 2 the run cannot
be judged (no file, or too few requests). Standard library only: it runs without locust.
"""
from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

SLO_HELD, SLO_BROKEN, UNJUDGEABLE = 0, 1, 2


@dataclass(frozen=True)
class EndpointStats:
    name: str
    requests: int
    failures: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None

    @property
    def error_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def _ms(raw: str) -> float | None:
    return None if raw in ("", "N/A") else float(raw)


def read_stats(path: Path) -> tuple[list[EndpointStats], EndpointStats | None]:
    """Return (per-endpoint rows, the Aggregated row or None) from a locust ``_stats.csv``."""
    rows, aggregated = [], None
    with path.open(newline="") as handle:
        for raw in csv.DictReader(handle):
            stats = EndpointStats(
                name=f"{raw['Type']} {raw['Name']}".strip(), requests=int(raw["Request Count"]),
                failures=int(raw["Failure Count"]), p50_ms=_ms(raw["50%"]), p95_ms=_ms(raw["95%"]),
                p99_ms=_ms(raw["99%"]),
            )
            if raw["Name"] == "Aggregated":
                aggregated = stats
            else:
                rows.append(stats)
    return rows, aggregated


def print_top_failures(stats_csv: Path, limit: int = 5) -> None:
    """The most frequent failures, from the ``_failures.csv`` locust writes beside the stats."""
    failures_csv = stats_csv.with_name(stats_csv.name.replace("_stats.csv", "_failures.csv"))
    if failures_csv == stats_csv or not failures_csv.is_file():
        return
    with failures_csv.open(newline="") as handle:
        rows = sorted(csv.DictReader(handle), key=lambda row: -int(row["Occurrences"]))
    for row in rows[:limit]:
        print(f"  {row['Occurrences']:>6} x {row['Method']} {row['Name']}: {row['Error'][:160]}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def judge(stats_csv: Path, p95_ms: float, p99_ms: float, max_error_ratio: float, min_requests: int) -> int:
    if not stats_csv.is_file():
        print(f"slo: no stats file {stats_csv} (did locust run?)", file=sys.stderr)
        return UNJUDGEABLE
    try:
        rows, total = read_stats(stats_csv)
    except (KeyError, ValueError) as exc:
        print(f"slo: {stats_csv} is not a locust stats CSV: {exc}", file=sys.stderr)
        return UNJUDGEABLE
    print(f"{'endpoint':<52} {'requests':>8} {'errors':>7} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7}")
    for row in rows + ([total] if total else []):
        print(f"{row.name:<52} {row.requests:>8} {row.error_ratio:>7.2%} {_fmt(row.p50_ms):>7} "
              f"{_fmt(row.p95_ms):>7} {_fmt(row.p99_ms):>7}")
    if total is not None and total.failures:
        print("failures:")
        print_top_failures(stats_csv)
    if total is None or total.requests < min_requests:
        count = 0 if total is None else total.requests
        if total is not None and total.failures and total.error_ratio >= max_error_ratio:
            # Too few to judge latency, but a run that mostly fails (server down, bad token) is broken.
            print(f"slo: BROKEN: errors {total.error_ratio:.3%} of only {count} requests")
            return SLO_BROKEN
        print(f"slo: cannot judge: {count} requests, at least {min_requests} needed", file=sys.stderr)
        return UNJUDGEABLE
    checks = [
        ("p95", total.p95_ms, p95_ms, f"{_fmt(total.p95_ms)} ms", f"< {p95_ms:g} ms"),
        ("p99", total.p99_ms, p99_ms, f"{_fmt(total.p99_ms)} ms", f"< {p99_ms:g} ms"),
        ("errors", total.error_ratio, max_error_ratio, f"{total.error_ratio:.3%}", f"< {max_error_ratio:.2%}"),
    ]
    broken = [name for name, value, limit, _, _ in checks if value is None or value >= limit]
    summary = ", ".join(f"{name} {shown} ({'FAIL' if name in broken else 'ok'}, SLO {rule})"
                        for name, _, _, shown, rule in checks)
    print(f"slo: {'BROKEN' if broken else 'held'}: {summary}; {total.requests} requests")
    return SLO_BROKEN if broken else SLO_HELD


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stats_csv", type=Path, help="locust --csv PREFIX writes PREFIX_stats.csv")
    parser.add_argument("--p95-ms", type=float, default=300.0)
    parser.add_argument("--p99-ms", type=float, default=600.0)
    parser.add_argument("--max-error-ratio", type=float, default=0.005)
    parser.add_argument("--min-requests", type=int, default=20)
    args = parser.parse_args(argv)
    return judge(args.stats_csv, args.p95_ms, args.p99_ms, args.max_error_ratio, args.min_requests)


if __name__ == "__main__":
    sys.exit(main())

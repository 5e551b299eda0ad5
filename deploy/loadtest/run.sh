#!/usr/bin/env bash
# Headless, bounded SpecOps load test (locust), judged against the SLO on every endpoint on its own
# (p95 < 300 ms, p99 < 600 ms, errors < 0.5 %) and on the time to first token (p95 < 1000 ms,
# from the POST to the stream's first tokens event). Exit status: 0 the SLO held on every judged
# endpoint, 1 it was broken on one, 2 the run could not be judged or an argument is wrong.
#
#   deploy/loadtest/run.sh [options] [USER_CLASS ...]
#
# Each simulated user calls with a token of its own, of a tenant of its own: the run creates them
# (manage.py loadtest_tenants, tenants loadtest-1..N) and removes its users and tokens at the end,
# so it measures the platform, not the per-token throttle. It needs this checkout's database
# (the one `make run` uses); against another deployment give the tokens instead.
#
#   -H, --host URL          target (default $SPECOPS_LOAD_HOST or http://127.0.0.1:8000); only
#                           loopback hosts unless SPECOPS_LOAD_ALLOW_REMOTE=1
#   -u, --users N           concurrent users (default 20)
#   -r, --spawn-rate N      users started per second (default 5)
#   -t, --run-time T        duration, e.g. 60s, 5m, 1m30s (default 60s, at most 1h)
#   -n, --max-requests N    stop after N requests even if time is left (default 20000)
#   -o, --out DIR           CSV and log folder (default var/loadtest/<UTC timestamp>)
#       --p95-ms / --p99-ms / --max-error-ratio   SLO per API endpoint (300 / 600 / 0.005)
#       --ttft-p95-ms MS    time to first token SLO (p95, default 1000)
#       --dry-run           print the locust command and exit
#       --shared-token      every user calls with $SPECOPS_TOKEN (one token: the throttles apply to all)
#   USER_CLASS              GenerationUser and/or BurstReader (default: both)
#   SPECOPS_LOAD_TOKENS_FILE=<file>   use these tokens (one a line, shared out in turn) instead
#
# GenerationUser needs a running worker for the model's queue, else every generation times out.
# It opens at most SPECOPS_LOAD_MAX_STREAMS streams at once (default 2: under gunicorn's gthread
# each holds a server thread) for SPECOPS_LOAD_STREAM_SHARE of its generations (default 1).
set -euo pipefail
cd "$(dirname "$0")/../.."

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "loadtest: $*" >&2; exit 2; }

HOST=${SPECOPS_LOAD_HOST:-http://127.0.0.1:8000}
USERS=20 RATE=5 RUN_TIME=60s MAX_REQUESTS=20000 OUT="" DRY_RUN=0
P95_MS=300 P99_MS=600 MAX_ERROR_RATIO=0.005 TTFT_P95_MS=1000 SHARED_TOKEN=0
CLASSES=()
LOCUST=${LOCUST:-.venv/bin/locust}
PY=${PYTHON:-.venv/bin/python}

need_value() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
  case $1 in
    -H|--host) need_value "$@"; HOST=$2; shift 2 ;;
    -u|--users) need_value "$@"; USERS=$2; shift 2 ;;
    -r|--spawn-rate) need_value "$@"; RATE=$2; shift 2 ;;
    -t|--run-time) need_value "$@"; RUN_TIME=$2; shift 2 ;;
    -n|--max-requests) need_value "$@"; MAX_REQUESTS=$2; shift 2 ;;
    -o|--out) need_value "$@"; OUT=$2; shift 2 ;;
    --p95-ms) need_value "$@"; P95_MS=$2; shift 2 ;;
    --p99-ms) need_value "$@"; P99_MS=$2; shift 2 ;;
    --max-error-ratio) need_value "$@"; MAX_ERROR_RATIO=$2; shift 2 ;;
    --ttft-p95-ms) need_value "$@"; TTFT_P95_MS=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --shared-token) SHARED_TOKEN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    GenerationUser|BurstReader) CLASSES+=("$1"); shift ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) die "unknown user class $1: use GenerationUser and/or BurstReader" ;;
  esac
done

positive_int() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"; }
positive_num() { [[ $2 =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ ]] && [[ ! $2 =~ ^0*\.?0*$ ]] ||
  die "$1 must be a number greater than 0, got '$2'"; }
positive_int --users "$USERS"
positive_num --spawn-rate "$RATE"
positive_int --max-requests "$MAX_REQUESTS"
positive_num --p95-ms "$P95_MS"
positive_num --p99-ms "$P99_MS"
positive_num --max-error-ratio "$MAX_ERROR_RATIO"
positive_num --ttft-p95-ms "$TTFT_P95_MS"

# Run time → seconds (locust's own syntax: 90, 90s, 5m, 1h30m), bounded to one hour.
[[ $RUN_TIME =~ ^[0-9]+$ ]] && RUN_TIME=${RUN_TIME}s
[[ $RUN_TIME =~ ^([0-9]+h)?([0-9]+m)?([0-9]+s)?$ && -n $RUN_TIME ]] ||
  die "--run-time must look like 60s, 5m or 1m30s, got '$RUN_TIME'"
seconds=0 rest=$RUN_TIME
while [[ $rest =~ ^([0-9]+)([hms])(.*)$ ]]; do
  n=$((10#${BASH_REMATCH[1]}))
  case ${BASH_REMATCH[2]} in h) seconds=$((seconds + n * 3600)) ;; m) seconds=$((seconds + n * 60)) ;; s) seconds=$((seconds + n)) ;; esac
  rest=${BASH_REMATCH[3]}
done
((seconds >= 1 && seconds <= 3600)) || die "--run-time must be from 1s to 1h, got '$RUN_TIME'"

# Loopback only, unless the operator says otherwise: a load test must not hit a shared system by accident.
[[ $HOST =~ ^https?://([^/:]+|\[[^]]+\])(:[0-9]+)?/?$ ]] || die "--host must be http(s)://HOST[:PORT], got '$HOST'"
host_name=${BASH_REMATCH[1]}
if [[ ! $host_name =~ ^(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\])$ && ${SPECOPS_LOAD_ALLOW_REMOTE:-0} != 1 ]]; then
  die "refusing to load-test $host_name: not a loopback address (set SPECOPS_LOAD_ALLOW_REMOTE=1 to allow)"
fi

OUT=${OUT:-var/loadtest/$(date -u +%Y%m%dT%H%M%SZ)}
cmd=("$LOCUST" -f deploy/loadtest/locustfile.py --headless --host "$HOST" -u "$USERS" -r "$RATE"
     -t "$RUN_TIME" --stop-timeout 5 --csv "$OUT/locust" --only-summary --exit-code-on-error 0
     ${CLASSES[@]+"${CLASSES[@]}"})
if ((DRY_RUN)); then
  printf '%q ' "SPECOPS_LOAD_MAX_REQUESTS=$MAX_REQUESTS" "${cmd[@]}"; echo
  exit 0
fi

if ((SHARED_TOKEN)); then
  [[ -n ${SPECOPS_TOKEN:-} ]] || die "SPECOPS_TOKEN is not set (create one: .venv/bin/python manage.py drf_create_token api)"
elif [[ -n ${SPECOPS_LOAD_TOKENS_FILE:-} ]]; then
  [[ -s $SPECOPS_LOAD_TOKENS_FILE ]] || die "SPECOPS_LOAD_TOKENS_FILE: $SPECOPS_LOAD_TOKENS_FILE is missing or empty"
elif [[ ! $host_name =~ ^(127\.[0-9]+\.[0-9]+\.[0-9]+|localhost|\[::1\])$ ]]; then
  die "a remote host's tenants are not this checkout's: give SPECOPS_LOAD_TOKENS_FILE or --shared-token"
fi
[[ -x $LOCUST ]] || die "$LOCUST not found (pip install -r requirements.txt into .venv)"
mkdir -p "$OUT"

# One tenant and token per user, removed (users and tokens) however the run ends.
if ((!SHARED_TOKEN)) && [[ -z ${SPECOPS_LOAD_TOKENS_FILE:-} ]]; then
  RUN_ID=$(basename "$OUT" | tr -c 'A-Za-z0-9_.\n-' '-')
  export SPECOPS_LOAD_TOKENS_FILE=$OUT/tokens
  remove_tenants() { "$PY" manage.py loadtest_tenants remove --run "$RUN_ID" || true; rm -f "$SPECOPS_LOAD_TOKENS_FILE"; }
  trap remove_tenants EXIT
  "$PY" manage.py loadtest_tenants create --run "$RUN_ID" --count "$USERS" --out "$SPECOPS_LOAD_TOKENS_FILE" ||
    die "could not create the load test's tenants (manage.py loadtest_tenants; is this the checkout of the target?)"
fi
echo "loadtest: $USERS users (+$RATE/s) for $RUN_TIME or $MAX_REQUESTS requests against $HOST; output in $OUT"

# timeout: the run stops by itself even if locust hangs (its own --run-time + stop timeout + slack).
set +e
SPECOPS_LOAD_MAX_REQUESTS=$MAX_REQUESTS timeout --kill-after=15 $((seconds + 60)) "${cmd[@]}" >"$OUT/locust.log" 2>&1
rc=$?
set -e
grep -E '^generations:' "$OUT/locust.log" || true
if ((rc != 0)); then
  tail -n 20 "$OUT/locust.log" >&2
  die "locust exited with status $rc (log: $OUT/locust.log)"
fi
"$PY" deploy/loadtest/slo_check.py "$OUT/locust_stats.csv" \
  --p95-ms "$P95_MS" --p99-ms "$P99_MS" --max-error-ratio "$MAX_ERROR_RATIO" --ttft-p95-ms "$TTFT_P95_MS"

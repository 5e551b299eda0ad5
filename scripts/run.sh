#!/usr/bin/env bash
# Start SpecOps locally: static files, migrate, first operator, then web + workers + beat, while the demo models
# build in the background: a quick pair serves first, the full pair replaces it when trained
# (progress here and on the admin dashboard). Ctrl-C stops all of them and exits 0 (the build
# resumes next time). Called by `make run` after install and services.
set -euo pipefail
# Bash cannot trap a signal that was ignored when it started, as SIGINT is for a command started
# in the background (`make run &` in a script or CI): Ctrl-C or `kill -INT` would then reach only
# the Python children, which stop, and this script would take that for a crash. Start again with
# INT and TERM at their defaults, so the traps below always hold.
if [[ -z ${SPECOPS_RUN_SIGNALS:-} ]]; then
  SPECOPS_RUN_SIGNALS=default exec env --default-signal=INT,TERM "$0" "$@"
fi
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
HOST=${SPECOPS_HOST:-127.0.0.1}
PORT=${SPECOPS_PORT:-8000}
mkdir -p var/log
# DEBUG stays off unless you set it. The SECRET_KEY is made once, into var/secret_key, which
# settings read whenever SECRET_KEY is not set (manage.py commands of this checkout included).
if [[ -z ${SECRET_KEY:-} && ! -s var/secret_key ]]; then
  (umask 077 && $PY -c "import secrets; print(secrets.token_urlsafe(50))" >var/secret_key)
  echo "created var/secret_key (the SECRET_KEY of this checkout; keep it private)"
fi
# /metrics answers a bearer token only (core/metrics_view.py): made once too, into var/metrics_token.
if [[ -z ${SPECOPS_METRICS_TOKEN:-} ]]; then
  [[ -s var/metrics_token ]] || (umask 077 && $PY -c "import secrets; print(secrets.token_urlsafe(32))" >var/metrics_token)
  SPECOPS_METRICS_TOKEN=$(<var/metrics_token)
  export SPECOPS_METRICS_TOKEN
fi
export PROMETHEUS_MULTIPROC_DIR=${PROMETHEUS_MULTIPROC_DIR:-$PWD/var/prometheus}
rm -rf "$PROMETHEUS_MULTIPROC_DIR" && mkdir -p "$PROMETHEUS_MULTIPROC_DIR"

pids=()          # the platform: any of them exiting stops everything
declare -A names  # pid -> the name its log has
build=()         # the demo build: it ends on its own when the full pair is in
stop() {  # TERM to everything started here, then wait for all of it
  trap - INT TERM EXIT
  kill -TERM "${pids[@]}" "${build[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  # What they started and left behind (a web's workers, when its master was killed): the rest of
  # this script's process group, when the group is its own (a terminal's `make run`, a test).
  if [[ $(ps -o pgid= -p $$ | tr -d ' ') == "$$" ]]; then
    trap '' TERM
    kill -TERM 0 2>/dev/null || true
    trap - TERM
  fi
}
stopped() {  # Ctrl-C (SIGINT to the whole process group) or SIGTERM: an ordinary end
  local building=""
  kill -0 "${build[@]}" 2>/dev/null && building="; the demo build resumes at the next make run"
  stop
  [[ -t 1 ]] && echo  # past the terminal's ^C
  echo "SpecOps stopped: web, workers and beat$building."
  exit 0
}
trap stopped INT TERM
trap stop EXIT

start() {  # start NAME CMD...: run in the background, log to var/log/NAME.log
  local name=$1; shift
  "$@" >"var/log/$name.log" 2>&1 &
  pids+=($!)
  names[$!]=$name
  echo "started $name (pid $!, log var/log/$name.log)"
}
died() {  # died PID STATUS: a platform process ended without being told to; stop the rest
  echo "SpecOps: ${names[$1]:-a process} (pid $1) exited on its own with status $2; stopping the others" \
       "(its log: var/log/${names[$1]:-}.log)" >&2
  exit 1
}

# One process collects the static files (then writes var/static-collected), migrates, creates the
# first operator (its credentials are printed once) and schedules the partition jobs, then writes
# var/prepared and goes on in the background with the demo models: the quick pair (demo:quick-N),
# built in well under a minute and promoted when nothing else serves, then the full pair
# (demo:seedN), trained at a lower priority and promoted over it. OMP_WAIT_POLICY=PASSIVE: torch's
# threads sleep instead of spinning while they wait for each other, which on a busy machine made
# two threads slower than one (measured: a training step 14 s spinning, 8 s passive; about the
# same when idle). Progress lines come here; errors and tqdm bars go to var/log/demo-build.log.
rm -f var/static-collected var/prepared var/serving
OMP_WAIT_POLICY=PASSIVE $PY manage.py prepare_run --static-file var/static-collected --ready-file var/prepared \
  --then-build-demo-models --serving-file var/serving 2>var/log/demo-build.log &
build+=($!)
preparing() {  # wait until FILE exists; the preparing process must live and the platform with it
  until [[ -e $1 ]]; do
    if ! kill -0 "${build[0]}" 2>/dev/null; then
      echo "preparing the database failed (collectstatic, migrate, create_operator or partitions schedule):" >&2
      tail -n 5 var/log/demo-build.log >&2
      exit 1
    fi
    alive
    sleep 0.2
  done
}
alive() {  # exit 1 when a platform process has died
  local pid status
  for pid in "${pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      status=0; wait "$pid" || status=$?
      died "$pid" "$status"
    fi
  done
}
# Counting GPUs imports torch: only on a host with NVIDIA devices.
gpus=0
if compgen -G "/dev/nvidia[0-9]*" >/dev/null; then
  gpus=$($PY -c "from specops.celery import visible_gpu_count; print(visible_gpu_count())")
fi

# One worker per device, one batching loop in it: each thread of the pool hands it a session, and
# the loop feeds the device's engine core, a child process the worker starts that holds the models
# and only steps (inference/engine_core/; SPECOPS_ENGINE_CORE=thread keeps it in the worker).
# One torch thread (OMP_NUM_THREADS, unless set): the web, PostgreSQL and Redis share these cores
# with the worker, and a second torch thread, spinning or sleeping between ops, made the API slower
# (measured: bench/README.md, Serving).
omp=${OMP_NUM_THREADS:-1}
# Task threads: each holds one session, so twice the batch's rows keeps sessions waiting for a row
# (they join the batch together, and a quiet tenant's can preempt) and a quarter of the threads
# free for tenants under their share (inference/worker/claim_share.py).
threads=${SPECOPS_WORKER_THREADS:-$((2 * ${SPECOPS_MAX_BATCH:-8}))}
OMP_NUM_THREADS=$omp SPECOPS_WORKER_DEVICE=cpu start worker-cpu .venv/bin/celery -A specops worker -Q cpu --pool threads \
  --concurrency "$threads" --prefetch-multiplier 1 -n cpu@%h -l INFO
for ((i = 0; i < gpus; i++)); do
  OMP_NUM_THREADS=$omp SPECOPS_WORKER_DEVICE=cuda:$i start "worker-gpu$i" .venv/bin/celery -A specops worker -Q "gpu.$i" --pool threads \
    --concurrency "$threads" --prefetch-multiplier 1 -n "gpu$i@%h" -l INFO
done

# The web starts once the static files are collected (the first thing prepare_run does): WhiteNoise
# indexes STATIC_ROOT when a web process starts, and a web started before them serves the admin
# unstyled until it is restarted. Its imports then take most of a minute, while the database migrates
# and the quick pair builds; it touches no table until a request comes.
# ASGI (uvicorn workers): an open SSE stream holds no thread, so streams cannot stall the API.
# Keep-alive 75 s, not gunicorn's 2 s: a client that pauses a little over 2 s between calls (the
# load test's users wait 0.5-2 s plus a stream) raced the server's close of its idle connection
# and got a connection reset on its next POST (1-3 in ~230 in the load test).
preparing var/static-collected
start web .venv/bin/gunicorn specops.asgi:application -c specops/gunicorn_conf.py --bind "$HOST:$PORT" \
  --workers "${WEB_WORKERS:-2}" --keep-alive "${WEB_KEEPALIVE_S:-75}"
preparing var/prepared
echo "database ready; the demo models build on (pid ${build[0]}, log var/log/demo-build.log)"
cat <<TXT

SpecOps is running ($gpus GPU queue(s) + cpu + maintenance):
  API       http://$HOST:$PORT/api/v1/        (docs: http://$HOST:$PORT/api/docs/ once logged in to the admin)
  OpenAI    http://$HOST:$PORT/v1/            (model "demo")
  Admin     http://$HOST:$PORT/admin/          (the operator's login: printed above on first run)
  Metrics   http://$HOST:$PORT/metrics        (curl -H "Authorization: Bearer \$(cat var/metrics_token)" ...)
  API token: printed above on first run (tenant user "api", no admin rights; again:
             $PY manage.py drf_create_token api)
Model "demo": the quick pair answers as soon as "demo build demo:quick-0 done" shows below; the
full pair trains in the background ("demo build demo:seed0 ..." lines, the admin dashboard) and
replaces it when done.
Ctrl-C stops everything.
TXT
# Maintenance and beat are background work (they need the migrated tables): they start once a demo
# pair serves (or after 2 minutes), at a lower priority, so as not to slow a small machine's first
# minute.
for ((waited = 0; waited < 600; waited++)); do
  [[ -e var/serving ]] && break
  alive
  sleep 0.2
done
start worker-maintenance nice -n 10 .venv/bin/celery -A specops worker -Q maintenance -n maintenance@%h \
  --concurrency 1 -l INFO
start beat nice -n 10 .venv/bin/celery -A specops beat -l INFO \
  --scheduler django_celery_beat.schedulers:DatabaseScheduler --pidfile var/celerybeat.pid
status=0
wait -n -p exited "${pids[@]}" || status=$?
died "$exited" "$status"

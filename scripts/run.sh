#!/usr/bin/env bash
# Start SpecOps locally: migrate, first operator, demo models, then web + workers + beat.
# Ctrl-C stops all of them. Called by `make run` after install and services.
set -euo pipefail
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
export PROMETHEUS_MULTIPROC_DIR=${PROMETHEUS_MULTIPROC_DIR:-$PWD/var/prometheus}
rm -rf "$PROMETHEUS_MULTIPROC_DIR" && mkdir -p "$PROMETHEUS_MULTIPROC_DIR"

$PY manage.py migrate --no-input -v0
$PY manage.py collectstatic --no-input -v0
$PY manage.py create_operator
$PY manage.py build_demo_models
$PY manage.py partitions schedule

pids=()
stop() {
  trap - INT TERM EXIT
  echo; echo "stopping SpecOps..."
  kill -TERM "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

start() {  # start NAME CMD...: run in the background, log to var/log/NAME.log
  local name=$1; shift
  "$@" >"var/log/$name.log" 2>&1 &
  pids+=($!)
  echo "started $name (pid $!, log var/log/$name.log)"
}

# ASGI (uvicorn workers): an open SSE stream holds no thread, so streams cannot stall the API.
start web .venv/bin/gunicorn specops.asgi:application -c specops/gunicorn_conf.py --bind "$HOST:$PORT" \
  --workers "${WEB_WORKERS:-2}"
gpus=$($PY -c "from specops.celery import visible_gpu_count; print(visible_gpu_count())")
# One process per device, one batching loop in it: each thread of the pool hands it a session.
SPECOPS_WORKER_DEVICE=cpu start worker-cpu .venv/bin/celery -A specops worker -Q cpu --pool threads \
  --concurrency "${SPECOPS_MAX_BATCH:-8}" --prefetch-multiplier 1 -n cpu@%h -l INFO
for ((i = 0; i < gpus; i++)); do
  SPECOPS_WORKER_DEVICE=cuda:$i start "worker-gpu$i" .venv/bin/celery -A specops worker -Q "gpu.$i" --pool threads \
    --concurrency "${SPECOPS_MAX_BATCH:-8}" --prefetch-multiplier 1 -n "gpu$i@%h" -l INFO
done
start worker-maintenance .venv/bin/celery -A specops worker -Q maintenance -n maintenance@%h --concurrency 1 -l INFO
start beat .venv/bin/celery -A specops beat -l INFO --scheduler django_celery_beat.schedulers:DatabaseScheduler \
  --pidfile var/celerybeat.pid

cat <<TXT

SpecOps is running ($gpus GPU queue(s) + cpu + maintenance):
  API       http://$HOST:$PORT/api/v1/        (docs: http://$HOST:$PORT/api/docs/)
  Admin     http://$HOST:$PORT/admin/          (operator credentials: printed above on first run)
  Metrics   http://$HOST:$PORT/metrics
  API token: $PY manage.py drf_create_token operator
Ctrl-C stops everything.
TXT
wait -n "${pids[@]}" || true
echo "a SpecOps process exited on its own; stopping the others (see var/log/)" >&2
exit 1

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

start web .venv/bin/gunicorn specops.wsgi:application -c specops/gunicorn_conf.py --bind "$HOST:$PORT" \
  --workers "${WEB_WORKERS:-2}" --threads "${WEB_THREADS:-4}" --worker-class gthread --timeout 120
gpus=$($PY -c "from specops.celery import visible_gpu_count; print(visible_gpu_count())")
SPECOPS_WORKER_DEVICE=cpu start worker-cpu .venv/bin/celery -A specops worker -Q cpu -n cpu@%h \
  --pool prefork --concurrency 1 -l INFO
for ((i = 0; i < gpus; i++)); do
  SPECOPS_WORKER_DEVICE=cuda:$i start "worker-gpu$i" .venv/bin/celery -A specops \
    worker -Q "gpu.$i" -n "gpu$i@%h" --pool prefork --concurrency 1 -l INFO
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

#!/usr/bin/env bash
# SpecOps local services: PostgreSQL primary + streaming replica, Redis, RabbitMQ.
#   scripts/services.sh [up|status]     (default: up; idempotent, safe to run twice)
# "up" starts or repairs what is missing and prints one line per service; on failure it prints
# one line "services: <service> could not be started: <reason>" to stderr and exits 1.
# "status" changes nothing; it exits 1 if any service is not healthy. Needs root (pg_createcluster).
set -Eeuo pipefail

MODE=${1:-up}
PGV=${SPECOPS_PG_VERSION:-15}
PG_HOST=${SPECOPS_PG_HOST:-127.0.0.1}
PG_PORT=${SPECOPS_PG_PORT:-5432}
PG_CLUSTER=${SPECOPS_PG_CLUSTER:-main}
REPLICA=${SPECOPS_REPLICA_CLUSTER:-replica}
REPLICA_PORT=${SPECOPS_REPLICA_PORT:-5433}
DB_NAME=${SPECOPS_DB_NAME:-specops}
REDIS_HOST=${SPECOPS_REDIS_HOST:-127.0.0.1}
REDIS_PORT=${SPECOPS_REDIS_PORT:-6379}
RABBIT_HOST=${SPECOPS_RABBITMQ_HOST:-127.0.0.1}
RABBIT_PORT=${SPECOPS_RABBITMQ_PORT:-5672}
STREAM_GRACE=${SPECOPS_REPLICA_GRACE_S:-15}   # seconds a started replica gets to stream
REPLAY_WAIT=${SPECOPS_REPLAY_WAIT_S:-20}      # seconds to wait for a probe write to replay
R_ETC=/etc/postgresql/$PGV/$REPLICA

SERVICE=services REASON="" FAILED_AT="" DIED=""
die() { echo "services: $SERVICE could not be started: $*" >&2; DIED=1; exit 1; }
# Any other failure still ends with one line naming the service.
trap 'FAILED_AT="line $LINENO: $BASH_COMMAND"' ERR
# shellcheck disable=SC2154
trap 'rc=$?; ((rc == 0)) || [[ -n $DIED || $MODE != up ]] ||
  echo "services: $SERVICE could not be started: unexpected failure at ${FAILED_AT:-?} (exit $rc)" >&2' EXIT
say() { echo "$*"; }
lastline() { grep -v '^\s*$' <<<"$1" | tail -n 1; }
wait_for() { # wait_for SECONDS cmd...: retry cmd every 0.5 s
  local end=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do ((SECONDS < end)) || return 1; sleep 0.5; done
}
q()  { # q SQL...: each SQL runs as its own transaction on the primary
  local a=() s; for s; do a+=(-c "$s"); done
  psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -XAtq -v ON_ERROR_STOP=1 "${a[@]}"
}
qr() { psql -h "$PG_HOST" -p "$REPLICA_PORT" -U postgres -d postgres -XAtq -v ON_ERROR_STOP=1 -c "$1"; }
pg_ready() { pg_isready -q -h "$PG_HOST" -p "$1"; }
cluster_status() { pg_lsclusters -h "$PGV" "$1" 2>/dev/null | awk '{print $4}'; }  # online, down,recovery, ...
is_online() { [[ $(cluster_status "$1") == online* ]]; }
start_error() { # start_error CLUSTER OUTPUT: the server log's last errors, else pg_ctl's last line
  local why
  why=$(tail -n 15 "/var/log/postgresql/postgresql-$PGV-$1.log" 2>/dev/null | grep -E 'FATAL|PANIC|could not bind' |
    sed -E 's/^.*(LOG|FATAL|PANIC): +//' | tail -n 2 | paste -sd ';' | sed 's/;/; /g') || true
  echo "${why:-$(lastline "$2")}"
}
ctl() { pg_ctlcluster --skip-systemctl-redirect "$PGV" "$@" 9>&-; }  # servers must not inherit the lock
tcp_open() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }
redis_ping() { [[ $(redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]]; }

# ---------------------------------------------------------------- PostgreSQL primary
primary_up() {
  SERVICE="postgres primary"
  local did=running notes="" out
  if ! pg_ready "$PG_PORT"; then
    if ! is_online "$PG_CLUSTER"; then
      out=$(ctl "$PG_CLUSTER" start 2>&1) || die "$(start_error "$PG_CLUSTER" "$out")"
      did=started
    fi
    wait_for 60 pg_ready "$PG_PORT" || die "no connections accepted on $PG_HOST:$PG_PORT after 60 s"
  fi
  # Physical replication from localhost: prepend the rules (first match wins) only if absent.
  local hba line changed=""
  hba=$(q "show hba_file")
  for line in "host replication all 127.0.0.1/32 trust" "local replication all trust"; do
    if ! grep -Eq "^\s*${line// /\\s+}\s*(#.*)?$" "$hba"; then
      sed -i "1i $line  # added by specops scripts/services.sh" "$hba"; changed=1
    fi
  done
  if [[ -n $changed ]]; then q "select pg_reload_conf()" >/dev/null; notes+=", replication rules added to pg_hba.conf"; fi
  local level senders need=""
  level=$(q "show wal_level"); senders=$(q "show max_wal_senders")
  if [[ $level == minimal ]]; then q "alter system set wal_level = replica"; need=1; fi
  if ((senders < 4)); then q "alter system set max_wal_senders = 10"; need=1; fi
  if [[ -n $need ]]; then
    [[ $did == started ]] || die "wal_level=$level max_wal_senders=$senders: set by ALTER SYSTEM, but a restart is needed (pg_ctlcluster $PGV $PG_CLUSTER restart), not done on a running primary"
    out=$(ctl "$PG_CLUSTER" restart 2>&1) || die "$(lastline "$out")"
    wait_for 60 pg_ready "$PG_PORT" || die "not back after restart for wal settings"
    notes+=", restarted for wal_level/max_wal_senders"
  fi
  if [[ -z $(q "select 1 from pg_database where datname = '$DB_NAME'") ]]; then
    out=$(createdb -h "$PG_HOST" -p "$PG_PORT" -U postgres "$DB_NAME" 2>&1) || die "createdb $DB_NAME: $(lastline "$out")"
    notes+=", database $DB_NAME created"
  else
    notes+=", database $DB_NAME present"
  fi
  say "postgres primary: $did on $PG_HOST:$PG_PORT$notes"
}

# ---------------------------------------------------------------- streaming replica
replica_configure() { # idempotent; restarts a running replica only if its settings changed
  local conf=$R_ETC/conf.d/90-specops.conf want p hba
  # A hot standby refuses to start with these below the primary's values, so copy them.
  want=$(echo "# written by specops scripts/services.sh"
    echo "port = $REPLICA_PORT"; echo "listen_addresses = '$PG_HOST'"; echo "hot_standby = on"
    for p in max_connections max_worker_processes max_wal_senders max_prepared_transactions max_locks_per_transaction; do
      echo "$p = $(q "show $p")"
    done)
  hba=$(printf '%s\n' "local all all trust" "host all all 127.0.0.1/32 trust" "host all all ::1/128 trust" \
    "local replication all trust" "host replication all 127.0.0.1/32 trust")
  if [[ $(cat "$R_ETC/pg_hba.conf") != "$hba" ]]; then
    echo "$hba" >"$R_ETC/pg_hba.conf"; chown postgres:postgres "$R_ETC/pg_hba.conf"
    ! is_online "$REPLICA" || ctl "$REPLICA" reload >/dev/null 2>&1
  fi
  if [[ ! -f $conf || $(cat "$conf") != "$want" ]]; then
    echo "$want" >"$conf"; chown postgres:postgres "$conf"
    pg_conftool "$PGV" "$REPLICA" set port "$REPLICA_PORT"  # postgresql-common reads the port here
    ! is_online "$REPLICA" || ctl "$REPLICA" restart -m fast >/dev/null 2>&1 || true
  fi
}

replica_start() { # returns 1 with REASON set
  local out
  out=$(ctl "$REPLICA" start 2>&1) || { REASON=$(start_error "$REPLICA" "$out"); return 1; }
  wait_for 30 pg_ready "$REPLICA_PORT" || { REASON="no connections on port $REPLICA_PORT after 30 s"; return 1; }
}

replica_build() { # stop, empty the data directory, pg_basebackup -R, configure, start
  local dd out
  if is_online "$REPLICA"; then
    ctl "$REPLICA" stop -m fast >/dev/null 2>&1 || ctl "$REPLICA" stop -m immediate >/dev/null 2>&1 || true
  fi
  dd=$(pg_conftool -s "$PGV" "$REPLICA" show data_directory)
  [[ -n $dd && $dd != / ]] || die "no data_directory in $R_ETC/postgresql.conf"
  find "$dd" -mindepth 1 -delete
  out=$(runuser -u postgres -- pg_basebackup -h "$PG_HOST" -p "$PG_PORT" -U postgres -D "$dd" -R -X stream -c fast 2>&1) ||
    die "pg_basebackup from $PG_HOST:$PG_PORT failed: $(lastline "$out")"
  replica_configure
  replica_start || die "$REASON"
}

replica_healthy() { # in recovery, same system, streaming, and replays a fresh write; else REASON, 1
  local sysid token lsn app
  [[ $(qr "select pg_is_in_recovery()" 2>/dev/null) == t ]] || { REASON="not in recovery (promoted or not a standby)"; return 1; }
  sysid=$(q "select system_identifier from pg_control_system()") || { REASON="primary query failed"; return 1; }
  [[ $(qr "select system_identifier from pg_control_system()") == "$sysid" ]] || { REASON="copied from another primary (system identifier differs)"; return 1; }
  if [[ $(qr "select pg_get_wal_replay_pause_state()") != "not paused" ]]; then
    qr "select pg_wal_replay_resume()" >/dev/null; RESUMED=1
  fi
  app=$(qr "show cluster_name"); app=${app:-walreceiver}
  streaming() {
    [[ $(qr "select status from pg_stat_wal_receiver") == streaming ]] &&
      [[ $(q "select count(*) from pg_stat_replication where application_name = '$app' and state = 'streaming'") -ge 1 ]]
  }
  wait_for "$STREAM_GRACE" streaming || { REASON="not streaming from $PG_HOST:$PG_PORT after ${STREAM_GRACE} s"; return 1; }
  # A committed write on the primary (the LSN is read after its commit), then wait for its replay.
  token="$(date +%s%N)-$$"
  lsn=$(q "set client_min_messages = warning" \
    "create table if not exists specops_replica_probe (id int primary key, token text not null, at timestamptz not null default now())" \
    "insert into specops_replica_probe values (1, '$token') on conflict (id) do update set token = excluded.token, at = now()" \
    "select pg_current_wal_lsn()") || { REASON="probe write on the primary failed"; return 1; }
  replayed() {
    [[ $(qr "select pg_last_wal_replay_lsn() >= '$lsn'::pg_lsn") == t ]] &&
      [[ $(qr "select token from specops_replica_probe where id = 1") == "$token" ]]
  }
  wait_for "$REPLAY_WAIT" replayed || { REASON="primary write at lsn $lsn not replayed within ${REPLAY_WAIT} s"; return 1; }
  REPLAY_LSN=$(qr "select pg_last_wal_replay_lsn()")
}

replica_up() {
  SERVICE=replica
  local did out why
  RESUMED=""
  if [[ ! -f $R_ETC/postgresql.conf ]]; then
    out=$(pg_createcluster "$PGV" "$REPLICA" --port "$REPLICA_PORT" 2>&1) || die "pg_createcluster: $(lastline "$out")"
    replica_build; did="created (basebackup)"
  else
    replica_configure
    if ! is_online "$REPLICA"; then
      if replica_start; then did=started; else why=$REASON; replica_build; did="rebuilt (would not start: $why)"; fi
    else
      did=running
    fi
  fi
  if ! replica_healthy; then
    [[ $did == running || $did == started ]] || die "$REASON"
    why=$REASON; replica_build; did="rebuilt ($why)"
    replica_healthy || die "$REASON"
  fi
  say "replica: $did${RESUMED:+, replay resumed} and streaming on $PG_HOST:$REPLICA_PORT from :$PG_PORT, replay lsn $REPLAY_LSN"
}

# ---------------------------------------------------------------- Redis and RabbitMQ
redis_up() {
  SERVICE=redis
  local out
  if redis_ping; then say "redis: running on $REDIS_HOST:$REDIS_PORT"; return; fi
  out=$(redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log 2>&1 9>&-) || die "$(lastline "$out")"
  wait_for 15 redis_ping || die "no PONG from $REDIS_HOST:$REDIS_PORT after 15 s (see /var/log/redis/ci.log)"
  say "redis: started on $REDIS_HOST:$REDIS_PORT"
}

rabbit_up() {
  SERVICE=rabbitmq
  local out
  if tcp_open "$RABBIT_HOST" "$RABBIT_PORT"; then say "rabbitmq: running on $RABBIT_HOST:$RABBIT_PORT"; return; fi
  if rabbitmq-diagnostics -q ping >/dev/null 2>&1; then  # node up, app stopped
    out=$(rabbitmqctl start_app 2>&1 9>&-) || die "rabbitmqctl start_app: $(lastline "$out")"
  else
    out=$(rabbitmq-server -detached 2>&1 9>&-) || die "$(lastline "$out")"
  fi
  wait_for 60 tcp_open "$RABBIT_HOST" "$RABBIT_PORT" || die "port $RABBIT_HOST:$RABBIT_PORT not open after 60 s"
  say "rabbitmq: started on $RABBIT_HOST:$RABBIT_PORT"
}

# ---------------------------------------------------------------- status (reports only)
status() {
  local bad=0 r
  if pg_ready "$PG_PORT"; then say "postgres primary: running on $PG_HOST:$PG_PORT"; else say "postgres primary: down"; bad=1; fi
  if [[ ! -f $R_ETC/postgresql.conf ]]; then say "replica: absent"; bad=1
  elif ! pg_ready "$REPLICA_PORT"; then say "replica: $(cluster_status "$REPLICA" || true) (not accepting connections on :$REPLICA_PORT)"; bad=1
  else
    r=$(qr "select pg_is_in_recovery(), coalesce((select status from pg_stat_wal_receiver), 'none'),
            replace(pg_get_wal_replay_pause_state(), ' ', '-'), pg_last_wal_replay_lsn()" | tr '|' ' ')
    read -r rec recv pause lsn <<<"$r"
    say "replica: running on :$REPLICA_PORT, in recovery=$rec, receiver=$recv, replay=$pause, replay lsn $lsn"
    [[ $rec == t && $recv == streaming && $pause == not-paused ]] || bad=1
  fi
  if redis_ping; then say "redis: running on $REDIS_HOST:$REDIS_PORT"; else say "redis: down"; bad=1; fi
  if tcp_open "$RABBIT_HOST" "$RABBIT_PORT"; then say "rabbitmq: running on $RABBIT_HOST:$RABBIT_PORT"; else say "rabbitmq: down"; bad=1; fi
  return $bad
}

case $MODE in
  up)
    exec 9>/tmp/specops-services.lock
    SERVICE=lock; flock -w 300 9 || die "another scripts/services.sh holds /tmp/specops-services.lock"
    primary_up; replica_up; redis_up; rabbit_up ;;
  status) status ;;
  *) echo "usage: $0 [up|status]" >&2; exit 2 ;;
esac

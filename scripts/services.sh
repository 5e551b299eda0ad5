#!/usr/bin/env bash
# SpecOps local services: PostgreSQL primary + streaming replica, PgBouncer, Redis, RabbitMQ.
#   scripts/services.sh [up|status]     (default: up; idempotent, safe to run twice)
# The primary and the replica load pg_stat_statements (one restart when it is first enabled; the
# extension is created in the app database and in template1, so test databases have it too);
# PgBouncer pools in transaction mode on its own port in front of the primary.
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
# The database DATABASE_URL names (postgres://.../NAME?...), else specops: `make run` with a URL of
# one's own finds its database made.
url_db=${DATABASE_URL:-}; url_db=${url_db%%\?*}; url_db=${url_db##*/}
DB_NAME=${SPECOPS_DB_NAME:-${url_db:-specops}}
REDIS_HOST=${SPECOPS_REDIS_HOST:-127.0.0.1}
REDIS_PORT=${SPECOPS_REDIS_PORT:-6379}
RABBIT_HOST=${SPECOPS_RABBITMQ_HOST:-127.0.0.1}
RABBIT_PORT=${SPECOPS_RABBITMQ_PORT:-5672}
PGB_PORT=${SPECOPS_PGBOUNCER_PORT:-6432}
PGB_DIR=${SPECOPS_PGBOUNCER_DIR:-/etc/pgbouncer}
PGB_INI=$PGB_DIR/specops.ini
PGB_USERS=$PGB_DIR/specops-userlist.txt
PGB_LOG=/var/log/postgresql/pgbouncer-specops-$PGB_PORT.log
PGB_PID=/run/postgresql/pgbouncer-specops-$PGB_PORT.pid
STREAM_GRACE=${SPECOPS_REPLICA_GRACE_S:-15}   # seconds a started replica gets to stream
REPLAY_WAIT=${SPECOPS_REPLAY_WAIT_S:-20}      # seconds to wait for a probe write to replay
REPLAY_PATIENCE=${SPECOPS_REPLAY_PATIENCE_S:-300}  # in all, while replay moves on
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
qdb() { psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d "$1" -XAtq -v ON_ERROR_STOP=1 -c "$2"; }  # qdb DB SQL
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
pg_stat_statements_up() { # the library is loaded (primary_up restarted for it): settings, extension
  # Utility statements are off: on 15 each is keyed by its text, and every SAVEPOINT name is new.
  if [[ $(q "show pg_stat_statements.track_utility") != off ]]; then
    q "alter system set pg_stat_statements.track_utility = off" "select pg_reload_conf()" >/dev/null
    notes+=", pg_stat_statements.track_utility set off"
  fi
  # template1 first: databases created later from it (the app's, the tests') have the extension.
  local db created=()
  for db in template1 "$DB_NAME"; do
    [[ $db == template1 || -n $(q "select 1 from pg_database where datname = '$DB_NAME'") ]] || continue
    if [[ -z $(qdb "$db" "select 1 from pg_extension where extname = 'pg_stat_statements'") ]]; then
      out=$(qdb "$db" "create extension if not exists pg_stat_statements" 2>&1) ||
        die "create extension pg_stat_statements in $db: $(lastline "$out")"
      created+=("$db")
    fi
  done
  ((${#created[@]} == 0)) || notes+=", pg_stat_statements created in ${created[*]}"
}

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
  # Settings that only a restart applies: set them all by ALTER SYSTEM, then restart once.
  local level senders libs need=()
  level=$(q "show wal_level"); senders=$(q "show max_wal_senders"); libs=$(q "show shared_preload_libraries")
  if [[ $level == minimal ]]; then q "alter system set wal_level = replica"; need+=(wal_level); fi
  if ((senders < 4)); then q "alter system set max_wal_senders = 10"; need+=(max_wal_senders); fi
  if [[ ",${libs// /}," != *,pg_stat_statements,* ]]; then
    q "alter system set shared_preload_libraries = '${libs:+${libs// /},}pg_stat_statements'"
    need+=(shared_preload_libraries)
  fi
  # Room for every statement of a busy database (the default 5000 evicts while a test suite runs).
  # ALTER SYSTEM refuses pg_stat_statements.max until the library is loaded, so on a machine
  # where it was not, the library's restart comes first and this setting's restart second.
  if [[ ! " ${need[*]} " == *" shared_preload_libraries "* ]] &&
     (($(q "select coalesce(current_setting('pg_stat_statements.max', true), '0')") < 10000)); then
    q "alter system set pg_stat_statements.max = 10000"; need+=(pg_stat_statements.max)
  fi
  if ((${#need[@]})); then
    pg_restart_for "${need[*]}"
    if (($(q "select coalesce(current_setting('pg_stat_statements.max', true), '0')") < 10000)); then
      q "alter system set pg_stat_statements.max = 10000"; pg_restart_for pg_stat_statements.max
    fi
  fi
  pg_stat_statements_up
  if [[ -z $(q "select 1 from pg_database where datname = '$DB_NAME'") ]]; then  # from template1: has the extension
    out=$(createdb -h "$PG_HOST" -p "$PG_PORT" -U postgres "$DB_NAME" 2>&1) || die "createdb $DB_NAME: $(lastline "$out")"
    notes+=", database $DB_NAME created"
  else
    notes+=", database $DB_NAME present"
  fi
  say "postgres primary: $did on $PG_HOST:$PG_PORT$notes"
}

# ---------------------------------------------------------------- streaming replica
pg_restart_for() { # pg_restart_for WHAT: restart the primary for settings only a restart applies
  out=$(ctl "$PG_CLUSTER" restart -m fast 2>&1) || die "restart for $1: $(start_error "$PG_CLUSTER" "$out")"
  wait_for 60 pg_ready "$PG_PORT" || die "not back after the restart for $1"
  notes+=", restarted for $1"
}
replica_configure() { # idempotent; restarts a running replica only if its settings changed
  local conf=$R_ETC/conf.d/90-core.conf want p hba
  # A hot standby refuses to start with these below the primary's values, so copy them.
  want=$(echo "# written by specops scripts/services.sh"
    echo "port = $REPLICA_PORT"; echo "listen_addresses = '$PG_HOST'"; echo "hot_standby = on"
    for p in max_connections max_worker_processes max_wal_senders max_prepared_transactions max_locks_per_transaction; do
      echo "$p = $(q "show $p")"
    done
    # pg_stat_statements on the standby too (the extension itself arrives with the WAL).
    echo "shared_preload_libraries = '$(q "show shared_preload_libraries")'"
    echo "pg_stat_statements.track_utility = $(q "show pg_stat_statements.track_utility")")
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
  # A replica that replays, only behind (a burst of WAL, a busy machine), is waited for, never
  # rebuilt under its readers: each wait that ends with replay further on earns another, up to
  # REPLAY_PATIENCE seconds; a replay that stands still is broken.
  local before after waited=0
  before=$(qr "select pg_last_wal_replay_lsn()" 2>/dev/null) || before=""
  until wait_for "$REPLAY_WAIT" replayed; do
    waited=$((waited + REPLAY_WAIT))
    after=$(qr "select pg_last_wal_replay_lsn()" 2>/dev/null) || after=""
    if [[ -z $after || $after == "$before" ]] || ((waited >= REPLAY_PATIENCE)); then
      REASON="primary write at lsn $lsn not replayed within $waited s (replay at ${after:-?})"; return 1
    fi
    before=$after
  done
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

# ---------------------------------------------------------------- PgBouncer (transaction pooling)
# Bounded: something else on the port (not speaking the protocol) must not hang the script.
pgb_admin() { timeout 10 psql -h "$PG_HOST" -p "$PGB_PORT" -U postgres -d pgbouncer -XAtq -c "$1"; }  # its console
pgb_ready() {
  [[ $(timeout 10 psql -h "$PG_HOST" -p "$PGB_PORT" -U postgres -d postgres -XAtqc "select 1" 2>/dev/null) == 1 ]]
}
pgb_mode() { pgb_admin "show config" 2>/dev/null | awk -F'|' '$1 == "pool_mode" {print $2}'; }

pgbouncer_config() { # the whole ini: every database on the primary, trust auth as on the primary
  cat <<EOF
;; written by specops scripts/services.sh (rewritten whenever it differs)
[databases]
* = host=$PG_HOST port=$PG_PORT

[pgbouncer]
listen_addr = $PG_HOST
listen_port = $PGB_PORT
unix_socket_dir =
auth_type = trust
auth_file = $PGB_USERS
admin_users = postgres
stats_users = postgres
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 20
reserve_pool_size = 5
ignore_startup_parameters = extra_float_digits
logfile = $PGB_LOG
pidfile = $PGB_PID
EOF
}

pgbouncer_up() {
  SERVICE=pgbouncer
  local did=running notes="" out changed="" ini users='"postgres" ""' mode
  if ! command -v pgbouncer >/dev/null && [[ ! -x /usr/sbin/pgbouncer ]]; then
    out=$( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends pgbouncer) 2>&1 9>&-) ||
      die "not installed, and apt-get install pgbouncer failed: $(lastline "$out")"
    notes+=", installed (Debian package)"
  fi
  ini=$(pgbouncer_config)
  mkdir -p "$PGB_DIR" /run/postgresql && chown postgres:postgres /run/postgresql
  if [[ ! -f $PGB_USERS || $(cat "$PGB_USERS") != "$users" ]]; then
    echo "$users" >"$PGB_USERS"; chown postgres:postgres "$PGB_USERS"; chmod 640 "$PGB_USERS"; changed=1
  fi
  if [[ ! -f $PGB_INI || $(cat "$PGB_INI") != "$ini" ]]; then
    echo "$ini" >"$PGB_INI"; chown postgres:postgres "$PGB_INI"; changed=1
  fi
  if tcp_open "$PG_HOST" "$PGB_PORT"; then
    if [[ -n $changed ]]; then
      pgb_admin "reload" >/dev/null 2>&1 || die "port $PGB_PORT is open but its admin console refused RELOAD (not this pgbouncer?)"
      notes+=", configuration reloaded"
    fi
  else
    out=$(runuser -u postgres -- /usr/sbin/pgbouncer -d -q "$PGB_INI" 2>&1 9>&-) ||
      die "$(lastline "$out" | sed -E 's/^[0-9-]+ [0-9:.]+ [A-Z]+ \[[0-9]+\] //')"
    did=started
  fi
  wait_for 15 pgb_ready ||
    die "no query through $PG_HOST:$PGB_PORT to :$PG_PORT after 15 s (another program on the port? see $PGB_LOG)"
  mode=$(pgb_mode)
  [[ $mode == transaction ]] ||
    die "the pgbouncer on port $PGB_PORT pools in '${mode:-unknown}' mode, not transaction (another instance? ours reads $PGB_INI)"
  say "pgbouncer: $did on $PG_HOST:$PGB_PORT, transaction pooling to :$PG_PORT$notes"
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
  if pgb_ready && [[ $(pgb_mode) == transaction ]]; then
    say "pgbouncer: running on $PG_HOST:$PGB_PORT, transaction pooling to :$PG_PORT"
  elif tcp_open "$PG_HOST" "$PGB_PORT"; then say "pgbouncer: port $PGB_PORT open, but no transaction-mode pool answers"; bad=1
  else say "pgbouncer: down"; bad=1; fi
  if pg_ready "$PG_PORT" && [[ ,$(q "show shared_preload_libraries" | tr -d ' '), == *,pg_stat_statements,* ]]; then
    say "pg_stat_statements: loaded on the primary"
  else say "pg_stat_statements: not loaded on the primary"; bad=1; fi
  if redis_ping; then say "redis: running on $REDIS_HOST:$REDIS_PORT"; else say "redis: down"; bad=1; fi
  if tcp_open "$RABBIT_HOST" "$RABBIT_PORT"; then say "rabbitmq: running on $RABBIT_HOST:$RABBIT_PORT"; else say "rabbitmq: down"; bad=1; fi
  return $bad
}

case $MODE in
  up)
    exec 9>/tmp/specops-services.lock
    SERVICE=lock; flock -w 300 9 || die "another scripts/services.sh holds /tmp/specops-services.lock"
    primary_up; replica_up; pgbouncer_up; redis_up; rabbit_up ;;
  status) status ;;
  *) echo "usage: $0 [up|status]" >&2; exit 2 ;;
esac

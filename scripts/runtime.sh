#!/usr/bin/env bash
# Local runtime: private PostgreSQL, Redis and NATS (JetStream) servers plus the service
# executables, for `make run` and `make test`.
#
#   scripts/runtime.sh up       start whatever is not running yet (idempotent), write $RUN_DIR/env
#   scripts/runtime.sh down     stop what `up` started, by pid (services first, then servers)
#   scripts/runtime.sh status   what runs, where
#   scripts/runtime.sh env      print the path of the env file (`source "$(scripts/runtime.sh env)"`)
#   scripts/runtime.sh purge    `down`, then delete every file of this runtime (throw-away runs)
#
# Environment
#   RUN_DIR     folder of the runtime's data, logs, pids and secrets        (default .run)
#   PORT_BASE   ports are PORT_BASE + offset (table below); fixed per RUN_DIR (default 45000)
#   FAST=1      throw-away instance: Postgres runs with fsync, synchronous_commit and
#               full_page_writes off (data may be lost on a machine crash; never for real data)
#   BUILD       build folder whose bin/ holds the executables                (default build)
#   START_SERVICES=0  start the servers only (tests that run their own service processes)
#   WAIT_S      bound on every wait for a server or service to accept connections (default 30)
#
# Ports (PORT_BASE +): Postgres 432, Redis 379, NATS 222, service i gRPC 51+i, metrics 91+i.
#
# Security of this development runtime: every server listens on 127.0.0.1 only.
#   - Postgres authenticates every role with scram-sha-256; passwords are generated once into
#     $RUN_DIR/secrets (0600) and handed to libpq through PGPASSFILE, so DSNs carry no secret.
#     Its unix socket lives in a 0700 folder of the server's OS user.
#   - Redis and NATS run without authentication: loopback-only development servers.
# Tenancy convention: RLS policies key on current_setting('app.org_id', true), which
# libcommon's db_tx_begin() sets per transaction (SET LOCAL semantics).
# Two roles per service schema (docs/security.md): <schema> owns it and applies the migrations
# (UPSQUAD_PG_MIGRATE_DSN); the service logs in as <schema>_app, which owns nothing and has only
# USAGE on the schema and DML on its tables (default privileges cover later migrations), so it
# cannot alter a table, disable or un-force row-level security, drop a policy or take the
# owner's role. .run/env exports both: UPSQUAD_PG_DSN_<SCHEMA> (the owner: migrations, tests,
# operator tools) and UPSQUAD_PG_APP_DSN_<SCHEMA> (the login the services run as).
#
# Files under $RUN_DIR: env (0600), ports, pids/<name>.pid, logs/<name>.log, secrets/,
# redis/, nats/ (JetStream store), pg -> the Postgres folder (data/, sock/, postgres.log).
# The Postgres folder must be traversable by the `postgres` OS user (root runs the cluster
# through runuser); when RUN_DIR is not (a checkout under /root, a mktemp -d folder), it is
# /tmp/upsquad-pg-<hash of RUN_DIR> instead, recorded in $RUN_DIR/pg_base; `purge` removes it,
# and `up` removes such folders whose RUN_DIR was deleted without `purge`.
set -euo pipefail

# ---- what runs: services in start order (stopped in reverse) ----
#  executable       index  Postgres role/schema (- = none)
SERVICES_TABLE='
orchestrator      0      orchestrator
workflow-engine   1      workflow_engine
model-registry    2      model_registry
stream-hub        3      stream_hub
devworker         4      -
devworker-2       5      -
'
# A name ending in -<digit> is another instance of the executable it names (devworker-2 is a
# second devworker: crash recovery moves sessions to it when the first dies, and back).
exe_of() { echo "${1%-[0-9]}"; }
PG_OFFSET=432
REDIS_OFFSET=379
NATS_OFFSET=222
GRPC_OFFSET=51
METRICS_OFFSET=91
PG_DATABASE=upsquad
PGBIN=/usr/lib/postgresql/15/bin
# Bounds of the development servers (full => Redis evicts least-recently-used keys, which
# only holds state that may be lost; JetStream refuses writes beyond its store limits).
REDIS_MAXMEMORY=256mb
NATS_MAX_MEMORY_STORE=256MB
NATS_MAX_FILE_STORE=4GB
PG_MAX_CONNECTIONS=200
# The development tenant: org, member and team ids are UUIDs as in the API; .run/env exports
# them (UPSQUAD_DEV_ORG_ID, UPSQUAD_DEV_USER_ID, UPSQUAD_DEV_TEAM_ID) and the development
# token carries them.
DEV_ORG_ID=0d5e0000-0000-0000-0000-000000000001
DEV_USER_ID=0d5e0000-0000-0000-0000-0000000000a1
DEV_TEAM_ID=0d5e0000-0000-0000-0000-0000000000e1
# One-line example call printed by `up` when $BUILD/bin/upsquad-call exists (args: address,
# token file).
example_call() {
    echo "scripts/call.py $1 upsquad.runtime.v1.ModelRegistryService/ListModels" \
        "'{\"provider_filter\":\"anthropic\"}' --token \"\$(cat $2)\""
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PORT_BASE=${PORT_BASE:-45000}
FAST=${FAST:-0}
WAIT_S=${WAIT_S:-30}
START_SERVICES=${START_SERVICES:-1}
BUILD=${BUILD:-build}
[[ "$BUILD" == /* ]] || BUILD="$PWD/$BUILD"
RUN_DIR=${RUN_DIR:-.run}
[[ "$RUN_DIR" == /* ]] || RUN_DIR="$PWD/$RUN_DIR"
RUN_DIR=${RUN_DIR%/}

say() { echo "runtime: $*" >&2; }
die() {
    say "error: $*"
    exit 1
}

case "$RUN_DIR$BUILD" in *[[:space:]]*) die "RUN_DIR and BUILD must not contain spaces" ;; esac
if ! [[ "$PORT_BASE" =~ ^[0-9]+$ ]] || ((PORT_BASE < 1024 || PORT_BASE > 65000)); then
    die "PORT_BASE must be a number in 1024..65000 (got '$PORT_BASE')"
fi

IS_ROOT=0
[[ $(id -u) -eq 0 ]] && IS_ROOT=1

# ---- helpers ----

# Runs a command as the OS user that owns the Postgres cluster (root cannot run initdb).
as_pg() {
    if ((IS_ROOT)); then
        (cd / && runuser -u postgres -- "$@")
    else
        "$@"
    fi
}

# pid_of <pidfile> <cmdline-substring>: prints the pid when that process is alive and is
# what we started (guards against a recycled pid); fails otherwise.
pid_of() {
    local file=$1 want=$2 pid cmd
    [[ -r "$file" ]] || return 1
    read -r pid <"$file" 2>/dev/null || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ "$cmd" == *"$want"* ]] || return 1
    echo "$pid"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_port <name> <port> <pid|-> <logfile>: bounded wait until the port accepts a TCP
# connection; fails early when the process died, showing the end of its log.
wait_port() {
    local name=$1 port=$2 pid=$3 logf=$4 i
    for ((i = 0; i < WAIT_S * 10; i++)); do
        port_open "$port" && return 0
        if [[ "$pid" != - ]] && ! kill -0 "$pid" 2>/dev/null; then
            say "$name exited before listening on 127.0.0.1:$port; last log lines ($logf):"
            tail -n 20 "$logf" >&2 2>/dev/null || true
            return 1
        fi
        sleep 0.1
    done
    say "$name is not listening on 127.0.0.1:$port after ${WAIT_S}s; last log lines ($logf):"
    tail -n 20 "$logf" >&2 2>/dev/null || true
    return 1
}

# stop_pid <name> <pid>: SIGTERM, bounded wait, then SIGKILL.
stop_pid() {
    local name=$1 pid=$2 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < WAIT_S * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    say "$name (pid $pid) ignored SIGTERM for ${WAIT_S}s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

random_hex() { od -An -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }

# secret <name> <bytes>: generated once, kept in $RUN_DIR/secrets/<name> (0600).
secret() {
    local f="$RUN_DIR/secrets/$1"
    if [[ ! -s "$f" ]]; then
        (umask 077 && random_hex "$2" >"$f.tmp" && mv "$f.tmp" "$f")
    fi
    cat "$f"
}

# Iterates the services table: calls "$1 name index role" per row.
each_service() {
    local fn=$1 name idx role
    while read -r name idx role; do
        if [[ -n "$name" ]]; then "$fn" "$name" "$idx" "$role"; fi
    done <<<"$SERVICES_TABLE"
}
each_service_reverse() {
    local fn=$1 name idx role
    while read -r name idx role; do
        if [[ -n "$name" ]]; then "$fn" "$name" "$idx" "$role"; fi
    done < <(grep -v '^[[:space:]]*$' <<<"$SERVICES_TABLE" | tac)
}

env_name() { tr 'a-z-' 'A-Z_' <<<"$1"; }

# ---- ports (fixed per RUN_DIR while anything runs) ----
load_ports() {
    PG_PORT=$((PORT_BASE + PG_OFFSET))
    REDIS_PORT=$((PORT_BASE + REDIS_OFFSET))
    NATS_PORT=$((PORT_BASE + NATS_OFFSET))
}
recorded_port_base() {
    local v
    [[ -r "$RUN_DIR/ports" ]] || return 1
    v=$(sed -n 's/^PORT_BASE=\([0-9]*\)$/\1/p' "$RUN_DIR/ports")
    [[ -n "$v" ]] && echo "$v"
}

# ---- Postgres ----

# The folder holding the cluster: $RUN_DIR/pg when the postgres user can reach it and the
# socket path fits the 107-byte limit of sockaddr_un, else /tmp/upsquad-pg-<hash>.
pg_base() {
    if [[ -r "$RUN_DIR/pg_base" ]]; then
        cat "$RUN_DIR/pg_base"
        return
    fi
    local base="$RUN_DIR/pg" reachable=1
    if ((IS_ROOT)); then
        runuser -u postgres -- test -x "$RUN_DIR" 2>/dev/null || reachable=0
    fi
    if ((!reachable)) || ((${#base} + 24 > 107)); then
        base="/tmp/upsquad-pg-$(printf %s "$RUN_DIR" | sha256sum | cut -c1-16)"
    fi
    echo "$base" >"$RUN_DIR/pg_base"
    echo "$base"
}

pg_prepare_dirs() {
    local base=$1 owner
    owner=$(id -un)
    if ((IS_ROOT)); then owner=postgres; fi
    if [[ ! -d "$base" ]]; then
        mkdir -m 0700 "$base"
        if ((IS_ROOT)); then chown postgres:postgres "$base"; fi
    fi
    # A folder in /tmp that someone else created is not ours to trust.
    [[ "$(stat -c %U "$base")" == "$owner" ]] || die "$base is not owned by $owner"
    as_pg mkdir -p -m 0700 "$base/sock"
    if [[ "$base" != "$RUN_DIR/pg" ]]; then
        ln -sfn "$base" "$RUN_DIR/pg"
        echo "$RUN_DIR" | as_pg sh -c 'cat > "$1"' _ "$base/run_dir"
    fi
}

# Removes /tmp/upsquad-pg-* folders of this OS user whose RUN_DIR no longer exists and whose
# cluster is not running (a throw-away runtime deleted with rm -rf instead of `purge`).
pg_collect_orphans() {
    local d rd owner pid
    owner=$(id -un)
    if ((IS_ROOT)); then owner=postgres; fi
    for d in /tmp/upsquad-pg-*; do
        [[ -d "$d" && ! -L "$d" && "$(stat -c %U "$d")" == "$owner" ]] || continue
        rd=$(as_pg cat "$d/run_dir" 2>/dev/null) || continue
        [[ -n "$rd" && ! -e "$rd" ]] || continue
        pid=$(as_pg head -n1 "$d/data/postmaster.pid" 2>/dev/null || true)
        if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then continue; fi
        rm -rf "$d"
    done
}

pg_running() {
    local base=$1
    [[ -f "$base/data/PG_VERSION" ]] || return 1
    as_pg "$PGBIN/pg_ctl" -D "$base/data" status >/dev/null 2>&1
}

pg_pid() { as_pg head -n1 "$1/data/postmaster.pid" 2>/dev/null || true; }

pg_write_conf() {
    local base=$1 fast_opts=""
    if [[ "$FAST" == 1 ]]; then
        fast_opts=$'fsync = off\nsynchronous_commit = off\nfull_page_writes = off'
    fi
    as_pg sh -c 'cat > "$1"' _ "$base/data/upsquad.conf" <<EOF
# Written by scripts/runtime.sh on every start.
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$base/sock'
unix_socket_permissions = 0700
max_connections = $PG_MAX_CONNECTIONS
$fast_opts
EOF
}

pg_init() {
    local base=$1 pw
    pw=$(secret pg_postgres 24)
    as_pg sh -c 'umask 077; cat > "$1"' _ "$base/pwfile" <<<"$pw"
    local nosync=()
    [[ "$FAST" == 1 ]] && nosync=(--no-sync)
    if ! as_pg "$PGBIN/initdb" -D "$base/data" -U postgres --auth=scram-sha-256 \
        --pwfile="$base/pwfile" -E UTF8 --no-locale "${nosync[@]}" >"$RUN_DIR/logs/initdb.log" 2>&1; then
        as_pg rm -f "$base/pwfile"
        tail -n 20 "$RUN_DIR/logs/initdb.log" >&2
        die "initdb failed (log: $RUN_DIR/logs/initdb.log)"
    fi
    as_pg rm -f "$base/pwfile"
    echo "include_if_exists = 'upsquad.conf'" |
        as_pg sh -c 'cat >> "$1"' _ "$base/data/postgresql.conf"
}

pg_up() {
    local base
    base=$(pg_base)
    pg_prepare_dirs "$base"
    if pg_running "$base"; then
        say "postgres already running (pid $(pg_pid "$base"))"
        return 0
    fi
    port_open "$PG_PORT" && die "port $PG_PORT is taken by a process this runtime did not start"
    [[ -f "$base/data/PG_VERSION" ]] || pg_init "$base"
    pg_write_conf "$base"
    ln -sfn "$base/postgres.log" "$RUN_DIR/logs/postgres.log"
    if ! as_pg "$PGBIN/pg_ctl" -D "$base/data" -l "$base/postgres.log" -w -t "$WAIT_S" start \
        >/dev/null 2>&1 9>&-; then
        as_pg tail -n 20 "$base/postgres.log" >&2 || true
        die "postgres did not start (log: $base/postgres.log)"
    fi
    wait_port postgres "$PG_PORT" - "$base/postgres.log" || die "postgres is not reachable"
    say "postgres started (pid $(pg_pid "$base"), port $PG_PORT)"
}

pg_write_pgpass() {
    local f="$RUN_DIR/secrets/pgpass" role
    {
        echo "127.0.0.1:*:*:postgres:$(secret pg_postgres 24)"
        for role in $(pg_roles); do
            echo "127.0.0.1:*:*:$role:$(secret "pg_$role" 24)"
            echo "127.0.0.1:*:*:${role}_app:$(secret "pg_${role}_app" 24)"
        done
    } | (umask 077 && cat >"$f.tmp" && mv "$f.tmp" "$f")
}

pg_roles() {
    local name idx role
    while read -r name idx role; do
        if [[ -n "$name" && "$role" != - ]]; then echo "$role"; fi
    done <<<"$SERVICES_TABLE"
}

pg_dsn() { echo "postgresql://$1@127.0.0.1:$PG_PORT/$2?sslmode=disable&connect_timeout=10"; }

# Database, and per service schema: the owner role (migrations) and the service's login role
# <schema>_app (DML only), both with that schema as search_path. Re-running converges an older
# runtime's database (one role per schema) to the split: the owner keeps what it owns.
pg_bootstrap() {
    local psql=("$PGBIN/psql" -X -q -A -t -v ON_ERROR_STOP=1)
    export PGPASSFILE="$RUN_DIR/secrets/pgpass"
    if [[ -z "$("${psql[@]}" "$(pg_dsn postgres postgres)" \
        -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DATABASE'")" ]]; then
        "${psql[@]}" "$(pg_dsn postgres postgres)" -c "CREATE DATABASE $PG_DATABASE"
    fi
    local sql="SET client_min_messages = warning;" role vars=()
    for role in $(pg_roles); do
        vars+=(-v "pw_$role=$(secret "pg_$role" 24)" -v "pw_${role}_app=$(secret "pg_${role}_app" 24)")
        sql+="
SELECT format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS', r)
  FROM unnest(ARRAY['$role', '${role}_app']) AS r
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) \\gexec
ALTER ROLE $role NOSUPERUSER NOBYPASSRLS PASSWORD :'pw_$role';
ALTER ROLE ${role}_app NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS NOINHERIT
    PASSWORD :'pw_${role}_app';
CREATE SCHEMA IF NOT EXISTS $role AUTHORIZATION $role;
ALTER ROLE $role IN DATABASE $PG_DATABASE SET search_path = $role;
ALTER ROLE ${role}_app IN DATABASE $PG_DATABASE SET search_path = $role;
REVOKE CREATE ON SCHEMA $role FROM PUBLIC;
GRANT USAGE ON SCHEMA $role TO ${role}_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA $role TO ${role}_app;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA $role TO ${role}_app;
ALTER DEFAULT PRIVILEGES FOR ROLE $role IN SCHEMA $role
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO ${role}_app;
ALTER DEFAULT PRIVILEGES FOR ROLE $role IN SCHEMA $role
    GRANT USAGE, SELECT ON SEQUENCES TO ${role}_app;
SELECT 'REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON $role.schema_migrations FROM ${role}_app'
 WHERE to_regclass('$role.schema_migrations') IS NOT NULL \\gexec
"
    done
    "${psql[@]}" "${vars[@]}" "$(pg_dsn postgres "$PG_DATABASE")" >/dev/null <<<"$sql" ||
        die "bootstrap of database $PG_DATABASE failed"
}

pg_down() {
    [[ -r "$RUN_DIR/pg_base" ]] || return 0
    local base
    base=$(cat "$RUN_DIR/pg_base")
    pg_running "$base" || return 0
    say "stopping postgres (pid $(pg_pid "$base"))"
    as_pg "$PGBIN/pg_ctl" -D "$base/data" stop -m fast -w -t "$WAIT_S" >/dev/null 2>&1 ||
        say "postgres did not stop within ${WAIT_S}s"
}

# ---- Redis ----
redis_up() {
    local pidf="$RUN_DIR/pids/redis.pid" pid
    if pid=$(pid_of "$pidf" redis-server); then
        say "redis already running (pid $pid)"
        return 0
    fi
    rm -f "$pidf"
    port_open "$REDIS_PORT" && die "port $REDIS_PORT is taken by a process this runtime did not start"
    mkdir -p "$RUN_DIR/redis"
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --protected-mode yes \
        --save "" --appendonly no --daemonize yes --pidfile "$pidf" \
        --logfile "$RUN_DIR/logs/redis.log" --dir "$RUN_DIR/redis" \
        --maxmemory "$REDIS_MAXMEMORY" --maxmemory-policy allkeys-lru 9>&- ||
        die "redis-server did not start (log: $RUN_DIR/logs/redis.log)"
    wait_port redis "$REDIS_PORT" - "$RUN_DIR/logs/redis.log" || die "redis is not reachable"
    say "redis started (pid $(cat "$pidf" 2>/dev/null), port $REDIS_PORT)"
}

# ---- NATS with JetStream ----
nats_up() {
    local pidf="$RUN_DIR/pids/nats.pid" pid conf="$RUN_DIR/nats.conf"
    if pid=$(pid_of "$pidf" nats-server); then
        say "nats already running (pid $pid)"
        return 0
    fi
    rm -f "$pidf"
    port_open "$NATS_PORT" && die "port $NATS_PORT is taken by a process this runtime did not start"
    mkdir -p "$RUN_DIR/nats"
    cat >"$conf" <<EOF
# Written by scripts/runtime.sh on every start.
listen: 127.0.0.1:$NATS_PORT
server_name: upsquad-dev
jetstream {
    store_dir: "$RUN_DIR/nats"
    max_memory_store: $NATS_MAX_MEMORY_STORE
    max_file_store: $NATS_MAX_FILE_STORE
}
EOF
    (exec setsid nats-server -c "$conf" >>"$RUN_DIR/logs/nats.log" 2>&1 </dev/null 9>&-) &
    pid=$!
    echo "$pid" >"$pidf"
    wait_port nats "$NATS_PORT" "$pid" "$RUN_DIR/logs/nats.log" || die "nats is not reachable"
    say "nats started (pid $pid, port $NATS_PORT)"
}

# ---- env file ----
write_env() {
    local f="$RUN_DIR/env" name idx role
    {
        echo "# Written by scripts/runtime.sh up; source it to talk to this runtime."
        echo "export UPSQUAD_RUN_DIR=$RUN_DIR"
        echo "export PATH=\"$ROOT/tools/upsq:\$PATH\""   # upsq, the CLI (docs/upsq.md)
        echo "export PGPASSFILE=$RUN_DIR/secrets/pgpass"
        echo "export UPSQUAD_PG_ADMIN_DSN='$(pg_dsn postgres "$PG_DATABASE")'"
        while read -r name idx role; do
            [[ -z "$name" ]] && continue
            if [[ "$role" != - ]]; then
                echo "export UPSQUAD_PG_DSN_$(env_name "$role")='$(pg_dsn "$role" "$PG_DATABASE")'"
                echo "export UPSQUAD_PG_APP_DSN_$(env_name "$role")='$(pg_dsn "${role}_app" "$PG_DATABASE")'"
            fi
        done <<<"$SERVICES_TABLE"
        echo "export UPSQUAD_NATS_URL=nats://127.0.0.1:$NATS_PORT"
        echo "export UPSQUAD_REDIS_URL=redis://127.0.0.1:$REDIS_PORT"
        echo "export UPSQUAD_JWT_SECRET=$(secret jwt_secret 32)"
        echo "export UPSQUAD_JWT_AUDIENCE=upsquad"
        echo "export UPSQUAD_LOG_LEVEL=\${UPSQUAD_LOG_LEVEL:-info}"
        echo "export UPSQUAD_DEV_ORG_ID=$DEV_ORG_ID"
        echo "export UPSQUAD_DEV_USER_ID=$DEV_USER_ID"
        echo "export UPSQUAD_DEV_TEAM_ID=$DEV_TEAM_ID"
        # key-encryption key of BYOK provider keys (orchestrator, upsquad-agents keys set)
        echo "export UPSQUAD_KEK=dev:$(secret kek 32)"
        while read -r name idx role; do
            [[ -z "$name" ]] && continue
            echo "export UPSQUAD_$(env_name "$name")_ADDR=127.0.0.1:$((PORT_BASE + GRPC_OFFSET + idx))"
            echo "export UPSQUAD_$(env_name "$name")_METRICS_ADDR=127.0.0.1:$((PORT_BASE + METRICS_OFFSET + idx))"
        done <<<"$SERVICES_TABLE"
    } | (umask 077 && cat >"$f.tmp" && mv "$f.tmp" "$f")
}

# ---- services ----
FAILED=0
service_up() {
    local name=$1 idx=$2 role=$3 bin="$BUILD/bin/$(exe_of "$1")" pidf="$RUN_DIR/pids/$1.pid" pid
    local logf="$RUN_DIR/logs/$1.log" port=$((PORT_BASE + GRPC_OFFSET + $2))
    [[ -x "$bin" ]] || return 0
    if pid=$(pid_of "$pidf" "$(exe_of "$name")"); then
        say "$name already running (pid $pid)"
        return 0
    fi
    rm -f "$pidf"
    if port_open "$port"; then
        say "port $port for $name is taken by a process this runtime did not start"
        FAILED=1
        return 0
    fi
    (
        # shellcheck disable=SC1091
        source "$RUN_DIR/env"
        if [[ "$role" != - ]]; then # logs in as <schema>_app; migrates as the owner
            export UPSQUAD_PG_DSN UPSQUAD_PG_MIGRATE_DSN
            UPSQUAD_PG_DSN=$(pg_dsn "${role}_app" "$PG_DATABASE")
            UPSQUAD_PG_MIGRATE_DSN=$(pg_dsn "$role" "$PG_DATABASE")
        fi
        export UPSQUAD_GRPC_ADDR=127.0.0.1:$port
        export UPSQUAD_METRICS_ADDR=127.0.0.1:$((PORT_BASE + METRICS_OFFSET + idx))
        # every devworker of the table is a worker target
        if [[ "$name" == orchestrator && -z "${UPSQUAD_WORKER_TARGETS:-}" ]]; then
            export UPSQUAD_WORKER_TARGETS="$UPSQUAD_DEVWORKER_ADDR,$UPSQUAD_DEVWORKER_2_ADDR"
        fi
        # a chat turn's approvals and prompts open in the workflow engine's ApprovalService
        if [[ "$name" == orchestrator && -z "${UPSQUAD_APPROVALS_ADDR:-}" ]]; then
            export UPSQUAD_APPROVALS_ADDR="$UPSQUAD_WORKFLOW_ENGINE_ADDR"
        fi
        if [[ -d "$ROOT/services/$name/migrations" ]]; then
            export UPSQUAD_MIGRATIONS_DIR="$ROOT/services/$name/migrations"
        fi
        cd "$ROOT"
        exec setsid "$bin" >>"$logf" 2>&1 </dev/null 9>&-
    ) &
    pid=$!
    echo "$pid" >"$pidf"
    if wait_port "$name" "$port" "$pid" "$logf"; then
        say "$name started (pid $pid, grpc 127.0.0.1:$port)"
    else
        # not left behind half-started: `down` could not tell it from a healthy one
        stop_pid "$name" "$pid"
        rm -f "$pidf"
        FAILED=1
    fi
}

service_down() {
    local name=$1 pidf="$RUN_DIR/pids/$1.pid" pid
    if pid=$(pid_of "$pidf" "$(exe_of "$name")"); then
        say "stopping $name (pid $pid)"
        stop_pid "$name" "$pid"
    fi
    rm -f "$pidf"
}

# ---- devtools: the tool provider of local runs (docs/devtools.md) ----
# Not in SERVICES_TABLE: it has no gRPC port; it talks NATS only. Started with the services
# (before them, so that the engine hears its first ToolAnnounce) when $BUILD/bin/devtools
# exists; ready once it prints "ready" (its stdout goes to its log).
devtools_up() {
    local bin="$BUILD/bin/devtools" pidf="$RUN_DIR/pids/devtools.pid" pid i
    local logf="$RUN_DIR/logs/devtools.log" from
    [[ -x "$bin" ]] || return 0
    if pid=$(pid_of "$pidf" devtools); then
        say "devtools already running (pid $pid)"
        return 0
    fi
    rm -f "$pidf"
    from=$(($(stat -c %s "$logf" 2>/dev/null || echo 0) + 1))
    (
        # shellcheck disable=SC1091
        source "$RUN_DIR/env"
        cd "$ROOT"
        exec setsid "$bin" >>"$logf" 2>&1 </dev/null 9>&-
    ) &
    pid=$!
    echo "$pid" >"$pidf"
    for ((i = 0; i < WAIT_S * 10; i++)); do
        if tail -c +"$from" "$logf" 2>/dev/null | grep -qx ready; then
            say "devtools started (pid $pid, tool.invoke.<tool> on NATS)"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    say "devtools did not become ready; last log lines ($logf):"
    tail -n 20 "$logf" >&2 2>/dev/null || true
    stop_pid devtools "$pid"
    rm -f "$pidf"
    FAILED=1
}

devtools_down() {
    local pidf="$RUN_DIR/pids/devtools.pid" pid
    if pid=$(pid_of "$pidf" devtools); then
        say "stopping devtools (pid $pid)"
        stop_pid devtools "$pid"
    fi
    rm -f "$pidf"
}

status_devtools() {
    local pid
    if pid=$(pid_of "$RUN_DIR/pids/devtools.pid" devtools); then
        row devtools "$pid" "NATS tool.invoke.<tool>, stats on devtools.stats"
    elif [[ -x "$BUILD/bin/devtools" ]]; then
        row devtools "-" "stopped"
    fi
}

# ---- status table ----
row() { printf '  %-16s %-8s %s\n' "$@"; }
status_service() {
    local name=$1 idx=$2 pid
    if pid=$(pid_of "$RUN_DIR/pids/$name.pid" "$(exe_of "$name")"); then
        row "$name" "$pid" "grpc 127.0.0.1:$((PORT_BASE + GRPC_OFFSET + idx))  metrics 127.0.0.1:$((PORT_BASE + METRICS_OFFSET + idx))"
    elif [[ -x "$BUILD/bin/$(exe_of "$name")" ]]; then
        row "$name" "-" "stopped"
    fi
}
print_status() {
    local pid base
    row component pid address
    base=$(cat "$RUN_DIR/pg_base" 2>/dev/null || true)
    if [[ -n "$base" ]] && pg_running "$base"; then
        row postgres "$(pg_pid "$base")" "127.0.0.1:$PG_PORT database $PG_DATABASE (data $base/data)"
    else
        row postgres - stopped
    fi
    if pid=$(pid_of "$RUN_DIR/pids/redis.pid" redis-server); then
        row redis "$pid" "redis://127.0.0.1:$REDIS_PORT"
    else
        row redis - stopped
    fi
    if pid=$(pid_of "$RUN_DIR/pids/nats.pid" nats-server); then
        row nats "$pid" "nats://127.0.0.1:$NATS_PORT (JetStream)"
    else
        row nats - stopped
    fi
    each_service status_service
    status_devtools
}

print_access() {
    local tok="$RUN_DIR/dev-token"
    echo "env: source $RUN_DIR/env"
    if [[ -x "$BUILD/bin/upsquad-token" ]]; then
        if (source "$RUN_DIR/env" && umask 077 &&
            timeout 10 "$BUILD/bin/upsquad-token" --sub "$DEV_USER_ID" --org "$DEV_ORG_ID" \
                --team "$DEV_TEAM_ID" --clearance 5 \
                >"$tok.tmp") 2>/dev/null; then
            mv "$tok.tmp" "$tok"
            echo "development token (member $DEV_USER_ID, org $DEV_ORG_ID, team $DEV_TEAM_ID, clearance 5), kept in $tok:"
            echo "  $(cat "$tok")"
        else
            rm -f "$tok.tmp"
            say "upsquad-token failed; no development token"
        fi
    fi
    if [[ -x "$BUILD/bin/model-registry" && -s "$tok" ]]; then
        local addr
        addr=127.0.0.1:$((PORT_BASE + GRPC_OFFSET + 2))
        echo "example: $(example_call "$addr" "$tok")"
    fi
}

# ---- development agents (orchestrator) ----
# Applies examples/agents/*.json for the development org once the orchestrator has migrated its
# schema, prints their ids and exports the assistant's id as UPSQUAD_DEV_AGENT_ID in the env file.
provision_agents() {
    local tool="$BUILD/bin/upsquad-agents" out id line
    [[ -x "$tool" ]] || return 0
    pid_of "$RUN_DIR/pids/orchestrator.pid" orchestrator >/dev/null || return 0
    compgen -G "$ROOT/examples/agents/*.json" >/dev/null || return 0
    # shellcheck disable=SC1091
    if ! out=$(source "$RUN_DIR/env" && UPSQUAD_PG_DSN=$UPSQUAD_PG_DSN_ORCHESTRATOR \
        "$tool" --org "$DEV_ORG_ID" apply "$ROOT"/examples/agents/*.json 2>&1); then
        say "upsquad-agents apply failed: $out"
        FAILED=1
        return 0
    fi
    say "development agents (org $DEV_ORG_ID):"
    while read -r line; do echo "  $line" >&2; done <<<"$out"
    id=$(awk '$2 == "assistant" {print $1}' <<<"$out")
    if [[ -n "$id" ]]; then
        local f="$RUN_DIR/env"
        (umask 077 && grep -v '^export UPSQUAD_DEV_AGENT_ID=' "$f" >"$f.tmp" &&
            echo "export UPSQUAD_DEV_AGENT_ID=$id" >>"$f.tmp" && mv "$f.tmp" "$f")
    fi
}

# ---- commands ----
cmd_up() {
    mkdir -p "$RUN_DIR"/{pids,logs,secrets}
    chmod 0700 "$RUN_DIR/secrets"
    # Serialises concurrent `up`s of one RUN_DIR; every server and service is started with
    # fd 9 closed so that none of them keeps holding the lock.
    exec 9>"$RUN_DIR/.lock"
    flock -w "$WAIT_S" 9 || die "another runtime.sh holds $RUN_DIR/.lock"
    local recorded
    if recorded=$(recorded_port_base) && [[ "$recorded" != "$PORT_BASE" ]]; then
        if anything_running; then
            die "$RUN_DIR runs with PORT_BASE=$recorded; run 'down' first to change it"
        fi
    fi
    echo "PORT_BASE=$PORT_BASE" >"$RUN_DIR/ports"
    load_ports
    pg_collect_orphans
    pg_write_pgpass
    pg_up
    pg_bootstrap
    redis_up
    nats_up
    write_env
    if [[ "$START_SERVICES" != 0 ]]; then devtools_up; fi
    if [[ "$START_SERVICES" != 0 ]]; then each_service service_up; fi
    if [[ "$START_SERVICES" != 0 ]]; then provision_agents; fi
    echo
    print_status
    print_access
    ((FAILED == 0)) || die "some services did not start (logs in $RUN_DIR/logs)"
}

anything_running() {
    local base f
    base=$(cat "$RUN_DIR/pg_base" 2>/dev/null || true)
    [[ -n "$base" ]] && pg_running "$base" && return 0
    pid_of "$RUN_DIR/pids/redis.pid" redis-server >/dev/null && return 0
    pid_of "$RUN_DIR/pids/nats.pid" nats-server >/dev/null && return 0
    for f in "$RUN_DIR"/pids/*.pid; do
        [[ -e "$f" ]] || continue
        pid_of "$f" "$(exe_of "$(basename "$f" .pid)")" >/dev/null && return 0
    done
    return 1
}

cmd_down() {
    [[ -d "$RUN_DIR" ]] || return 0
    local server name pid
    each_service_reverse service_down
    devtools_down
    for server in redis:redis-server nats:nats-server; do
        name=${server%%:*}
        if pid=$(pid_of "$RUN_DIR/pids/$name.pid" "${server#*:}"); then
            say "stopping $name (pid $pid)"
            stop_pid "$name" "$pid"
        fi
        rm -f "$RUN_DIR/pids/$name.pid"
    done
    pg_down
    return 0
}

cmd_status() {
    [[ -d "$RUN_DIR" ]] || {
        echo "nothing runs ($RUN_DIR does not exist)"
        return 0
    }
    PORT_BASE=$(recorded_port_base || echo "$PORT_BASE")
    load_ports
    print_status
}

cmd_purge() {
    cmd_down
    [[ -d "$RUN_DIR" ]] || return 0
    local base
    base=$(cat "$RUN_DIR/pg_base" 2>/dev/null || true)
    case "$base" in
    /tmp/upsquad-pg-*) rm -rf "$base" ;;
    esac
    rm -rf "$RUN_DIR"
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
env) echo "$RUN_DIR/env" ;;
purge) cmd_purge ;;
*)
    echo "usage: [RUN_DIR=.run] [PORT_BASE=45000] [FAST=1] $0 up|down|status|env|purge" >&2
    exit 2
    ;;
esac

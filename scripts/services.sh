#!/usr/bin/env bash
# Starts (or stops) throwaway PostgreSQL, PgBouncer (transaction mode, in front of that
# PostgreSQL), Redis and NATS JetStream servers on loopback for the tests.
#   bash scripts/services.sh start   # prints the environment for the tests to stdout
#   bash scripts/services.sh stop
#   bash scripts/services.sh restart-pg | stop-pg | stop-pgbouncer | stop-redis |
#                            start-redis | restart-nats | stop-nats | start-nats  (tests)
#                            freeze-nats | hang-nats | amnesia-nats  (tests: a broker host's
#                            power cut; hang-nats: the host stops answering first)
#   bash scripts/services.sh pause-pg-writers | crash-pg   (tests: a crash before a flush)
# Data lives in $IDEMRPC_SERVICES_DIR (default /tmp/idemrpc-services), removed by stop.
# As root, PostgreSQL runs as the "postgres" user (initdb refuses root). The default
# ports lie below Linux's ephemeral range (32768-60999), so no outgoing connection of
# another program holds one as its source port; each is checked free before its server
# starts, and a server that does not start has its log printed before anything is
# removed.
set -euo pipefail
DIR=${IDEMRPC_SERVICES_DIR:-/tmp/idemrpc-services}
PG_PORT=${IDEMRPC_PG_PORT:-15432}
REDIS_PORT=${IDEMRPC_REDIS_PORT:-16379}
PGB_PORT=${IDEMRPC_PGBOUNCER_PORT:-$((PG_PORT + 1000))}
NATS_PORT=${IDEMRPC_NATS_PORT:-14222}
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)

as_pg() { if [ "$(id -u)" -eq 0 ]; then su postgres -s /bin/sh -c "$1"; else sh -c "$1"; fi; }
pg_ctl_cmd() { echo "$PGBIN/pg_ctl -D $DIR/pg -l $DIR/pg.log -w -o '-c listen_addresses=127.0.0.1 -p $PG_PORT -k $DIR/sock -c fsync=off'"; }

# Something accepts connections on 127.0.0.1:$1 already.
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Fails naming the port and what holds it when one of ours is taken.
ports_free() {
    local p
    for p in "$PG_PORT" "$REDIS_PORT" "$PGB_PORT" "$NATS_PORT"; do
        if port_taken "$p"; then
            echo "services: port $p on 127.0.0.1 is in use ($(ss -ltnpH "sport = :$p" 2>/dev/null |
                sed -n 's/.*users:((\("[^"]*"\).*/\1/p' | head -1)); set IDEMRPC_PG_PORT," \
                "IDEMRPC_REDIS_PORT, IDEMRPC_PGBOUNCER_PORT, IDEMRPC_NATS_PORT" >&2
            return 1
        fi
    done
}

# The server's log on stderr (before stop removes it), then stop, then exit 1.
fail_with_log() { # what log-file
    echo "services: $1 did not start; its log ($2):" >&2
    [ -f "$2" ] && tail -n 40 "$2" >&2
    stop
    exit 1
}

# PostgreSQL runs as "postgres" when we are root: every parent of $DIR must let it in.
dir_reachable() {
    [ "$(id -u)" -eq 0 ] || return 0
    local d
    d=$(dirname "$(realpath -m "$DIR")")
    if ! su postgres -s /bin/sh -c "test -x '$d'" 2>/dev/null; then
        echo "services: PostgreSQL runs as the postgres user, who cannot reach $DIR (a parent" \
            "directory is not searchable by others, e.g. mode 0700): set IDEMRPC_SERVICES_DIR" \
            "under /tmp or chmod o+x the parents" >&2
        return 1
    fi
}

stop() {
    stop_nats
    [ -f "$DIR/redis.pid" ] && kill "$(cat "$DIR/redis.pid")" 2>/dev/null || true
    [ -f "$DIR/pgbouncer.pid" ] && kill "$(cat "$DIR/pgbouncer.pid")" 2>/dev/null || true
    [ -d "$DIR/pg" ] && as_pg "$(pg_ctl_cmd) -m immediate stop" >/dev/null 2>&1 || true
    rm -rf "$DIR"
}

start() {
    [ -n "$PGBIN" ] || { echo "services: PostgreSQL not installed" >&2; exit 1; }
    stop
    ports_free || exit 1
    dir_reachable || exit 1
    mkdir -p "$DIR/sock"
    [ "$(id -u)" -eq 0 ] && chown -R postgres "$DIR"
    as_pg "$PGBIN/initdb -D $DIR/pg -A trust -U postgres" >"$DIR/initdb.log" 2>&1 ||
        fail_with_log initdb "$DIR/initdb.log"
    as_pg "$(pg_ctl_cmd) start" >/dev/null || fail_with_log PostgreSQL "$DIR/pg.log"
    start_redis || fail_with_log redis-server "$DIR/redis.log"
    local pgb_env=""
    if command -v pgbouncer >/dev/null 2>&1; then
        start_pgbouncer || fail_with_log pgbouncer "$DIR/pgbouncer.log"
        pgb_env="export IDEMRPC_TEST_PGBOUNCER='host=127.0.0.1 port=$PGB_PORT user=postgres dbname=postgres connect_timeout=2'"
    fi
    echo "$pgb_env"
    cat <<ENV
export IDEMRPC_TEST_PG='host=127.0.0.1 port=$PG_PORT user=postgres dbname=postgres connect_timeout=2'
export IDEMRPC_TEST_REDIS='redis://127.0.0.1:$REDIS_PORT'
export IDEMRPC_SERVICES='env IDEMRPC_SERVICES_DIR=$DIR IDEMRPC_PG_PORT=$PG_PORT IDEMRPC_REDIS_PORT=$REDIS_PORT IDEMRPC_PGBOUNCER_PORT=$PGB_PORT IDEMRPC_NATS_PORT=$NATS_PORT bash $(cd "$(dirname "$0")" && pwd)/services.sh'
ENV
    start_nats && echo "export IDEMRPC_TEST_NATS='nats://127.0.0.1:$NATS_PORT'" || true
}

# Transaction pooling, as teams run it in front of PostgreSQL: any database name maps
# to the server's database of that name (the tests' throwaway databases).
start_pgbouncer() {
    cat >"$DIR/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=$PG_PORT
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PGB_PORT
unix_socket_dir =
auth_type = trust
auth_file = $DIR/pgbouncer.users
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 60
logfile = $DIR/pgbouncer.log
pidfile = $DIR/pgbouncer.pid
INI
    echo '"postgres" ""' >"$DIR/pgbouncer.users"
    [ "$(id -u)" -eq 0 ] && chown postgres "$DIR/pgbouncer.ini" "$DIR/pgbouncer.users"
    as_pg "pgbouncer -d $DIR/pgbouncer.ini" >/dev/null 2>&1 || return 1
    for _ in $(seq 100); do
        psql "host=127.0.0.1 port=$PGB_PORT user=postgres dbname=postgres connect_timeout=1" \
            -Atc 'SELECT 1' >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    return 1
}

start_redis() {
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --daemonize yes --dir "$DIR" \
        --pidfile "$DIR/redis.pid" --save '' --appendonly no --logfile "$DIR/redis.log"
    for _ in $(seq 100); do
        redis-cli -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG && return 0
        sleep 0.1
    done
    return 1
}

# JetStream on file storage in $DIR/nats (kept by restart-nats). Optional: without
# nats-server installed IDEMRPC_TEST_NATS stays unset and the broker tests skip.
start_nats() {
    command -v nats-server >/dev/null || return 1
    mkdir -p "$DIR/nats"
    nats-server -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$DIR/nats" -P "$DIR/nats.pid" \
        -l "$DIR/nats.log" </dev/null >/dev/null 2>&1 &
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$NATS_PORT") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "services: nats-server did not start; its log ($DIR/nats.log):" >&2
    [ -f "$DIR/nats.log" ] && tail -n 20 "$DIR/nats.log" >&2
    return 1
}

stop_nats() {
    [ -f "$DIR/nats.pid" ] || return 0
    local pid
    pid=$(cat "$DIR/nats.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$DIR/nats.pid"
}

# The power cut of a broker host, in two steps (tests): freeze-nats copies the store as
# it is on disk at one instant (the broker stopped meanwhile, SIGSTOP/SIGCONT);
# amnesia-nats kills it (SIGKILL) and starts it on that copy, so what it acked after the
# copy is gone, as after a crash before its file store synced.
freeze_nats() {
    local pid
    pid=$(cat "$DIR/nats.pid")
    kill -STOP "$pid"
    rm -rf "$DIR/nats.frozen"
    cp -a "$DIR/nats" "$DIR/nats.frozen" || { kill -CONT "$pid"; return 1; }
    kill -CONT "$pid"
}

amnesia_nats() {
    local pid
    [ -d "$DIR/nats.frozen" ] || { echo "services: amnesia-nats: no freeze-nats copy" >&2; return 1; }
    pid=$(cat "$DIR/nats.pid")
    kill -KILL "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$DIR/nats.pid"
    rm -rf "$DIR/nats"
    mv "$DIR/nats.frozen" "$DIR/nats"
    start_nats
}

# The postmaster and its children (the instance's every process).
pg_pids() {
    local pm
    pm=$(head -n 1 "$DIR/pg/postmaster.pid")
    echo "$pm" $(pgrep -P "$pm" || true)
}

# Stops the processes that flush WAL on their own (WAL writer, background writer,
# checkpointer): WAL not flushed by a commit then stays in shared memory until crash-pg.
pause_pg_writers() {
    local pm
    pm=$(head -n 1 "$DIR/pg/postmaster.pid")
    pkill -STOP -P "$pm" -f 'postgres: (walwriter|background writer|checkpointer)'
}

# A crash: every process of the instance killed at once (SIGKILL also ends paused ones;
# what was not flushed is lost), then started again (crash recovery).
crash_pg() {
    local pids
    pids=$(pg_pids)
    kill -KILL $pids
    for _ in $(seq 100); do
        local alive=""
        for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ -n "$alive" ] || break
        sleep 0.1
    done
    as_pg "$(pg_ctl_cmd) start" >/dev/null
}

case "${1:-}" in
start) start ;;
stop) stop ;;
restart-pg) as_pg "$(pg_ctl_cmd) -m fast restart" >/dev/null ;;
stop-pg) as_pg "$(pg_ctl_cmd) -m fast stop" >/dev/null ;;
stop-pgbouncer) [ -f "$DIR/pgbouncer.pid" ] && kill "$(cat "$DIR/pgbouncer.pid")" 2>/dev/null || true ;;
pause-pg-writers) pause_pg_writers ;;
crash-pg) crash_pg ;;
stop-redis) redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true ;;
start-redis) start_redis ;;
restart-nats) stop_nats && start_nats ;;
stop-nats) stop_nats ;;
start-nats) start_nats ;;
freeze-nats) freeze_nats ;;
hang-nats) kill -STOP "$(cat "$DIR/nats.pid")" ;;
amnesia-nats) amnesia_nats ;;
*) echo "usage: bash scripts/services.sh start|stop|restart-pg|stop-pg|stop-pgbouncer|crash-pg|pause-pg-writers|stop-redis|start-redis|restart-nats|stop-nats|start-nats|freeze-nats|hang-nats|amnesia-nats" >&2; exit 2 ;;
esac

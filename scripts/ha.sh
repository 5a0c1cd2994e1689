#!/usr/bin/env bash
# A highly available PostgreSQL 15 on loopback, the way teams run it: Patroni with one
# etcd member (v2 API), two nodes, synchronous_mode on, short TTLs for tests.
#   bash scripts/ha.sh start        # prints the environment (IDEMRPC_TEST_HA) to stdout
#   bash scripts/ha.sh stop
#   bash scripts/ha.sh leader       # the leader's node number (1 or 2), or nothing
#   bash scripts/ha.sh wait-leader  # waits (30 s at most) for a leader, prints it
#   bash scripts/ha.sh wait-sync    # waits (60 s at most) for a synchronous standby
#   bash scripts/ha.sh kill-leader  # kill -9 of every process of the leader's PostgreSQL
#   bash scripts/ha.sh pause-leader SECONDS   # SIGSTOP the leader's Patroni and PostgreSQL
#                                             # (every process), then SIGCONT
#   bash scripts/ha.sh switchover   # a planned switchover to the standby
#   bash scripts/ha.sh stop-standby | start-standby
# A fault prints "applied" once it has taken effect (a pause before it sleeps).
# Data lives in $IDEMRPC_HA_DIR (default /tmp/idemrpc-ha), removed by stop. As root,
# Patroni and PostgreSQL run as the "postgres" user (initdb refuses root).
# shared/notes/patroni-on-loopback.md says why the v2 API and these settings.
set -euo pipefail
DIR=${IDEMRPC_HA_DIR:-/tmp/idemrpc-ha}
BASE=${IDEMRPC_HA_PORT:-25540}        # PostgreSQL on BASE+1, BASE+2 (below the ephemeral ports)
REST=$((BASE + 2460))                 # Patroni REST API on REST+1, REST+2
ETCD=$((BASE + 2500))                 # etcd client port; peer ETCD+1
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)


node_yaml() { # node number
    local n=$1
    cat <<YAML
scope: idemrpc-ha
name: node$n
restapi:
  listen: 127.0.0.1:$((REST + n))
  connect_address: 127.0.0.1:$((REST + n))
etcd:
  host: 127.0.0.1:$ETCD
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 2
    retry_timeout: 5
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    primary_start_timeout: 0
    postgresql:
      use_pg_rewind: true
      use_slots: true
      remove_data_directory_on_rewind_failure: true
      parameters:
        wal_log_hints: 'on'
        fsync: 'off'
        max_connections: 200
  initdb:
    - auth: trust
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:$((BASE + n))
  connect_address: 127.0.0.1:$((BASE + n))
  data_dir: $DIR/node$n/data
  bin_dir: $PGBIN
  pgpass: $DIR/node$n/pgpass
  parameters:
    unix_socket_directories: '$DIR/node$n'
  authentication:
    superuser: {username: postgres}
    replication: {username: postgres}
tags: {nofailover: false, noloadbalance: false, clonefrom: false, nosync: false}
YAML
}

other() { [ "$1" = 1 ] && echo 2 || echo 1; }

http_code() { curl -s -o /dev/null -m 1 -w '%{http_code}' "http://127.0.0.1:$1$2" || true; }

# The node whose PostgreSQL accepts writes (asked of PostgreSQL itself: a Patroni that
# is about to notice it lost the lock may still say it leads).
leader() {
    for n in 1 2; do
        [ "$(psql "host=127.0.0.1 port=$((BASE + n)) user=postgres dbname=postgres connect_timeout=1" \
            -Atc 'SELECT pg_is_in_recovery()' 2>/dev/null)" = f ] &&
            [ "$(http_code $((REST + n)) /primary)" = 200 ] && { echo "$n"; return 0; }
    done
    return 0
}

wait_for() { # seconds, command...
    local s=$1
    shift
    for _ in $(seq $((s * 10))); do
        "$@" && return 0
        sleep 0.1
    done
    return 1
}

has_leader() { [ -n "$(leader)" ]; }
# A leader that takes writes and the other node its synchronous standby.
has_sync() {
    local l
    l=$(leader)
    [ -n "$l" ] && [ "$(http_code $((REST + $(other "$l"))) /sync)" = 200 ]
}

# Patroni is started so that the pid recorded is Patroni's own (setsid and setpriv exec;
# no wrapper process): kill and SIGSTOP must reach it.
start_node() {
    local n=$1
    mkdir -p "$DIR/node$n"
    [ "$(id -u)" -eq 0 ] && chown -R postgres "$DIR/node$n"
    node_yaml "$n" >"$DIR/node$n.yml"
    if [ "$(id -u)" -eq 0 ]; then
        setsid setpriv --reuid=postgres --regid=postgres --init-groups \
            patroni "$DIR/node$n.yml" >>"$DIR/node$n.log" 2>&1 &
    else
        setsid patroni "$DIR/node$n.yml" >>"$DIR/node$n.log" 2>&1 &
    fi
    echo $! >"$DIR/node$n.pid"
}

start() {
    command -v patroni >/dev/null || { echo "ha: patroni not installed" >&2; exit 1; }
    stop
    mkdir -p "$DIR/etcd"
    setsid etcd --name ha --data-dir "$DIR/etcd" --enable-v2=true \
        --listen-client-urls "http://127.0.0.1:$ETCD" --advertise-client-urls "http://127.0.0.1:$ETCD" \
        --listen-peer-urls "http://127.0.0.1:$((ETCD + 1))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD + 1))" \
        --initial-cluster "ha=http://127.0.0.1:$((ETCD + 1))" >"$DIR/etcd.log" 2>&1 &
    echo $! >"$DIR/etcd.pid"
    wait_for 20 curl -sf -m 1 "http://127.0.0.1:$ETCD/health" -o /dev/null ||
        { echo "ha: etcd did not start" >&2; tail "$DIR/etcd.log" >&2; stop; exit 1; }
    start_node 1
    wait_for 60 has_leader || { echo "ha: no leader" >&2; tail "$DIR/node1.log" >&2; stop; exit 1; }
    start_node 2
    wait_for 90 has_sync || { echo "ha: no sync standby" >&2; tail "$DIR/node2.log" >&2; stop; exit 1; }
    echo "export IDEMRPC_TEST_HA='host=127.0.0.1,127.0.0.1 port=$((BASE + 1)),$((BASE + 2)) user=postgres dbname=postgres target_session_attrs=read-write connect_timeout=2'"
    echo "export IDEMRPC_HA='bash $(cd "$(dirname "$0")" && pwd)/ha.sh'"
}

# The postmaster of node n (its data dir's postmaster.pid), if running.
postmaster() { head -n 1 "$DIR/node$1/data/postmaster.pid" 2>/dev/null || true; }
# Node n's PostgreSQL: the postmaster and every backend, walsender and worker under it.
pg_pids() {
    local pm
    pm=$(postmaster "$1")
    [ -n "$pm" ] && echo "$pm $(pgrep -P "$pm" | tr '\n' ' ')"
}

stop() {
    for n in 1 2; do
        [ -f "$DIR/node$n.pid" ] && kill -CONT "$(cat "$DIR/node$n.pid")" 2>/dev/null || true
        [ -f "$DIR/node$n.pid" ] && kill -9 "$(cat "$DIR/node$n.pid")" 2>/dev/null || true
        pm=$(postmaster "$n")
        [ -n "$pm" ] && { kill -CONT "$pm" 2>/dev/null; kill -9 "$pm" 2>/dev/null; } || true
    done
    [ -f "$DIR/etcd.pid" ] && kill -9 "$(cat "$DIR/etcd.pid")" 2>/dev/null || true
    pkill -9 -f "patroni $DIR/node" 2>/dev/null || true # whatever a pid file missed
    pkill -9 -f "postgres -D $DIR/" 2>/dev/null || true
    rm -rf "$DIR"
}

# The leader, waiting for one (30 s at most): a fault needs a target.
current_leader() { wait_for 30 has_leader && leader; }

case "${1:-}" in
start) start ;;
stop) stop ;;
leader) leader ;;
wait-leader) wait_for 30 has_leader && leader ;;
wait-sync) sleep 1; wait_for 60 has_sync ;; # a second first: a fault's news travels
kill-leader) # PostgreSQL crashes whole (every process of it); its Patroni lives on
    l=$(current_leader)
    [ -n "$l" ] || exit 1
    kill -9 $(pg_pids "$l") && echo applied
    ;;
pause-leader) # the whole node freezes (a VM pause): Patroni and every PostgreSQL process
    l=$(current_leader)
    [ -n "$l" ] || exit 1
    pids="$(cat "$DIR/node$l.pid") $(pg_pids "$l")"
    kill -STOP $pids
    echo applied
    sleep "${2:-15}"
    kill -CONT $pids
    ;;
switchover)
    l=$(current_leader)
    [ -n "$l" ] || exit 1
    curl -sf -m 30 -XPOST "http://127.0.0.1:$((REST + l))/switchover" \
        -d "{\"leader\": \"node$l\", \"candidate\": \"node$(other "$l")\"}" >/dev/null
    echo applied
    ;;
stop-standby)
    l=$(current_leader)
    s=$(other "${l:-1}")
    kill -9 "$(cat "$DIR/node$s.pid")" 2>/dev/null || true
    pm=$(postmaster "$s")
    [ -n "$pm" ] && kill -9 "$pm" || true
    echo applied
    ;;
start-standby)
    l=$(leader)
    start_node "$(other "${l:-1}")"
    ;;
*) echo "usage: bash scripts/ha.sh start|stop|leader|wait-leader|wait-sync|kill-leader|pause-leader S|switchover|stop-standby|start-standby" >&2; exit 2 ;;
esac

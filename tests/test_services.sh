#!/usr/bin/env bash
# scripts/services.sh with a directory and ports of its own: the IDEMRPC_SERVICES it
# prints carries them, so a test's `$IDEMRPC_SERVICES restart-nats` restarts THAT
# nats-server (a new pid in that directory) and starts none in the default directory.
#   test_services.sh SRCDIR
set -euo pipefail
src=$1
command -v nats-server >/dev/null || { echo "SKIP: no nats-server"; exit 77; }
[ "$(id -u)" -eq 0 ] || { echo "SKIP: services.sh starts PostgreSQL as root only"; exit 77; }
dir=$(mktemp -d /tmp/idemrpc-services-test-XXXXXX)
fail() { echo "FAIL: $*" >&2; exit 1; }
# Free ports: ask the kernel for 4, then release them for the servers.
read -r pg redis pgb nats < <(python3 -c 'import socket
ss=[socket.socket() for _ in range(4)]
[s.bind(("127.0.0.1",0)) for s in ss]
print(*[s.getsockname()[1] for s in ss])')
export IDEMRPC_SERVICES_DIR=$dir IDEMRPC_PG_PORT=$pg IDEMRPC_REDIS_PORT=$redis \
    IDEMRPC_PGBOUNCER_PORT=$pgb IDEMRPC_NATS_PORT=$nats
env_lines=$(bash "$src/scripts/services.sh" start)
default_nats() { pgrep -f -- "-sd /tmp/idemrpc-services/nats" | sort | tr '\n' ' ' || true; }
default_before=$(default_nats)
# On failure, also stop a nats-server the restart started in the default directory.
cleanup() {
    bash "$src/scripts/services.sh" stop
    rm -rf "$dir"
    for p in $(default_nats); do
        case " $default_before " in *" $p "*) ;; *) kill "$p" 2>/dev/null || true ;; esac
    done
}
trap cleanup EXIT
# What a test sees: only the printed environment, none of ours.
svc=$(eval "$env_lines"; echo "$IDEMRPC_SERVICES")
before=$(cat "$dir/nats.pid")
env -u IDEMRPC_SERVICES_DIR -u IDEMRPC_PG_PORT -u IDEMRPC_REDIS_PORT \
    -u IDEMRPC_PGBOUNCER_PORT -u IDEMRPC_NATS_PORT sh -c "$svc restart-nats"
after=$(cat "$dir/nats.pid" 2>/dev/null) || fail "restart-nats left no nats.pid in $dir"
[ "$after" != "$before" ] || fail "restart-nats did not restart the nats-server of $dir"
kill -0 "$after" 2>/dev/null || fail "the restarted nats-server ($after) is not running"
kill -0 "$before" 2>/dev/null && fail "the first nats-server ($before) still runs"
[ "$(default_nats)" = "$default_before" ] ||
    fail "restart-nats started a nats-server in the default directory"
sh -c "$svc stop-nats"
kill -0 "$after" 2>/dev/null && fail "stop-nats left nats-server $after running"
[ -f "$dir/nats.pid" ] && fail "stop-nats left $dir/nats.pid"
echo "ok: restart-nats restarted $before -> $after in $dir; stop-nats stopped it"
bash "$src/scripts/services.sh" stop

# The default ports lie below Linux's ephemeral range (32768-60999): no other program's
# outgoing connection can hold one as its source port.
defaults=$(env -u IDEMRPC_PG_PORT -u IDEMRPC_REDIS_PORT -u IDEMRPC_PGBOUNCER_PORT \
    -u IDEMRPC_NATS_PORT bash -c "$(sed -n '/^PG_PORT=/,/^NATS_PORT=/p' "$src/scripts/services.sh")
    echo \$PG_PORT \$REDIS_PORT \$PGB_PORT \$NATS_PORT")
for p in $defaults; do
    [ "$p" -lt 32768 ] || fail "default port $p lies in the ephemeral range"
done

# A port already taken: start refuses, naming it, and leaves nothing running.
python3 -c 'import socket,sys,time
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); time.sleep(60)' "$redis" &
holder=$!
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$redis") 2>/dev/null && break; sleep 0.05; done
rc=0
bash "$src/scripts/services.sh" start >"$dir.out" 2>"$dir.err" || rc=$?
kill "$holder"
[ "$rc" = 1 ] || fail "start with port $redis taken exited $rc: $(cat "$dir.err")"
grep -q "port $redis on 127.0.0.1 is in use" "$dir.err" || fail "no port named: $(cat "$dir.err")"
[ -d "$dir/pg" ] && fail "a refused start left a PostgreSQL data directory"
rm -f "$dir.out" "$dir.err"

# A parent directory PostgreSQL's user cannot enter: a clear error before anything starts.
locked=$(mktemp -d /tmp/idemrpc-locked-XXXXXX)
chmod 0700 "$locked"
rc=0
IDEMRPC_SERVICES_DIR=$locked/svc bash "$src/scripts/services.sh" start >/dev/null 2>"$locked.err" ||
    rc=$?
[ "$rc" = 1 ] || fail "start under a 0700 parent exited $rc: $(cat "$locked.err")"
grep -q "cannot reach $locked/svc" "$locked.err" || fail "unclear error: $(cat "$locked.err")"
rm -rf "$locked" "$locked.err"
echo "ok: default ports below the ephemeral range; a taken port and an unreachable directory refused clearly"

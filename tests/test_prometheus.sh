#!/usr/bin/env bash
# ops/grafana/idemrpc.json and ops/prometheus/idemrpc-alerts.yml against a real Prometheus
# scraping a real server: every panel's PromQL returns data, every alert's rule evaluates
# and its series exist; IdemrpcDown, IdemrpcLeaseLapsed and IdemrpcLeaseTakenOver fire on
# faults injected for real (SIGSTOP past the lease, kill -9 during a call), and with
# $IDEMRPC_TEST_NATS (the demo's consumer and relay, --nats) IdemrpcDeadLetters on a
# message without a key; promtool fires every alert from synthetic series
# (ops/prometheus/idemrpc-alerts.test.yml). Without $IDEMRPC_TEST_NATS the broker's
# series (idem_nats_*, idem_relay_*) are not checked.
#   test_prometheus.sh SOURCE_ROOT   (IDEMRPC_PROMETHEUS_PORT: the port to use)
. "$(dirname "$0")/demo_env.sh"
ops=$1/ops
for p in prometheus promtool curl; do
    command -v "$p" >/dev/null || { echo "SKIP: $p missing (apt-get install prometheus)"; exit 77; }
done
promtool check rules "$ops/prometheus/idemrpc-alerts.yml" >/dev/null || fail "promtool check rules"
(cd "$ops/prometheus" && promtool test rules idemrpc-alerts.test.yml) >"$work/promtool.out" 2>&1 ||
    { cat "$work/promtool.out"; fail "promtool test rules"; }

broker=()
[ -n "${IDEMRPC_TEST_NATS:-}" ] && broker=(--nats "$IDEMRPC_TEST_NATS")
# Queries and series of the broker's consumer and relay: only with a broker.
broker_only() { [ ${#broker[@]} = 0 ] && grep -q 'idem_nats_\|idem_relay_' <<<"$1"; }
# A plain NATS publish: no headers, so no key: the demo's consumer dead-letters it.
nats_publish() {
    local hp=${IDEMRPC_TEST_NATS#nats://} line
    hp=${hp%%,*}
    exec 3<>"/dev/tcp/${hp%:*}/${hp##*:}" || fail "nats-server at $hp unreachable"
    printf 'CONNECT {"verbose":false}\r\nPUB %s %d\r\n%s\r\nPING\r\n' "$1" "${#2}" "$2" >&3
    for _ in $(seq 20); do
        IFS= read -r -t 5 line <&3 || break
        [[ $line == PONG* ]] && break
    done
    exec 3>&-
    [[ $line == PONG* ]] || fail "nats-server did not take the publish"
}

prom_pid=
# Prometheus stops before its directory goes; a demo stopped by the test (SIGSTOP) is
# continued first, or it would never take the TERM.
trap '[ -n "$prom_pid" ] && kill "$prom_pid" 2>/dev/null && wait "$prom_pid" 2>/dev/null
      [ -n "$demo" ] && kill -CONT "$demo" 2>/dev/null; cleanup' EXIT

# run_demo HTTP_PORT [flags...]: a demo on $work/db serving HTTP on that port.
run_demo() {
    local port=$1; shift
    "$IDEMRPC_DEMO" --listen "ipc://$work/demo.sock" --http "http://127.0.0.1:$port" \
        --db "$work/db" --lease-ms 1000 --sweep-interval-ms 300 "${broker[@]}" "$@" \
        >"$work/demo.out" 2>>"$work/demo.err" &
    demo=$!
    await grep -q listening "$work/demo.out"
    http="http://127.0.0.1:$(awk '/http on port/ {print $5}' "$work/demo.out")"
}
# (Each answer is read whole before grep -q looks: under pipefail, a grep that stops
# early would fail the pipe with curl's SIGPIPE.)
metric() { local m; m=$(curl -sf -m 5 "$http/metrics") && grep -q "^$1" <<<"$m"; }
# Prometheus's answer to one PromQL query (instant, now).
query() { curl -sf -m 5 -G "$prom/api/v1/query" --data-urlencode "query=$1"; }
has_data() { local r; r=$(query "$1") && grep -q '"result":\[{' <<<"$r"; }
firing() { has_data "ALERTS{alertname=\"$1\",alertstate=\"firing\"}"; }
post() { curl -s -m 30 -o /dev/null -w '%{http_code}' -X POST --data "$2" -H "Idempotency-Key: $1" "$http/demo.Counter/Add"; }

run_demo 0
port=${http##*:}
# The metrics this item added, on the server itself (the sweeper has read the store once).
await metric 'idem_outbox_pending 0'
for m in 'idem_lease_lapses_total 0' 'idem_lease_takeovers_total 0' 'idem_store_records{state="in_progress"} 0' \
    'idem_outbox_oldest_age_seconds 0.000' 'idem_store_size_bytes [1-9]' 'idem_store_used_bytes [1-9]'; do
    metric "$m" || fail "/metrics lacks '$m': $(curl -sf -m 5 "$http/metrics")"
done
if [ ${#broker[@]} -gt 0 ]; then
    for m in 'idem_nats_deliveries_total{consumer="demo-ledger"} ' \
        'idem_nats_dead_letters_total{consumer="demo-ledger"} ' 'idem_relay_published_total{relay="demo"} '; do
        metric "$m" || fail "/metrics lacks '$m': $(curl -sf -m 5 "$http/metrics")"
    done
fi

# Prometheus on loopback, scraping every second, with the alert rules' `for:` cut to 0s.
sed 's/^\( *\)for: .*/\1for: 0s/' "$ops/prometheus/idemrpc-alerts.yml" >"$work/alerts.yml"
cat >"$work/prometheus.yml" <<YML
global: {scrape_interval: 1s, scrape_timeout: 500ms, evaluation_interval: 1s}
rule_files: [alerts.yml]
scrape_configs:
  - job_name: idemrpc
    static_configs: [{targets: ['127.0.0.1:$port']}]
YML
# A port below Linux's ephemeral range, drawn again when another program holds it.
prom_ready() { kill -0 "$prom_pid" 2>/dev/null || return 0; curl -sf -m 5 "$prom/-/ready"; }
for _ in 1 2 3 4 5; do
    pport=${IDEMRPC_PROMETHEUS_PORT:-$((20000 + RANDOM % 10000))}
    prom=http://127.0.0.1:$pport
    prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
        --web.listen-address="127.0.0.1:$pport" --log.level=warn >"$work/prom.log" 2>&1 &
    prom_pid=$!
    await prom_ready
    kill -0 "$prom_pid" 2>/dev/null && break
    wait "$prom_pid" || true
    prom_pid=
done
[ -n "$prom_pid" ] || { cat "$work/prom.log"; fail "prometheus did not start"; }
await has_data 'up{job="idemrpc"} == 1'

# Load: new keys, their retries (replays) and a reused key with another body (rejected).
for i in $(seq 40); do
    s=$(post "k$((i % 15))" 1)
    [ "$s" = 200 ] || fail "call $i answered $s"
done
[ "$(post k1 2)" = 422 ] || fail "a reused key was not refused"
await has_data 'increase(idem_calls_total{outcome="replayed"}[1m]) > 0'
await has_data 'increase(idem_calls_total{outcome="rejected"}[1m]) > 0'

# Every panel's query returns data (Grafana's variables: this job, a 1m rate window).
n=0
while IFS= read -r e; do
    e=$(sed -e 's/\\"/"/g' -e 's/\$__rate_interval/1m/g' -e 's/\$job/idemrpc/g' <<<"$e")
    broker_only "$e" && continue
    out=$(query "$e") || fail "panel query refused: $e"
    grep -q '"result":\[{' <<<"$out" || fail "panel query returned no data: $e: $out"
    grep -q '"NaN"' <<<"$out" && fail "panel query returned NaN: $e: $out"
    n=$((n + 1))
done < <(sed -n 's/^ *"expr": "\(.*\)",$/\1/p' "$ops/grafana/idemrpc.json")
[ "$n" -ge $((${#broker[@]} ? 21 : 15)) ] || fail "only $n panel queries found in idemrpc.json"

# Every alert rule evaluated without an error, and every series it reads exists.
rules_evaluated() {
    local r; r=$(curl -sf -m 5 "$prom/api/v1/rules") && ! grep -q '"health":"\(err\|unknown\)"' <<<"$r"
}
await rules_evaluated
rules=$(curl -sf -m 5 "$prom/api/v1/rules")
[ "$(grep -o '"type":"alerting"' <<<"$rules" | wc -l)" = "$(grep -c -- '- alert:' "$work/alerts.yml")" ] ||
    fail "not every alert rule is loaded: $rules"
for m in $(sed -n 's/^ *expr: //p' "$work/alerts.yml" | grep -o '\b\(idem_[a-z_]*\|up\)\b' | sort -u); do
    broker_only "$m" && continue
    has_data "$m{job=\"idemrpc\"}" || fail "alert series $m has no data"
done

# A message the consumer cannot key: a dead letter (IdemrpcDeadLetters; the series was
# scraped before it, above).
if [ ${#broker[@]} -gt 0 ]; then
    nats_publish demo.events poison
    await firing IdemrpcDeadLetters
fi

# A call running past its lease on a stalled server: the scrape fails (IdemrpcDown) and,
# once it runs again, its lease had lapsed (IdemrpcLeaseLapsed).
kill "$demo" && wait "$demo" || true
run_demo "$port" --delay-ms 4000
post slow-1 1 >/dev/null &
await metric 'idem_in_flight 1'
kill -STOP "$demo"
await firing IdemrpcDown
sleep 1.2 # the stall itself (the fault, not a wait): longer than the 1 s lease
kill -CONT "$demo"
await firing IdemrpcLeaseLapsed
wait $! || true
# A server killed during a call: its restart takes the key over (IdemrpcLeaseTakenOver).
post slow-2 1 >/dev/null &
await metric 'idem_in_flight 1'
kill -9 "$demo" && wait "$demo" 2>/dev/null || true
run_demo "$port" --delay-ms 0
[ "$(post slow-2 1)" = 200 ] || fail "the retry of the killed call failed"
await firing IdemrpcLeaseTakenOver
echo "ok: $n panel queries answered, every alert rule evaluates," \
    "$((${#broker[@]} ? 4 : 3)) alerts fired on real faults"

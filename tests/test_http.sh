#!/usr/bin/env bash
# The HTTP front against curl: replay, 422, 400, 409, token flow, oversize body, metrics.
. "$(dirname "$0")/demo_env.sh"
command -v curl >/dev/null || { echo "SKIP: curl missing"; exit 77; }
start_demo --delay-ms 0 --max-wait-ms 300

# post PATH BODY [curl args...]: prints "STATUS" then headers+body into $work/resp
post() {
    local path=$1 body=$2; shift 2
    curl -s -o "$work/body" -D "$work/headers" -w '%{http_code}' -X POST \
        --data-binary "$body" "$@" "$http/$path"
}
header() { grep -i "^$1:" "$work/headers" | cut -d' ' -f2- | tr -d '\r'; }

s=$(post demo.Counter/Add 5 -H 'Idempotency-Key: "order-1"')
[ "$s" = 200 ] || fail "first call: $s"
[ "$(cat "$work/body")" = 5 ] || fail "first body: $(cat "$work/body")"
[ -z "$(header Idempotent-Replayed)" ] || fail "first call marked replayed"
[ -n "$(header X-Request-Id)" ] || fail "no X-Request-Id"

s=$(post demo.Counter/Add 5 -H 'Idempotency-Key: order-1')
[ "$s" = 200 ] && [ "$(cat "$work/body")" = 5 ] || fail "replay: $s $(cat "$work/body")"
[ "$(header Idempotent-Replayed)" = true ] || fail "replay not marked"
[ -n "$(header Idem-First-At)" ] || fail "replay without Idem-First-At"

s=$(post demo.Counter/Add 6 -H 'Idempotency-Key: order-1')
[ "$s" = 422 ] || fail "key reuse: $s"
grep -q '"code":"INVALID_ARGUMENT"' "$work/body" || fail "422 body: $(cat "$work/body")"
grep -q '"request_id":"' "$work/body" || fail "422 body without request_id"

s=$(post demo.Counter/Add 6)
[ "$s" = 400 ] || fail "missing key: $s"
grep -q 'requires an idempotency key' "$work/body" || fail "400 body: $(cat "$work/body")"

s=$(post demo.Counter/Get "")
[ "$s" = 200 ] && [ "$(cat "$work/body")" = 5 ] || fail "total after replays: $(cat "$work/body")"

s=$(post no.Such/Method "")
[ "$s" = 404 ] || fail "unknown method: $s"

# Token flow: issue, submit, double submit replays, another caller is refused.
s=$(post idem.Token/Issue "" -H 'X-Caller: shop')
[ "$s" = 200 ] || fail "token issue: $s"
token=$(sed -n 's/.*"token":"\([^"]*\)".*/\1/p' "$work/body")
[ ${#token} -ge 22 ] || fail "token: $(cat "$work/body")"
s=$(post demo.Order/Submit "" -H 'X-Caller: other' -H "Idem-Token: $token")
[ "$s" = 403 ] || fail "token of another caller: $s"
s=$(post demo.Order/Submit "" -H 'X-Caller: shop' -H "Idem-Token: $token")
[ "$s" = 200 ] || fail "submit: $s"
order=$(cat "$work/body")
s=$(post demo.Order/Submit "" -H 'X-Caller: shop' -H "Idem-Token: $token")
[ "$s" = 200 ] && [ "$(cat "$work/body")" = "$order" ] || fail "double submit: $s"
[ "$(header Idempotent-Replayed)" = true ] || fail "double submit not replayed"
s=$(post demo.Order/Submit "" -H 'X-Caller: shop' -H "Idem-Token: not-a-token")
[ "$s" = 400 ] || fail "unknown token: $s"

# Oversize body (limit 4 MiB): a clear 4xx, the server keeps serving.
head -c $((4 * 1024 * 1024 + 10)) /dev/zero | tr '\0' 1 >"$work/big"
s=$(curl -s -o "$work/body" -w '%{http_code}' -X POST --data-binary @"$work/big" \
    -H 'Idempotency-Key: big' "$http/demo.Counter/Add")
[ "$s" = 413 ] || fail "oversize body: $s"

# 409: a duplicate that outwaits --max-wait-ms while the first call still runs.
kill "$demo"; wait "$demo" 2>/dev/null || true
start_demo --delay-ms 3000 --max-wait-ms 200
curl -s -o /dev/null -X POST --data 1 -H 'Idempotency-Key: slow' "$http/demo.Counter/Add" &
first=$!
await sh -c "curl -s '$http/metrics' | grep -q '^idem_in_flight 1'"
s=$(post demo.Counter/Add 1 -H 'Idempotency-Key: slow')
[ "$s" = 409 ] || fail "in-progress duplicate: $s"
[ -n "$(header Retry-After)" ] || fail "409 without Retry-After"
wait "$first"

curl -s "$http/metrics" >"$work/metrics"
grep -q '^idem_rejected_total{reason="in_progress"} 1' "$work/metrics" || fail "metrics: $(cat "$work/metrics")"
grep -q '^idem_calls_total{outcome="executed"} 1' "$work/metrics" || fail "metrics executed"
echo "test_http: all checks passed"

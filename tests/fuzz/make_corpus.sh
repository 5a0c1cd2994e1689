#!/usr/bin/env bash
# Writes the seed corpus of fuzz_envelope into tests/fuzz/corpus/ (replacing it): valid
# idem.v1.Requests for every method the target registers, encoded by protoc from text
# format, and malformed frames written byte by byte. Deterministic: running it again
# gives the same files.
#   bash tests/fuzz/make_corpus.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
proto_dir=$here/../../proto
out=$here/corpus

rm -rf "$out"
mkdir -p "$out"

# enc NAME TEXT: NAME.bin is the Request given in protobuf text format.
enc() {
    printf '%s' "$2" | protoc -I"$proto_dir" --encode=idem.v1.Request idemrpc.proto \
        >"$out/$1.bin"
}
# raw NAME PRINTF_FORMAT: NAME.bin holds exactly these bytes.
raw() {
    # shellcheck disable=SC2059 # the format is the data
    printf "$2" >"$out/$1.bin"
}

future=4102444800000 # 2100-01-01, unix ms

# ---- one valid request per method and flag ----
enc charge "method: 'fuzz.Ledger/Charge' idempotency_key: 'order-981:charge'
  caller: 'checkout' attempt: 1 deadline_unix_ms: $future payload: '100'
  metadata { key: 'x-trace' value: 'abc' }"
enc charge-retry "method: 'fuzz.Ledger/Charge' idempotency_key: 'order-981:charge'
  caller: 'checkout' attempt: 2 deadline_unix_ms: $future payload: '100'
  request_id: 'req-0001'"
enc charge-key-reused "method: 'fuzz.Ledger/Charge' idempotency_key: 'order-981:charge'
  caller: 'checkout' attempt: 1 payload: '250'"
enc charge-metadata-key "method: 'fuzz.Ledger/Charge' payload: '7'
  metadata { key: 'idempotency-key' value: 'meta-key-1' }
  metadata { key: 'x-request-id' value: 'trace-42' }"
enc charge-no-key "method: 'fuzz.Ledger/Charge' payload: '5'"
enc get "method: 'fuzz.Counter/Get' caller: 'reporting' attempt: 1"
enc get-failing "method: 'fuzz.Counter/Get' payload: '\\x0d internal'"
enc submit-token "method: 'fuzz.Order/Submit' token: 'fuzz-token-anon' payload: 'cart-1'"
enc submit-token-caller "method: 'fuzz.Order/Submit' token: 'fuzz-token-svc'
  caller: 'svc.checkout' payload: 'cart-2' attempt: 1"
enc submit-token-wrong-caller "method: 'fuzz.Order/Submit' token: 'fuzz-token-svc'
  caller: 'svc.other' payload: 'cart-3'"
enc submit-token-expired "method: 'fuzz.Order/Submit' token: 'fuzz-token-expired'"
enc submit-no-token "method: 'fuzz.Order/Submit' payload: 'cart-4'"
enc transfer "method: 'fuzz.Account/Transfer' idempotency_key: 'tx-1' caller: 'bank'
  payload: 'acct-1:+10' attempt: 1 deadline_unix_ms: $future"
enc transfer-final-error "method: 'fuzz.Account/Transfer' idempotency_key: 'tx-2'
  payload: '\\x09 insufficient balance'"
enc transfer-transient "method: 'fuzz.Account/Transfer' idempotency_key: 'tx-3'
  payload: '\\x0e unavailable'"
enc callback-extracted-key "method: 'fuzz.Pay/Callback' payload: 'T-1001'
  caller: 'alipay-notify' deadline_unix_ms: 1"
enc shortlived-released "method: 'fuzz.Cache/ShortLived' idempotency_key: 'ttl-1'
  payload: '\\x05'"
enc token-issue "method: 'idem.Token/Issue' caller: 'svc.checkout'"
enc unknown-method "method: 'nope.Svc/Missing' idempotency_key: 'k'"

# ---- bounds ----
meta=""
for i in $(seq 1 65); do meta+="metadata { key: 'm$i' value: 'v$i' } "; done
enc metadata-65 "method: 'fuzz.Counter/Get' $meta"
enc key-256 "method: 'fuzz.Ledger/Charge' idempotency_key: '$(printf 'k%.0s' $(seq 1 256))'"

# ---- malformed frames ----
raw empty ''
head -c 23 "$out/charge.bin" >"$out/truncated.bin"
raw garbage '\xde\xad\xbe\xef\x00\xff\x13\x37\x80\x80\x80\x80\x01\x7f'
# Fields repeated: protobuf merges, the last method and key win.
cat "$out/get.bin" "$out/charge.bin" >"$out/duplicate-fields.bin"
# method (field 1) with a 2^32-1 byte length prefix.
raw huge-length '\x0a\xff\xff\xff\xff\x0f'
# method "fuzz.Counter/Get", idempotency_key "k\xff\xfe".
raw invalid-utf8 '\x0a\x10fuzz.Counter/Get\x12\x03k\xff\xfe'
# method "fuzz.Counter/Get", idempotency_key "a\0b".
raw embedded-nul '\x0a\x10fuzz.Counter/Get\x12\x03a\x00b'

echo "make_corpus: $(find "$out" -type f | wc -l) files in $out"

# ---- HTTP requests (the HTTP front's translation first) ----
raw http-charge 'HTTP\n/fuzz.Ledger/Charge\nIdempotency-Key: "order-981:charge"\nX-Caller: checkout\n\n100'
raw http-two-keys 'HTTP\n/fuzz.Ledger/Charge\nIdempotency-Key: a\nIdempotency-Key: b\n\n100'
raw http-key-list 'HTTP\n/fuzz.Ledger/Charge\nIdempotency-Key: "a", "b"\n\n100'
raw http-key-params 'HTTP\n/fuzz.Ledger/Charge\nIdempotency-Key: "k";p=1\nX-Request-Id: x","code":"OK\n\n1'
raw http-token 'HTTP\n/fuzz.Order/Submit\nIdem-Token: fuzz-token-anon\n\n{}'
# found by the fuzzer: a quoted key ending in a backslash read past the header's end
raw http-trailing-backslash 'HTTP\n/fuzz.Ledger/Charge\nIdempotency-Key: "abc\\\n\n1'

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

# ---- HTTP connections: "HTTP\n", then the raw bytes (the front's strict parser first) ----
H='POST /fuzz.Ledger/Charge HTTP/1.1\r\nHost: x\r\n'
raw http-charge "HTTP\n${H}"'Idempotency-Key: "order-981:charge"\r\nX-Caller: checkout\r\nContent-Length: 3\r\n\r\n100'
raw http-two-keys "HTTP\n${H}"'Idempotency-Key: a\r\nIdempotency-Key: b\r\nContent-Length: 3\r\n\r\n100'
raw http-key-list "HTTP\n${H}"'Idempotency-Key: "a", "b"\r\nContent-Length: 3\r\n\r\n100'
raw http-key-params "HTTP\n${H}"'Idempotency-Key: "k";p=1\r\nX-Request-Id: x","code":"OK\r\nContent-Length: 1\r\n\r\n1'
raw http-token 'HTTP\nPOST /fuzz.Order/Submit HTTP/1.1\r\nHost: x\r\nIdem-Token: fuzz-token-anon\r\nContent-Length: 2\r\n\r\n{}'
# found by the fuzzer: a quoted key ending in a backslash read past the header's end
raw http-trailing-backslash "HTTP\n${H}"'Idempotency-Key: "abc\\\r\nContent-Length: 1\r\n\r\n1'
# found by the fuzzer: an absolute-form target was searched as a string past its end
raw http-absolute-form 'HTTP\nPOST http://x/fuzz.Ledger/Charge HTTP/1.1\r\nHost: x\r\nIdempotency-Key: abs\r\nContent-Length: 3\r\n\r\n100'
raw http-chunked "HTTP\n${H}"'Idempotency-Key: ch\r\nTransfer-Encoding: chunked\r\n\r\n2;e=1\r\n10\r\n1\r\n0\r\n0\r\nT: v\r\n\r\n'
raw http-pipelined "HTTP\n${H}"'Idempotency-Key: p1\r\nContent-Length: 1\r\n\r\n1'"${H}"'Idempotency-Key: p2\r\nContent-Length: 1\r\n\r\n2'
raw http-cl-te "HTTP\n${H}"'Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n'"${H}"'Idempotency-Key: hidden\r\nContent-Length: 3\r\n\r\n100'
raw http-obs-fold "HTTP\n${H}"'X-A: b\r\n Transfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n'
raw http-bare-lf "HTTP\nPOST /fuzz.Ledger/Charge HTTP/1.1\nHost: x\n\n"

echo "make_corpus: $(find "$out" -type f | wc -l) files in $out"

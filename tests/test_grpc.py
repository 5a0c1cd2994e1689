"""Cases of tests/test_grpc.c: Debian's python3-grpcio against the gRPC front.

    /usr/bin/python3 tests/test_grpc.py CASE PORT [CA KEY CERT]   (the TLS cases: all three)
    /usr/bin/python3 tests/test_grpc.py signed PORT [CALLER KEY SIGNATURE TIMESTAMP WANT]...

Each case makes its calls with grpc's own client (raw bytes, no generated code) and
exits 0 when every answer is what the front promises; otherwise it prints what differed
and exits 1. The C test counts the handler's runs and opens the gate of t.Gate/Do. """
import json
import sys
import threading

import grpc

ADD, GATE, HEALTH = "/t.Count/Add", "/t.Gate/Do", "/grpc.health.v1.Health/Check"
DEBIT = "/t.Pay/Debit"
LONG = 20  # seconds: a bound, never a synchronisation


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def expect(cond, msg):
    if not cond:
        fail(msg)


def trailers(call):
    return dict(call.trailing_metadata() or ())


def channel(port, options=()):
    return grpc.insecure_channel("127.0.0.1:%d" % port, options=list(options))


def call(ch, method, payload, key, timeout=LONG):
    md = [("idempotency-key", key)] if key else []
    return ch.unary_unary(method).with_call(payload, metadata=md, timeout=timeout)


def expect_code(fn, code):
    try:
        fn()
    except grpc.RpcError as e:
        expect(e.code() == code, "expected %s, got %s: %s" % (code, e.code(), e.details()))
        return e
    fail("expected %s, got OK" % code)


def plain(port):
    r, c = call(channel(port), ADD, b"5", "plain-1")
    expect(r == b"run=1 payload=5", "answer %r" % r)
    t = trailers(c)
    expect(len(t.get("x-request-id", "")) > 0, "no x-request-id in %r" % t)
    expect("idempotent-replayed" not in t, "a first run marked replayed: %r" % t)


def replay(port):
    ch = channel(port)
    first, _ = call(ch, ADD, b"5", "replay-1")
    again, c = call(ch, ADD, b"5", "replay-1")
    t = trailers(c)
    expect(again == first, "replay %r, first %r" % (again, first))
    expect(t.get("idempotent-replayed") == "true", "not marked replayed: %r" % t)
    expect(t.get("idem-first-at", "").isdigit(), "no idem-first-at: %r" % t)


def key_reused(port):
    ch = channel(port)
    call(ch, ADD, b"5", "reuse-1")
    e = expect_code(lambda: call(ch, ADD, b"6", "reuse-1"), grpc.StatusCode.INVALID_ARGUMENT)
    expect("reused" in e.details(), "details %r" % e.details())


def parallel(fns):
    """Runs each fn on a thread; returns their results (or exceptions)."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            out[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(LONG + 5)
    return out


def one_first_result(results):
    for r in results:
        expect(not isinstance(r, Exception), "a call failed: %r" % (r,))
    answers = {r[0] for r in results}
    expect(answers == {b"run=1 payload=g"}, "answers %r" % (answers,))
    replayed = [trailers(r[1]).get("idempotent-replayed") == "true" for r in results]
    expect(replayed.count(True) == len(results) - 1, "replayed %r" % replayed)


def duplicate_waits(port):
    ch = channel(port)
    one_first_result(parallel([lambda: call(ch, GATE, b"g", "dup-1")] * 2))


def hedged(port):
    """Two channels (two connections) send the same call at once, as hedging does."""
    chs = [channel(port), channel(port)]
    one_first_result(parallel([lambda ch=ch: call(ch, GATE, b"g", "hedge-1") for ch in chs]))


def deadline(port):
    ch = channel(port)
    expect_code(lambda: call(ch, GATE, b"g", "deadline-1", timeout=0.3),
                grpc.StatusCode.DEADLINE_EXCEEDED)
    r, c = call(ch, GATE, b"g", "deadline-1")  # the caller's own retry, same key
    expect(r == b"run=1 payload=g", "retry answered %r" % r)
    expect(trailers(c).get("idempotent-replayed") == "true", "retry not a replay")


def retry_policy(port):
    """The server answers DEADLINE_EXCEEDED after its max_run_ms; grpc's retryPolicy
    retries with the same metadata until the first run's result comes back."""
    config = {"methodConfig": [{"name": [{"service": "t.Gate"}], "retryPolicy": {
        "maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "0.2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE", "DEADLINE_EXCEEDED"]}}]}
    ch = channel(port, [("grpc.enable_retries", 1),
                        ("grpc.service_config", json.dumps(config))])
    r, c = call(ch, GATE, b"g", "retry-1")
    expect(r == b"run=1 payload=g", "answered %r" % r)
    expect(trailers(c).get("idempotent-replayed") == "true", "the answer is not the replay")


def health(port):
    r = channel(port).unary_unary(HEALTH)(b"", timeout=LONG)
    expect(r == b"\x08\x01", "health %r (want SERVING)" % r)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def tls(port, ca, key, cert):
    """grpc's TLS (ALPN h2) with a client certificate: a call, then its replay."""
    creds = grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
    ch = grpc.secure_channel("localhost:%d" % port, creds)
    r, _ = call(ch, ADD, b"5", "tls-1")
    expect(r == b"run=1 payload=5", "answer %r" % r)
    again, c = call(ch, ADD, b"5", "tls-1")
    expect(again == r and trailers(c).get("idempotent-replayed") == "true", "no replay")


def tls_no_cert(port, ca, key, cert):
    ch = grpc.secure_channel("localhost:%d" % port, grpc.ssl_channel_credentials(read(ca)))
    expect_code(lambda: call(ch, ADD, b"5", "tls-2", timeout=5), grpc.StatusCode.UNAVAILABLE)


def signed(port, *calls):
    """Calls of t.Pay/Debit (message b"5") on one channel, five arguments each: CALLER
    KEY SIGNATURE TIMESTAMP WANT, sent as metadata x-caller, idempotency-key,
    idem-signature and idem-timestamp (an empty SIGNATURE: unsigned, neither sent). WANT
    is "ok ANSWER" (a first run), "replay ANSWER" (the stored result, marked replayed) or
    "CODE TEXT" (the status code's name, TEXT a part of its details)."""
    ch = channel(port)
    expect(len(calls) % 5 == 0, "calls come in fives: %r" % (calls,))
    for i in range(0, len(calls), 5):
        caller, key, sig, ts, want = calls[i:i + 5]
        md = [("x-caller", caller), ("idempotency-key", key)]
        if sig:
            md += [("idem-signature", sig), ("idem-timestamp", ts)]
        kind, _, text = want.partition(" ")

        def send(md=md):
            return ch.unary_unary(DEBIT).with_call(b"5", metadata=md, timeout=LONG)

        if kind in ("ok", "replay"):
            try:
                r, c = send()
            except grpc.RpcError as e:
                fail("call %d: %s %s, want %r" % (i // 5 + 1, e.code(), e.details(), want))
            replayed = trailers(c).get("idempotent-replayed") == "true"
            expect(r.decode() == text and replayed == (kind == "replay"),
                   "call %d: %r replayed=%s, want %r" % (i // 5 + 1, r, replayed, want))
            print("call %d: %s%s" % (i // 5 + 1, r.decode(), " (replayed)" if replayed else ""))
        else:
            e = expect_code(send, getattr(grpc.StatusCode, kind))
            expect(text in e.details(), "call %d: details %r, want %r" % (i // 5 + 1,
                                                                          e.details(), text))
            print("call %d: %s %s" % (i // 5 + 1, e.code().name, e.details()))


PLAIN = (plain, replay, key_reused, duplicate_waits, hedged, deadline, retry_policy, health)
CASES = {f.__name__: f for f in PLAIN + (tls, tls_no_cert, signed)}

if __name__ == "__main__":
    name, port = sys.argv[1], int(sys.argv[2])
    CASES[name](port, *(sys.argv[3:] if CASES[name] not in PLAIN else ()))
    print("ok", sys.argv[1])

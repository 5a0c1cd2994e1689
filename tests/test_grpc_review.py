"""Cases of tests/test_grpc_review.c: what a reviewer found the gRPC front breaking.

    /usr/bin/python3 tests/test_grpc_review.py CASE PORT [TLSDIR]

Each case exits 0 when the answer is what docs/deploying.md "gRPC" promises, else prints
what differed and exits 1."""
import os
import socket
import ssl
import sys
import threading
import time

import grpc

META, GATE, LEN = "/t.Meta/Set", "/t.Gate/Do", "/t.Len/Get"
HEALTH = "/grpc.health.v1.Health/Check"
LONG = 20


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def ch(port):
    return grpc.insecure_channel("127.0.0.1:%d" % port)


def meta_call(port, payload, key):
    """(code, trailers) of t.Meta/Set: payload "CODE|name=value|..."."""
    try:
        _, c = ch(port).unary_unary(META).with_call(
            payload.encode(), metadata=[("idempotency-key", key)], timeout=LONG)
        return grpc.StatusCode.OK, dict(c.trailing_metadata() or ())
    except grpc.RpcError as e:
        return e.code(), dict(e.trailing_metadata() or ())


def meta_status(port):
    code, t = meta_call(port, "13|grpc-status=0", "status-1")
    if code != grpc.StatusCode.INTERNAL:
        fail("a failed call (INTERNAL) answered %s, trailers %r" % (code, t))
    code, t = meta_call(port, "0|grpc-status=13|grpc-message=x", "status-2")
    if code != grpc.StatusCode.OK:
        fail("an OK call answered %s, trailers %r" % (code, t))


def meta_replayed(port):
    code, t = meta_call(port, "0|idempotent-replayed=true", "replayed-1")
    if code != grpc.StatusCode.OK or "idempotent-replayed" in t:
        fail("a first run answered %s marked replayed: %r" % (code, t))


def meta_case(port):
    code, t = meta_call(port, "0|Order-Id=42", "case-1")
    if code != grpc.StatusCode.OK or t.get("order-id") != "42":
        fail("the handler's Order-Id=42 did not arrive (%s): %r" % (code, t))


def meta_bin(port):
    code, t = meta_call(port, "0|trace-bin=@@@", "bin-1")
    if code != grpc.StatusCode.OK or t.get("trace-bin") != b"@@@":
        fail("the handler's trace-bin=@@@: %s, trailers %r" % (code, t))


def health_closing(port):
    """A call holds the server while it closes: once calls are refused UNAVAILABLE, the
    health check must not answer SERVING."""
    c = ch(port)
    threading.Thread(target=lambda: c.unary_unary(GATE)(
        b"g", metadata=[("idempotency-key", "held")], timeout=LONG), daemon=True).start()
    for i in range(400):
        try:
            c.unary_unary(LEN)(b"x", metadata=[("idempotency-key", "probe-%d" % i)],
                               timeout=LONG)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                break
        time.sleep(0.05)
    else:
        fail("the server never refused a call")
    r = c.unary_unary(HEALTH)(b"", timeout=LONG)
    if r == b"\x08\x01":
        fail("health answers SERVING while the server refuses every call UNAVAILABLE")
    print("health", r)
    os._exit(0)


def max_frame(port):
    limit = int(os.environ["MAX_FRAME"])
    for n, want in ((limit - 40, grpc.StatusCode.OK), (limit, grpc.StatusCode.OK),
                    (limit + 1, grpc.StatusCode.RESOURCE_EXHAUSTED)):
        try:
            r = ch(port).unary_unary(LEN)(b"m" * n, metadata=[("idempotency-key", "mf-%d" % n)],
                                          timeout=LONG)
            got, details = grpc.StatusCode.OK, r
        except grpc.RpcError as e:
            got, details = e.code(), e.details()
        if got != want:
            fail("a message of %d bytes (max_frame %d): %s %r, want %s" % (n, limit, got,
                                                                            details, want))


def no_alpn(port, tlsdir):
    """A TLS client with a valid certificate that offers no ALPN at all."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(os.path.join(tlsdir, "sca.crt"))
    ctx.load_cert_chain(os.path.join(tlsdir, "client.crt"), os.path.join(tlsdir, "client.key"))
    s = socket.create_connection(("127.0.0.1", port), timeout=LONG)
    try:
        t = ctx.wrap_socket(s, server_hostname="localhost")
        t.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9))
        frame = t.recv(9)
    except (ssl.SSLError, OSError):
        return  # refused: the handshake (or the connection) ends
    if len(frame) > 0:
        fail("a client offering no ALPN h2 was served HTTP/2 (frame type %d)" % frame[3])


CASES = {f.__name__: f for f in (meta_status, meta_replayed, meta_case, meta_bin,
                                 health_closing, max_frame, no_alpn)}

if __name__ == "__main__":
    CASES[sys.argv[1]](int(sys.argv[2]), *[a for a in sys.argv[3:] if a])
    print("ok", sys.argv[1])

/* Integration: canonical fingerprints (server.h: idem_fingerprint_protobuf,
 * idem_fingerprint_json), opt-in per method. A real server on nng and HTTP, the real
 * client: a request re-encoded with the same meaning replays the first result, one with
 * another meaning is key reuse, a payload that cannot be read (hostile ones too: deep
 * nesting, amounts a double cannot tell apart) is refused before the store, and a
 * method without one still compares bytes. */
#include <criterion/criterion.h>
#include <protobuf-c/protobuf-c.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "idemrpc.pb-c.h"
#include "testutil.h"

/* A recursive business message, as protoc-c would emit it for
 *   message Node { Node child = 1; }
 * (the shape of google.protobuf.Struct/Value, trees, nested filters). */
typedef struct Node Node;
struct Node {
    ProtobufCMessage base;
    Node *child;
};
extern const ProtobufCMessageDescriptor node__descriptor;
static void node__init(Node *m)
{
    static const Node init = {PROTOBUF_C_MESSAGE_INIT(&node__descriptor), NULL};
    *m = init;
}
static const ProtobufCFieldDescriptor node__fields[1] = {
    {"child", 1, PROTOBUF_C_LABEL_NONE, PROTOBUF_C_TYPE_MESSAGE, 0, offsetof(Node, child),
     &node__descriptor, NULL, 0, 0, NULL, NULL},
};
static const unsigned node__by_name[] = {0};
static const ProtobufCIntRange node__ranges[1 + 1] = {{1, 0}, {0, 1}};
const ProtobufCMessageDescriptor node__descriptor = {PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC,
                                                     "t.Node",
                                                     "Node",
                                                     "Node",
                                                     "t",
                                                     sizeof(Node),
                                                     1,
                                                     node__fields,
                                                     node__by_name,
                                                     1,
                                                     node__ranges,
                                                     (ProtobufCMessageInit)node__init,
                                                     NULL,
                                                     NULL,
                                                     NULL};

static tu_server S;
static idem_client *C;
static int http_port;
static atomic_int runs;

static idem_code h_count(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&runs, 1);
    char out[32];
    int n = snprintf(out, sizeof(out), "run %d", atomic_load(&runs));
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* A business message of the test: idem.v1.IssueTokenResponse {string token = 1;
 * uint64 expires_unix_ms = 2;}, a proto3 message. */
static const ProtobufCMessageDescriptor *const MSG = &idem__v1__issue_token_response__descriptor;

static void start(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store_flags |= IDEM_STORE_NOSYNC;
    atomic_store(&runs, 0);
    tu_server_create(&S, &o);
    const idem_method_opts json = {.flags = IDEM_METHOD_CACHED,
                                   .fingerprint = idem_fingerprint_json};
    const idem_method_opts pb = {.flags = IDEM_METHOD_CACHED,
                                 .fingerprint = idem_fingerprint_protobuf,
                                 .fingerprint_arg = (void *)MSG};
    const idem_method_opts tree = {.flags = IDEM_METHOD_CACHED,
                                   .fingerprint = idem_fingerprint_protobuf,
                                   .fingerprint_arg = (void *)&node__descriptor};
    const idem_method_opts bytes = {.flags = IDEM_METHOD_CACHED};
    cr_assert_eq(idem_server_register(S.srv, "f.Json/Do", h_count, NULL, &json), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(idem_server_register(S.srv, "f.Proto/Do", h_count, NULL, &pb), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(idem_server_register(S.srv, "f.Tree/Do", h_count, NULL, &tree), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "f.Bytes/Do", h_count, NULL, &bytes), IDEM_OK);
    tu_server_listen(&S);
    cr_assert_eq(idem_server_listen_http(S.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    http_port = idem_server_http_port(S.srv);
    C = tu_client(S.url, 3000);
}

static void stop(void)
{
    if (S.srv != NULL) {
        idem_client_close(C);
        C = NULL;
        tu_server_destroy(&S, false);
    }
}

TestSuite(fingerprint, .init = start, .fini = stop, .timeout = 30);

static idem_code call(const char *method, const char *key, const void *payload, size_t len,
                      idem_result *r)
{
    idem_request q = {
        .method = method, .idempotency_key = key, .payload = payload, .payload_len = len};
    return idem_client_call(C, &q, r);
}

/* Calls and checks the code; on OK, whether it was replayed. */
static void expect(const char *method, const char *key, const void *payload, size_t len,
                   idem_code code, bool replayed)
{
    idem_result r = {0};
    cr_assert_eq(call(method, key, payload, len, &r), code, "%s %s: %s (%s)", method, key,
                 idem_code_name(r.code), r.message ? r.message : "");
    if (code == IDEM_OK) {
        cr_expect_eq(r.replayed, replayed, "%s %s: replayed %d", method, key, r.replayed);
    } else if (code == IDEM_INVALID_ARGUMENT && replayed) { /* key reuse */
        cr_expect_not_null(strstr(r.message ? r.message : "", "reused"), "%s", r.message);
    }
    idem_result_clear(&r);
}

#define S_(s) s, strlen(s)

Test(fingerprint, json_with_other_whitespace_escapes_and_key_order_is_the_same_request)
{
    expect("f.Json/Do", "j1", S_("{\"a\":1,\"b\":[1,2],\"c\":\"\xc3\xa9\",\"d\":1.0}"), IDEM_OK,
           false);
    expect("f.Json/Do", "j1", S_(" {\n \"d\" : 1e0, \"c\":\"\\u00e9\",\t\"b\":[1, 2],\"a\":1}\n"),
           IDEM_OK, true);
    cr_assert_eq(atomic_load(&runs), 1);
    /* another meaning under the key: an array in another order, an integer for a real */
    expect("f.Json/Do", "j1", S_("{\"a\":1,\"b\":[2,1],\"c\":\"\xc3\xa9\",\"d\":1.0}"),
           IDEM_INVALID_ARGUMENT, true);
    expect("f.Json/Do", "j1", S_("{\"a\":1,\"b\":[1,2],\"c\":\"\xc3\xa9\",\"d\":1}"),
           IDEM_INVALID_ARGUMENT, true);
    cr_assert_eq(atomic_load(&runs), 1);
}

Test(fingerprint, json_that_cannot_be_read_is_refused_before_it_runs)
{
    const char *bad[] = {
        "{\"a\":1,\"a\":2}", "{\"a\":", "", "\xff", "[1e999]", "123456789012345678901234567890"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char key[16];
        snprintf(key, sizeof(key), "bad%zu", i);
        expect("f.Json/Do", key, S_(bad[i]), IDEM_INVALID_ARGUMENT, false);
    }
    cr_assert_eq(atomic_load(&runs), 0);
    expect("f.Json/Do", "scalar", S_("\"just a string\""), IDEM_OK, false); /* any value */
}

Test(fingerprint, a_method_without_one_still_compares_bytes)
{
    expect("f.Bytes/Do", "b1", S_("{\"a\":1,\"b\":2}"), IDEM_OK, false);
    expect("f.Bytes/Do", "b1", S_("{\"b\":2,\"a\":1}"), IDEM_INVALID_ARGUMENT, true);
    cr_assert_eq(atomic_load(&runs), 1);
}

Test(fingerprint, protobuf_in_another_field_order_or_with_defaults_written_is_the_same_request)
{
    /* token "t" (field 1) and expires 5 (field 2), as protobuf-c writes it */
    static const uint8_t plain[] = {0x0a, 0x01, 't', 0x10, 0x05};
    static const uint8_t reordered[] = {0x10, 0x05, 0x0a, 0x01, 't'};
    /* expires sent twice (the last counts) and an empty token written out first */
    static const uint8_t twice[] = {0x0a, 0x00, 0x10, 0x07, 0x0a, 0x01, 't', 0x10, 0x05};
    static const uint8_t other[] = {0x0a, 0x01, 't', 0x10, 0x06};
    static const uint8_t unknown[] = {0x0a, 0x01, 't', 0x10, 0x05, 0x18, 0x01};
    static const uint8_t broken[] = {0x0a, 0x05, 't'};
    expect("f.Proto/Do", "p1", plain, sizeof(plain), IDEM_OK, false);
    expect("f.Proto/Do", "p1", reordered, sizeof(reordered), IDEM_OK, true);
    expect("f.Proto/Do", "p1", twice, sizeof(twice), IDEM_OK, true);
    cr_assert_eq(atomic_load(&runs), 1);
    expect("f.Proto/Do", "p1", other, sizeof(other), IDEM_INVALID_ARGUMENT, true);
    expect("f.Proto/Do", "p1", unknown, sizeof(unknown), IDEM_INVALID_ARGUMENT, true);
    expect("f.Proto/Do", "p2", broken, sizeof(broken), IDEM_INVALID_ARGUMENT, false);
    cr_assert_eq(atomic_load(&runs), 1);
}

Test(fingerprint, json_over_http_replays_a_body_with_other_whitespace)
{
    const char *h[] = {"Idempotency-Key: h1", "Content-Type: application/json"};
    tu_http a, b;
    tu_http_post(&a, http_port, "/f.Json/Do", h, 2, S_("{\"x\":1,\"y\":2}"));
    cr_assert_eq(a.status, 200, "%s", a.head);
    tu_http_post(&b, http_port, "/f.Json/Do", h, 2, S_("{ \"y\": 2, \"x\": 1 }"));
    cr_assert_eq(b.status, 200, "%s", b.head);
    char v[16];
    cr_expect_str_eq(tu_http_header(&b, "Idempotent-Replayed", v, sizeof(v)), "true");
    cr_expect_str_eq(b.body, a.body);
    tu_http_free(&a);
    tu_http_free(&b);
    cr_assert_eq(atomic_load(&runs), 1);
}

Test(fingerprint, registering_a_protobuf_one_without_its_descriptor_is_refused)
{
    idem_method_opts o = {.flags = IDEM_METHOD_CACHED, .fingerprint = idem_fingerprint_protobuf};
    tu_server t; /* S is listening already: a fresh server to register on */
    tu_server_create(&t, NULL);
    idem_server *srv = t.srv;
    cr_expect_eq(idem_server_register(srv, "f.NoDesc/Do", h_count, NULL, &o),
                 IDEM_INVALID_ARGUMENT);
    cr_expect_not_null(strstr(idem_errmsg(), "ProtobufCMessageDescriptor"), "%s", idem_errmsg());
    o.fingerprint_arg = "not a descriptor";
    cr_expect_eq(idem_server_register(srv, "f.NoDesc/Do", h_count, NULL, &o),
                 IDEM_INVALID_ARGUMENT);
    tu_server_destroy(&t, false);
}

/* Two amounts that differ by one unit but are one IEEE double are refused (never the
 * same request); amounts a double holds exactly compare by value. */
Test(fingerprint, json_amounts_a_double_cannot_tell_apart_are_refused_not_replayed)
{
    const char *a = "{\"amount\":100000000000000001.0}";
    const char *b = "{\"amount\":100000000000000002.0}";
    const char *tiny = "[1e-400]";
    idem_result r = {0};
    cr_assert_eq(call("f.Json/Do", "amt-1", a, strlen(a), &r), IDEM_INVALID_ARGUMENT, "%s",
                 idem_code_name(r.code));
    idem_result_clear(&r);
    cr_assert_eq(call("f.Json/Do", "amt-1", b, strlen(b), &r), IDEM_INVALID_ARGUMENT, "%s",
                 idem_code_name(r.code));
    idem_result_clear(&r);
    cr_assert_eq(call("f.Json/Do", "amt-2", tiny, strlen(tiny), &r), IDEM_INVALID_ARGUMENT);
    idem_result_clear(&r);
    cr_assert_eq(atomic_load(&runs), 0);
    const char *c = "{\"amount\":100.10}", *d = "{\"amount\":1.001e2}", *e = "{\"amount\":100.2}";
    cr_assert_eq(call("f.Json/Do", "amt-3", c, strlen(c), &r), IDEM_OK);
    idem_result_clear(&r);
    cr_assert_eq(call("f.Json/Do", "amt-3", d, strlen(d), &r), IDEM_OK);
    cr_expect(r.replayed, "100.10 and 1.001e2 are one amount");
    idem_result_clear(&r);
    cr_assert_eq(call("f.Json/Do", "amt-3", e, strlen(e), &r), IDEM_INVALID_ARGUMENT);
    cr_expect_not_null(strstr(r.message ? r.message : "", "reused"), "%s", r.message);
    idem_result_clear(&r);
    cr_assert_eq(atomic_load(&runs), 1);
}

/* A deeply nested request (hostile): refused, or served; never a crash. */
Test(fingerprint, protobuf_a_deeply_nested_request_does_not_crash_the_server)
{
    enum { DEPTH = 200000 };
    size_t cap = (size_t)DEPTH * 6 + 16, start = cap;
    uint8_t *buf = malloc(cap);
    cr_assert_not_null(buf);
    /* inside out: each level is tag 0x0a, varint length, the level below */
    for (int i = 0; i < DEPTH; i++) {
        size_t len = cap - start;
        uint8_t v[10];
        size_t n = 0;
        do {
            v[n++] = (uint8_t)((len & 0x7f) | (len >= 0x80 ? 0x80 : 0));
            len >>= 7;
        } while (len != 0);
        start -= n;
        memcpy(buf + start, v, n);
        buf[--start] = 0x0a;
    }
    idem_result r = {0};
    idem_code code = call("f.Tree/Do", "deep-1", buf + start, cap - start, &r);
    free(buf);
    cr_log_info("deep request (%zu bytes): %s %s", cap - start, idem_code_name(code),
                r.message ? r.message : "");
    idem_result_clear(&r);
    /* the server is still there */
    const char *p = "";
    code = call("f.Tree/Do", "shallow-1", p, 0, &r);
    cr_assert_eq(code, IDEM_OK, "after the deep request: %s %s", idem_code_name(code),
                 r.message ? r.message : "");
    idem_result_clear(&r);
}

/* jansson's depth bound refuses a deeply nested JSON body. */
Test(fingerprint, json_a_deeply_nested_request_is_refused_not_a_crash)
{
    enum { DEPTH = 1000000 };
    char *buf = malloc(2 * DEPTH);
    cr_assert_not_null(buf);
    memset(buf, '[', DEPTH);
    memset(buf + DEPTH, ']', DEPTH);
    idem_result r = {0};
    idem_code code = call("f.Json/Do", "jdeep-1", buf, 2 * DEPTH, &r);
    free(buf);
    cr_assert_eq(code, IDEM_INVALID_ARGUMENT, "%s %s", idem_code_name(code),
                 r.message ? r.message : "");
    idem_result_clear(&r);
}

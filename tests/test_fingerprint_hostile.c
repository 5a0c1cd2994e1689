/* Hostile and edge requests against canonical fingerprints (server.h: idem_fingerprint_json,
 * idem_fingerprint_protobuf) against their header's promises: "a changed value is still
 * key reuse" and "a payload these cannot read is refused INVALID_ARGUMENT before the
 * store is touched". A real server on nng, the real client. */
#include <criterion/criterion.h>
#include <protobuf-c/protobuf-c.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

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
static atomic_int runs;

static idem_code h_count(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&runs, 1);
    return idem_call_reply(call, IDEM_OK, "ok", 2);
}

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
                                 .fingerprint_arg = (void *)&node__descriptor};
    cr_assert_eq(idem_server_register(S.srv, "f.Json/Pay", h_count, NULL, &json), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(idem_server_register(S.srv, "f.Tree/Do", h_count, NULL, &pb), IDEM_OK, "%s",
                 idem_errmsg());
    tu_server_listen(&S);
    C = tu_client(S.url, 5000);
}

static void stop(void)
{
    if (S.srv != NULL) {
        idem_client_close(C);
        C = NULL;
        tu_server_destroy(&S, false);
    }
}

TestSuite(fingerprint_hostile, .init = start, .fini = stop, .timeout = 60);

static idem_code call(const char *method, const char *key, const void *payload, size_t len,
                      idem_result *r)
{
    idem_request q = {
        .method = method, .idempotency_key = key, .payload = payload, .payload_len = len};
    return idem_client_call(C, &q, r);
}

/* Two amounts that differ by one unit but are one IEEE double are refused (never the
 * same request); amounts a double holds exactly compare by value. */
Test(fingerprint_hostile, json_amounts_a_double_cannot_tell_apart_are_refused_not_replayed)
{
    const char *a = "{\"amount\":100000000000000001.0}";
    const char *b = "{\"amount\":100000000000000002.0}";
    const char *tiny = "[1e-400]";
    idem_result r = {0};
    cr_assert_eq(call("f.Json/Pay", "amt-1", a, strlen(a), &r), IDEM_INVALID_ARGUMENT, "%s",
                 idem_code_name(r.code));
    idem_result_clear(&r);
    cr_assert_eq(call("f.Json/Pay", "amt-1", b, strlen(b), &r), IDEM_INVALID_ARGUMENT, "%s",
                 idem_code_name(r.code));
    idem_result_clear(&r);
    cr_assert_eq(call("f.Json/Pay", "amt-2", tiny, strlen(tiny), &r), IDEM_INVALID_ARGUMENT);
    idem_result_clear(&r);
    cr_assert_eq(atomic_load(&runs), 0);
    const char *c = "{\"amount\":100.10}", *d = "{\"amount\":1.001e2}", *e = "{\"amount\":100.2}";
    cr_assert_eq(call("f.Json/Pay", "amt-3", c, strlen(c), &r), IDEM_OK);
    idem_result_clear(&r);
    cr_assert_eq(call("f.Json/Pay", "amt-3", d, strlen(d), &r), IDEM_OK);
    cr_expect(r.replayed, "100.10 and 1.001e2 are one amount");
    idem_result_clear(&r);
    cr_assert_eq(call("f.Json/Pay", "amt-3", e, strlen(e), &r), IDEM_INVALID_ARGUMENT);
    cr_expect_not_null(strstr(r.message ? r.message : "", "reused"), "%s", r.message);
    idem_result_clear(&r);
    cr_assert_eq(atomic_load(&runs), 1);
}

/* A deeply nested request (hostile): refused, or served; never a crash. */
Test(fingerprint_hostile, protobuf_a_deeply_nested_request_does_not_crash_the_server)
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
Test(fingerprint_hostile, json_a_deeply_nested_request_is_refused_not_a_crash)
{
    enum { DEPTH = 1000000 };
    char *buf = malloc(2 * DEPTH);
    cr_assert_not_null(buf);
    memset(buf, '[', DEPTH);
    memset(buf + DEPTH, ']', DEPTH);
    idem_result r = {0};
    idem_code code = call("f.Json/Pay", "jdeep-1", buf, 2 * DEPTH, &r);
    free(buf);
    cr_assert_eq(code, IDEM_INVALID_ARGUMENT, "%s %s", idem_code_name(code),
                 r.message ? r.message : "");
    idem_result_clear(&r);
}

/* Replays sent as the stored bytes (issue 15): the nng front answers a replay with the
 * stored Response and only the per-call fields appended, instead of decoding and
 * re-encoding it. What a client receives must not change: two real servers get the
 * same record, one on the stored-bytes path (the default chain), one forced onto the
 * decode + re-encode path (an interceptor in front of result_cache), and the same raw
 * frame must get the same bytes from both. Records the stored-bytes path cannot send
 * as they are (not in protobuf-c's canonical form) take the old path, and records
 * written by the previous release replay. The HTTP front keeps its headers and JSON;
 * requests decoded into the arena are the requests the plain decoder makes. */
#include <criterion/criterion.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "idemrpc.pb-c.h"
#include "server_internal.h"
#include "testutil.h"

#define ECHO "t.Replay/Echo"
#define FAIL "t.Replay/Fail"
#define CALLER "tester"
#define HOUR_MS 3600000ull

static tu_server FAST, SLOW; /* stored-bytes replays; decode + re-encode replays */
static int http_port;
static atomic_int runs;

/* Echoes the payload with metadata that needs escaping wherever it goes. */
static idem_code h_echo(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    atomic_fetch_add(&runs, 1);
    if (n > 0 && ((const char *)p)[n] != '\0') { /* handlers read payloads with sscanf */
        return idem_call_fail(call, IDEM_INTERNAL, "payload not followed by a NUL");
    }
    if (idem_call_set_response_metadata(call, "note", "say \"hi\"") != IDEM_OK) {
        return idem_call_fail(call, IDEM_INTERNAL, "metadata refused");
    }
    return idem_call_reply(call, IDEM_OK, p, n);
}

/* A final business error (stored and replayed) whose message needs JSON escapes. */
static idem_code h_fail(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&runs, 1);
    return idem_call_fail(call, IDEM_NOT_FOUND, "no \"order\" \\ here\tnow");
}

/* In front of result_cache: replays then go through the decode + re-encode path. */
static idem_code pass_through(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    return idem_call_next(call, next);
}

static void server_up(tu_server *s, bool slow)
{
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED};
    tu_server_create(s, NULL);
    if (slow) {
        cr_assert_eq(idem_server_use_first(s->srv, "pass", pass_through, NULL), IDEM_OK);
    }
    cr_assert_eq(idem_server_register(s->srv, ECHO, h_echo, NULL, &m), IDEM_OK);
    cr_assert_eq(idem_server_register(s->srv, FAIL, h_fail, NULL, &m), IDEM_OK);
    tu_server_listen(s);
}

static void setup(void)
{
    atomic_store(&runs, 0);
    server_up(&FAST, false);
    server_up(&SLOW, true);
    cr_assert_eq(idem_server_listen_http(FAST.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    http_port = idem_server_http_port(FAST.srv);
}

static void teardown(void)
{
    tu_server_destroy(&FAST, false);
    tu_server_destroy(&SLOW, false);
}

TestSuite(replay, .init = setup, .fini = teardown, .timeout = 60);

/* ---- helpers ---- */

typedef struct bytes {
    uint8_t *b;
    size_t n;
} bytes;

/* A request frame; metadata as name/value pairs (n_meta of them). */
static bytes request(const char *method, const char *key, const char *request_id,
                     const char *payload, size_t plen, const char *const *meta, size_t n_meta)
{
    Idem__V1__Request r = IDEM__V1__REQUEST__INIT;
    Idem__V1__Request__MetadataEntry e[8], *ep[8];
    cr_assert_leq(n_meta, 8);
    r.method = (char *)method;
    r.idempotency_key = (char *)(key != NULL ? key : "");
    r.request_id = (char *)(request_id != NULL ? request_id : "");
    r.caller = CALLER;
    r.payload.data = (uint8_t *)payload;
    r.payload.len = plen;
    for (size_t i = 0; i < n_meta; i++) {
        idem__v1__request__metadata_entry__init(&e[i]);
        e[i].key = (char *)meta[2 * i];
        e[i].value = (char *)meta[2 * i + 1];
        ep[i] = &e[i];
    }
    r.n_metadata = n_meta;
    r.metadata = ep;
    bytes f = {.n = idem__v1__request__get_packed_size(&r)};
    cr_assert_not_null(f.b = malloc(f.n));
    idem__v1__request__pack(&r, f.b);
    return f;
}

/* One frame over a fresh req0 socket; the reply's bytes. */
static bytes raw(const char *url, bytes frame)
{
    nng_socket s;
    nng_msg *m;
    cr_assert_eq(nng_req0_open(&s), 0);
    cr_assert_eq(nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, 10000), 0);
    cr_assert_eq(nng_socket_set_size(s, NNG_OPT_RECVMAXSZ, 0), 0);
    cr_assert_eq(nng_dial(s, url, NULL, 0), 0, "dial %s", url);
    cr_assert_eq(nng_send(s, frame.b, frame.n, 0), 0);
    cr_assert_eq(nng_recvmsg(s, &m, 0), 0, "no reply from %s", url);
    bytes out = {.n = nng_msg_len(m)};
    cr_assert_not_null(out.b = malloc(out.n ? out.n : 1));
    memcpy(out.b, nng_msg_body(m), out.n);
    nng_msg_free(m);
    nng_close(s);
    return out;
}

/* A COMPLETED record with the given stored Response bytes, first executed at now_ms. */
static void put_record(tu_server *s, const char *method, const char *key, const char *payload,
                       size_t plen, const void *stored, size_t len, uint64_t now_ms)
{
    idem_store *st = idem_server_store(s->srv);
    idem_claim_req req = {.key = {CALLER, method, key},
                          .now_ms = now_ms,
                          .lease_until_ms = now_ms + 60000,
                          .expires_ms = now_ms + HOUR_MS};
    idem_claim_outcome outcome;
    idem_record rec;
    cr_assert(idem__fingerprint(method, payload, plen, req.fingerprint));
    cr_assert_eq(idem_store_claim(st, &req, &outcome, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(outcome, IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(idem_store_complete(st, &req.key, rec.owner, stored, len, now_ms + HOUR_MS),
                 IDEM_OK, "%s", idem_errmsg());
    idem_record_clear(&rec);
}

/* Whether the server's stored-bytes path takes this replay (the nng callback's fast
 * path, as the front runs it, without sending). */
static bool sent_as_stored_bytes(tu_server *s, bytes frame)
{
    idem_served out;
    cr_assert(idem__server_run(s->srv, frame.b, frame.n, true, &out), "not answered at once");
    cr_assert(out.call.replayed);
    bool wire = out.call.replay_wire != NULL;
    idem__server_done(s->srv, &out);
    return wire;
}

static void expect_same_reply(bytes frame, const char *what)
{
    bytes fast = raw(FAST.url, frame), slow = raw(SLOW.url, frame);
    cr_expect_eq(fast.n, slow.n, "%s: %zu bytes vs %zu by decode + re-encode", what, fast.n,
                 slow.n);
    cr_expect(fast.n == slow.n && memcmp(fast.b, slow.b, fast.n) == 0,
              "%s: the reply differs from what decode + re-encode sends", what);
    free(fast.b);
    free(slow.b);
}

/* A stored Response as result_cache writes it (idem__encode_call_response, for_wire
 * false) for a call answered with code, message, payload and n_meta entries. */
static bytes stored_response(idem_code code, const char *message, const void *payload, size_t plen,
                             size_t n_meta, size_t value_len)
{
    static const Idem__V1__Request empty = IDEM__V1__REQUEST__INIT;
    idem_call call;
    char name[24], *value = malloc(value_len + 1);
    cr_assert_not_null(value);
    memset(value, 'v', value_len);
    value[value_len] = '\0';
    idem__call_init(&call, &empty, NULL, NULL);
    cr_assert_eq(idem_call_reply(&call, code, payload, plen), code);
    if (message != NULL) {
        cr_assert_eq(idem__call_set_message(&call, message), IDEM_OK);
    }
    for (size_t i = 0; i < n_meta; i++) {
        snprintf(name, sizeof(name), "m%zu", i);
        cr_assert_eq(idem_call_set_response_metadata(&call, name, value), IDEM_OK);
    }
    bytes b;
    cr_assert_eq(idem__encode_call_response(&call, false, &b.b, &b.n), IDEM_OK);
    idem__call_fini(&call);
    free(value);
    return b;
}

/* ---- the reply is what decode + re-encode sends ---- */

Test(replay, stored_bytes_reply_is_byte_for_byte_the_reencoded_one)
{
    static char big[700000];
    memset(big, 'b', sizeof(big));
    struct {
        idem_code code;
        const char *message;
        const char *payload;
        size_t plen, n_meta, value_len;
    } stored[] = {
        {IDEM_OK, NULL, "hello", 5, 0, 0},
        {IDEM_OK, NULL, NULL, 0, 2, 0},           /* no payload, entries without values */
        {IDEM_NOT_FOUND, "nope", NULL, 0, 60, 1}, /* a full handler share of metadata */
        {IDEM_OK, NULL, big, 200, 1, 4096},       /* multi-byte lengths */
        {IDEM_OK, NULL, big, sizeof(big), 3, 5},
        {IDEM_ALREADY_EXISTS, "exists", big, 130, 0, 0},
    };
    /* The per-call fields vary with the request: its key source (echoed in idem-key
     * or not: a generated key is echoed too) and its request id. */
    const char *generated[] = {IDEM_META_KEY_GENERATED, "1"};
    char key[32], rid[160];
    const char *meta_key[] = {"idempotency-key", key};
    uint64_t now = idem__now_ms();
    for (size_t i = 0; i < IDEM_ARRAY_LEN(stored); i++) {
        bytes b = stored_response(stored[i].code, stored[i].message, stored[i].payload,
                                  stored[i].plen, stored[i].n_meta, stored[i].value_len);
        cr_assert(idem__replay_wire_ok(b.b, b.n), "case %zu: what result_cache stores is canonical",
                  i);
        for (int variant = 0; variant < 4; variant++) {
            snprintf(key, sizeof(key), "k%zu-%d", i, variant);
            const char *k = variant == 2 ? NULL : key; /* 2: in metadata idempotency-key */
            memset(rid, 'r', 128);
            rid[128] = '\0'; /* the longest request id */
            const char *id = variant == 0 ? "rid-1" : variant == 3 ? rid : "x";
            put_record(&FAST, ECHO, key, "in", 2, b.b, b.n, now);
            put_record(&SLOW, ECHO, key, "in", 2, b.b, b.n, now);
            bytes f = request(ECHO, k, id, "in", 2, variant == 1 ? generated : meta_key,
                              variant == 1 || variant == 2 ? 1 : 0);
            cr_expect(sent_as_stored_bytes(&FAST, f), "case %zu/%d: not sent as stored bytes", i,
                      variant);
            char what[32];
            snprintf(what, sizeof(what), "case %zu/%d", i, variant);
            expect_same_reply(f, what);
            free(f.b);
        }
        free(b.b);
    }
}

/* A record's bytes that decode + re-encode would not reproduce are not sent as they
 * are: the decode path answers, as before. */
Test(replay, non_canonical_records_replay_through_the_decoder)
{
    static const struct {
        const char *why;
        uint8_t b[40];
        size_t n;
    } cases[] = {
        {"unknown field", {0x1a, 0x02, 'h', 'i', 0x38, 0x01}, 6},
        {"payload before code", {0x1a, 0x02, 'h', 'i', 0x08, 0x05}, 6},
        {"message twice", {0x12, 0x01, 'a', 0x12, 0x01, 'b'}, 6},
        {"code 0 written", {0x08, 0x00, 0x1a, 0x01, 'x'}, 5},
        {"empty payload written", {0x1a, 0x00}, 2},
        {"overlong length", {0x1a, 0x81, 0x00, 'x'}, 4},
        {"library name idem-key",
         {0x22, 0x0d, 0x0a, 0x08, 'i', 'd', 'e', 'm', '-', 'k', 'e', 'y', 0x12, 0x01, 'x'},
         15},
        {"library name request-id",
         {0x22, 0x0f, 0x0a, 0x0a, 'r', 'e', 'q', 'u', 'e', 's', 't', '-', 'i', 'd', 0x12, 0x01,
          'h'},
         17},
        {"a name twice",
         {0x22, 0x06, 0x0a, 0x01, 'a', 0x12, 0x01, '1', 0x22, 0x06, 0x0a, 0x01, 'a', 0x12, 0x01,
          '2'},
         16},
        {"value before name", {0x22, 0x06, 0x12, 0x01, '1', 0x0a, 0x01, 'a'}, 8},
        {"replayed stored", {0x1a, 0x01, 'x', 0x28, 0x01}, 5},
        {"NUL in message", {0x12, 0x03, 'a', 0x00, 'b'}, 5},
    };
    uint64_t now = idem__now_ms();
    char key[16];
    for (size_t i = 0; i < IDEM_ARRAY_LEN(cases); i++) {
        cr_expect_not(idem__replay_wire_ok(cases[i].b, cases[i].n), "%s: taken as canonical",
                      cases[i].why);
        snprintf(key, sizeof(key), "nc%zu", i);
        put_record(&FAST, ECHO, key, "in", 2, cases[i].b, cases[i].n, now);
        put_record(&SLOW, ECHO, key, "in", 2, cases[i].b, cases[i].n, now);
        bytes f = request(ECHO, key, "rid-nc", "in", 2, NULL, 0);
        bytes fast = raw(FAST.url, f), slow = raw(SLOW.url, f);
        if (slow.n == 0 || fast.n != slow.n || memcmp(fast.b, slow.b, fast.n) != 0) {
            cr_expect_fail("%s: the reply differs from what decode + re-encode sends",
                           cases[i].why);
        }
        Idem__V1__Response *r = idem__v1__response__unpack(NULL, fast.n, fast.b);
        cr_assert_not_null(r, "%s: the reply does not decode", cases[i].why);
        cr_expect(r->replayed || r->code == IDEM__V1__CODE__DATA_LOSS, "%s: not replayed",
                  cases[i].why);
        idem__v1__response__free_unpacked(r, NULL);
        free(fast.b);
        free(slow.b);
        free(f.b);
    }
}

/* The bytes ff85af8 (the release before this change) stored for a handler's
 * NOT_FOUND "gone" with payload "hi" and metadata a=1: code 5, message, payload, one
 * entry. */
Test(replay, record_of_the_previous_release_replays)
{
    static const uint8_t old[] = {0x08, 0x05, 0x12, 0x04, 'g',  'o',  'n', 'e',  0x1a, 0x02,
                                  'h',  'i',  0x22, 0x06, 0x0a, 0x01, 'a', 0x12, 0x01, '1'};
    uint64_t now = idem__now_ms();
    put_record(&FAST, ECHO, "old-1", "in", 2, old, sizeof(old), now);
    bytes f = request(ECHO, "old-1", "rid-old", "in", 2, NULL, 0);
    cr_expect(sent_as_stored_bytes(&FAST, f));
    free(f.b);

    idem_client *c = tu_client(FAST.url, 2000);
    idem_request q = {.method = ECHO,
                      .idempotency_key = "old-1",
                      .caller = CALLER,
                      .request_id = "rid-old",
                      .payload = "in",
                      .payload_len = 2};
    idem_result r;
    cr_expect_eq(idem_client_call(c, &q, &r), IDEM_NOT_FOUND);
    cr_expect(r.replayed);
    cr_expect_str_eq(r.message, "gone");
    cr_expect_str_eq(r.request_id, "rid-old");
    char first_at[24];
    snprintf(first_at, sizeof(first_at), "%llu", (unsigned long long)now);
    size_t seen_a = 0, seen_first = 0;
    for (size_t i = 0; i < r.metadata_count; i++) {
        if (strcmp(r.metadata[i].name, "a") == 0) {
            seen_a++;
            cr_expect_str_eq(r.metadata[i].value, "1");
        } else if (strcmp(r.metadata[i].name, "idem-first-at") == 0) {
            seen_first++;
            cr_expect_str_eq(r.metadata[i].value, first_at);
        }
    }
    cr_expect_eq(seen_a, 1);
    cr_expect_eq(seen_first, 1);
    cr_expect_eq(atomic_load(&runs), 0, "a replay ran the handler");
    idem_result_clear(&r);
    idem_client_close(c);
}

/* ---- per-call fields are per call ---- */

static size_t count_entries(const Idem__V1__Response *r, const char *name, const char **value)
{
    size_t n = 0;
    for (size_t i = 0; i < r->n_metadata; i++) {
        if (strcmp(r->metadata[i]->key, name) == 0) {
            n++;
            *value = r->metadata[i]->value;
        }
    }
    return n;
}

Test(replay, two_replays_of_one_key_each_get_their_own_request_id_once)
{
    bytes first = request(ECHO, "per-call", "rid-0", "pay", 3, NULL, 0);
    free(raw(FAST.url, first).b);
    free(first.b);
    cr_assert_eq(atomic_load(&runs), 1);
    const char *ids[] = {"rid-A", "rid-B", "rid-A"};
    char first_at[24] = "";
    for (size_t i = 0; i < IDEM_ARRAY_LEN(ids); i++) {
        bytes f = request(ECHO, "per-call", ids[i], "pay", 3, NULL, 0);
        cr_expect(sent_as_stored_bytes(&FAST, f));
        bytes b = raw(FAST.url, f);
        Idem__V1__Response *r = idem__v1__response__unpack(NULL, b.n, b.b);
        cr_assert_not_null(r);
        const char *v = NULL;
        cr_expect(r->replayed);
        cr_expect_str_eq(r->request_id, ids[i]);
        cr_expect_eq(count_entries(r, "request-id", &v), 1, "request-id not exactly once");
        cr_expect_str_eq(v, ids[i]);
        cr_expect_eq(count_entries(r, "idem-key", &v), 1);
        cr_expect_str_eq(v, "per-call");
        cr_expect_eq(count_entries(r, "note", &v), 1);
        cr_expect_str_eq(v, "say \"hi\"");
        cr_expect_eq(count_entries(r, "idem-first-at", &v), 1);
        if (i == 0) {
            snprintf(first_at, sizeof(first_at), "%s", v);
        }
        cr_expect_str_eq(v, first_at, "the first execution's time, on every replay");
        cr_expect_eq(r->payload.len, 3);
        cr_expect(r->payload.len == 3 && memcmp(r->payload.data, "pay", 3) == 0);
        /* What protobuf-c itself writes for this Response: no duplicated field. */
        size_t n = idem__v1__response__get_packed_size(r);
        uint8_t *again = malloc(n);
        cr_assert_not_null(again);
        idem__v1__response__pack(r, again);
        cr_expect(n == b.n && memcmp(again, b.b, n) == 0, "the reply is not canonical");
        free(again);
        idem__v1__response__free_unpacked(r, NULL);
        free(b.b);
        free(f.b);
    }
    cr_expect_eq(atomic_load(&runs), 1, "a replay ran the handler");
}

/* A large stored result replays whole through the client. */
Test(replay, large_result_replays_intact_through_the_client)
{
    size_t n = 1 << 20;
    char *p = malloc(n);
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++) {
        p[i] = (char)(i * 131 + 7);
    }
    idem_client_opts o;
    idem_client *c;
    const char *url = FAST.url;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 10000;
    cr_assert_eq(idem_client_open(&c, &url, 1, &o), IDEM_OK);
    idem_request q = {.method = ECHO, .idempotency_key = "big", .payload = p, .payload_len = n};
    for (int i = 0; i < 2; i++) {
        idem_result r;
        cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s", r.message ? r.message : "");
        cr_expect_eq(r.replayed, i == 1);
        cr_expect(r.payload_len == n && memcmp(r.payload, p, n) == 0, "payload differs");
        idem_result_clear(&r);
    }
    cr_expect_eq(atomic_load(&runs), 1);
    idem_client_close(c);
    free(p);
}

/* ---- the HTTP front ---- */

static void post(tu_http *r, const char *method, const char *key, const char *rid)
{
    char path[64], k[64], id[64];
    snprintf(path, sizeof(path), "/%s", method);
    snprintf(k, sizeof(k), "Idempotency-Key: %s", key);
    snprintf(id, sizeof(id), "X-Request-Id: %s", rid);
    const char *headers[] = {k, id, "X-Caller: " CALLER};
    tu_http_post(r, http_port, path, headers, 3, "abc", 3);
}

Test(replay, http_replays_keep_headers_and_json)
{
    tu_http r;
    char v[256];
    post(&r, ECHO, "h-1", "h-rid-1");
    cr_assert_eq(r.status, 200);
    cr_expect_null(tu_http_header(&r, "Idempotent-Replayed", v, sizeof(v)));
    tu_http_free(&r);
    post(&r, ECHO, "h-1", "h-rid-2");
    cr_assert_eq(r.status, 200);
    cr_expect(r.body_len == 3 && memcmp(r.body, "abc", 3) == 0);
    cr_expect_str_eq(tu_http_header(&r, "Idempotent-Replayed", v, sizeof(v)), "true");
    cr_expect_str_eq(tu_http_header(&r, "X-Request-Id", v, sizeof(v)), "h-rid-2");
    cr_expect_str_eq(tu_http_header(&r, "Idem-Meta-note", v, sizeof(v)), "say \"hi\"");
    cr_expect_str_eq(tu_http_header(&r, "Idem-Key", v, sizeof(v)), "h-1");
    cr_expect_not_null(tu_http_header(&r, "Idem-First-At", v, sizeof(v)));
    tu_http_free(&r);

    post(&r, FAIL, "h-2", "h-rid-3");
    cr_assert_eq(r.status, 404);
    tu_http_free(&r);
    post(&r, FAIL, "h-2", "h-rid-4");
    cr_assert_eq(r.status, 404);
    cr_expect_str_eq(tu_http_header(&r, "Idempotent-Replayed", v, sizeof(v)), "true");
    cr_expect_str_eq(r.body,
                     "{\"code\":\"NOT_FOUND\",\"message\":\"no \\\"order\\\" \\\\ here\\u0009now\","
                     "\"request_id\":\"h-rid-4\"}");
    tu_http_free(&r);
    cr_expect_eq(atomic_load(&runs), 2, "a replay ran the handler");
}

/* ---- requests decoded into the arena ---- */

static void expect_same_request(const Idem__V1__Request *a, const Idem__V1__Request *b)
{
    cr_expect_str_eq(a->method, b->method);
    cr_expect_str_eq(a->idempotency_key, b->idempotency_key);
    cr_expect_str_eq(a->request_id, b->request_id);
    cr_expect_str_eq(a->token, b->token);
    cr_expect_str_eq(a->caller, b->caller);
    cr_expect_eq(a->attempt, b->attempt);
    cr_expect_eq(a->deadline_unix_ms, b->deadline_unix_ms);
    cr_expect_eq(a->payload.len, b->payload.len);
    cr_expect(a->payload.len == 0 || memcmp(a->payload.data, b->payload.data, a->payload.len) == 0);
    cr_assert_eq(a->n_metadata, b->n_metadata);
    for (size_t i = 0; i < a->n_metadata; i++) {
        cr_expect_str_eq(a->metadata[i]->key, b->metadata[i]->key);
        cr_expect_str_eq(a->metadata[i]->value, b->metadata[i]->value);
    }
}

/* frame decoded by both decoders: the same code, message and request. */
static void decode_both(const uint8_t *frame, size_t len, const char *what)
{
    Idem__V1__Request *plain = NULL, *in_arena = NULL;
    idem_arena *a = malloc(sizeof(*a));
    char msg[512];
    cr_assert_not_null(a);
    idem__arena_init(a);
    idem_code c1 = idem__decode_request(frame, len, &plain);
    snprintf(msg, sizeof(msg), "%s", c1 == IDEM_OK ? "" : idem_errmsg());
    idem_code c2 = idem__decode_request_arena(frame, len, false, a, &in_arena);
    cr_expect_eq(c1, c2, "%s: %d vs %d", what, c1, c2);
    if (c1 != IDEM_OK) {
        cr_expect_str_eq(idem_errmsg(), msg, "%s", what);
        cr_expect_null(in_arena);
        cr_expect_null(a->chunks, "%s: a refused frame leaves the arena empty", what);
    } else if (c2 == IDEM_OK) {
        expect_same_request(plain, in_arena);
    }
    idem__free_request(plain);
    idem__arena_reset(a);
    free(a);
}

Test(replay, arena_decode_is_the_plain_decode)
{
    char *value = malloc(IDEM_MAX_METADATA_VALUE + 1);
    cr_assert_not_null(value);
    memset(value, 'v', IDEM_MAX_METADATA_VALUE);
    value[IDEM_MAX_METADATA_VALUE] = '\0';
    const char *meta[] = {"a", "1", "traceparent", value, "x-request-id", "m"};
    bytes f = request(ECHO, "k", "rid", "payload", 7, meta, 3);
    decode_both(f.b, f.n, "one payload");

    /* In a writable frame the payload is not copied: it points into the frame, and the
     * byte after it (decoded already) becomes a NUL. */
    idem_arena *a = malloc(sizeof(*a));
    Idem__V1__Request *r;
    cr_assert_not_null(a);
    idem__arena_init(a);
    cr_assert_eq(idem__decode_request_arena(f.b, f.n, true, a, &r), IDEM_OK);
    cr_expect(r->payload.data >= f.b && r->payload.data + 7 < f.b + f.n);
    cr_expect(r->payload.len == 7 && memcmp(r->payload.data, "payload", 7) == 0);
    cr_expect_eq(r->payload.data[7], 0);
    cr_expect_str_eq(r->caller, CALLER, "a field after the payload is decoded whole");
    cr_expect_not_null(a->chunks, "a 4 KiB value does not fit the arena's buffer");
    idem__arena_reset(a);
    /* Not writable, or the payload last: copied, with a NUL after it. (A writable frame
     * is used up: f is packed again.) */
    free(f.b);
    f = request(ECHO, "k", "rid", "payload", 7, meta, 3);
    static const uint8_t last[] = {0x0a, 0x03, 'a', '/', 'b', 0x32, 0x02, 'p', 'q'};
    for (int w = 0; w < 2; w++) {
        const uint8_t *frame = w ? last : f.b;
        size_t len = w ? sizeof(last) : f.n;
        cr_assert_eq(idem__decode_request_arena(frame, len, w == 1, a, &r), IDEM_OK);
        cr_expect(r->payload.data < frame || r->payload.data >= frame + len, "not copied");
        cr_expect_eq(r->payload.data[r->payload.len], 0);
        idem__arena_reset(a);
    }
    free(a);

    /* Two payload fields (the last wins), none, an empty one, truncations. */
    size_t n = f.n;
    uint8_t *twice = malloc(n + 5);
    cr_assert_not_null(twice);
    memcpy(twice, f.b, n);
    memcpy(twice + n, (const uint8_t[]){0x32, 0x03, 'l', 'a', 's'}, 5);
    decode_both(twice, n + 5, "payload twice");
    idem_arena *b = malloc(sizeof(*b));
    cr_assert_not_null(b);
    idem__arena_init(b);
    cr_assert_eq(idem__decode_request_arena(twice, n + 5, false, b, &r), IDEM_OK);
    cr_expect(r->payload.len == 3 && r->payload.data[3] == 0, "the plain decode's payload, NUL");
    idem__arena_reset(b);
    free(b);
    for (size_t cut = 1; cut < n; cut += 97) {
        decode_both(f.b, n - cut, "truncated");
    }
    free(twice);
    free(f.b);
    f = request(ECHO, "k", NULL, NULL, 0, NULL, 0);
    decode_both(f.b, f.n, "no payload");
    free(f.b);
    static const uint8_t empty_payload[] = {0x0a, 0x03, 'a', '/', 'b', 0x32, 0x00};
    decode_both(empty_payload, sizeof(empty_payload), "empty payload");
    static const uint8_t varint_payload[] = {0x0a, 0x03, 'a', '/', 'b', 0x30, 0x01};
    decode_both(varint_payload, sizeof(varint_payload), "payload as a varint");
    /* Over 5 bytes for a length or a tag: protobuf-c refuses them, so must the walk. */
    static const uint8_t long_len[] = {0x0a, 0x03, 'a',  '/',  'b',  0x32, 0x81,
                                       0x80, 0x80, 0x80, 0x80, 0x80, 0x00, 'p'};
    decode_both(long_len, sizeof(long_len), "a 7-byte payload length");
    static const uint8_t long_tag[] = {0x0a, 0x03, 'a',  '/',  'b',  0xb2, 0x80,
                                       0x80, 0x80, 0x80, 0x00, 0x01, 'p'};
    decode_both(long_tag, sizeof(long_tag), "a 6-byte payload tag");
    static const uint8_t nul_key[] = {0x0a, 0x03, 'a',  '/',  'b',  0x12,
                                      0x02, 'k',  0x00, 0x32, 0x01, 'p'};
    decode_both(nul_key, sizeof(nul_key), "NUL in the key");
    /* 64 metadata entries of 4 KiB: the arena grows past its buffer. */
    Idem__V1__Request big = IDEM__V1__REQUEST__INIT;
    Idem__V1__Request__MetadataEntry e[IDEM_MAX_METADATA], *ep[IDEM_MAX_METADATA];
    char names[IDEM_MAX_METADATA][8];
    big.method = ECHO;
    for (size_t i = 0; i < IDEM_MAX_METADATA; i++) {
        snprintf(names[i], sizeof(names[i]), "n%zu", i);
        idem__v1__request__metadata_entry__init(&e[i]);
        e[i].key = names[i];
        e[i].value = value;
        ep[i] = &e[i];
    }
    big.n_metadata = IDEM_MAX_METADATA;
    big.metadata = ep;
    big.payload.data = (uint8_t *)"p";
    big.payload.len = 1;
    size_t bn = idem__v1__request__get_packed_size(&big);
    uint8_t *bb = malloc(bn);
    cr_assert_not_null(bb);
    idem__v1__request__pack(&big, bb);
    decode_both(bb, bn, "64 large entries");
    free(bb);
    free(value);
}

/* ---- a replay kept as bytes, loaded after all ---- */

/* What the decode + re-encode path sends for a replay of stored (the order in which
 * result_cache, an entry set since, dispatch and the nng front set their metadata). */
static bytes reencoded(const bytes stored, const char *first_at, const char *since_name,
                       const char *key, const char *request_id)
{
    static const Idem__V1__Request empty = IDEM__V1__REQUEST__INIT;
    idem_call call;
    idem__call_init(&call, &empty, NULL, NULL);
    cr_assert_eq(idem__load_call_response(&call, stored.b, stored.n), IDEM_OK);
    cr_assert_eq(idem__call_set_meta(&call, "idem-first-at", first_at), IDEM_OK);
    cr_assert_eq(idem__call_set_meta(&call, since_name, "s"), IDEM_OK);
    cr_assert_eq(idem__call_set_meta(&call, "idem-key", key), IDEM_OK);
    cr_assert_eq(idem__call_set_meta(&call, "request-id", request_id), IDEM_OK);
    call.replayed = true;
    snprintf(call.request_id, sizeof(call.request_id), "%s", request_id);
    bytes b;
    cr_assert_eq(idem__encode_call_response(&call, true, &b.b, &b.n), IDEM_OK);
    idem__call_fini(&call);
    return b;
}

Test(replay, materialised_replay_is_the_loaded_one)
{
    static const Idem__V1__Request empty = IDEM__V1__REQUEST__INIT;
    bytes stored = stored_response(IDEM_NOT_FOUND, "gone", "p", 1, 3, 2);
    /* An entry set after the replay: after idem-first-at; one named like a stored one or
     * idem-key replaces it where it is. */
    const char *since[] = {"extra", "m1", "idem-key"};
    for (size_t i = 0; i < IDEM_ARRAY_LEN(since); i++) {
        idem_call call;
        idem__call_init(&call, &empty, NULL, NULL);
        call.key_source = IDEM_KEY_FIELD;
        snprintf(call.key, sizeof(call.key), "the-key");
        snprintf(call.request_id, sizeof(call.request_id), "rid-m");
        cr_assert_not_null(call.replay_wire = malloc(stored.n));
        memcpy(call.replay_wire, stored.b, stored.n);
        call.replay_wire_len = stored.n;
        call.code = IDEM_NOT_FOUND;
        call.replayed = true;
        snprintf(call.replay_first_at, sizeof(call.replay_first_at), "1234");
        cr_assert_eq(idem__call_set_meta(&call, since[i], "s"), IDEM_OK);
        cr_assert_eq(idem__call_materialize_replay(&call), IDEM_OK);
        cr_expect_null(call.replay_wire);
        cr_assert_eq(idem__call_set_meta(&call, "request-id", call.request_id), IDEM_OK);
        bytes got, want = reencoded(stored, "1234", since[i], "the-key", "rid-m");
        cr_assert_eq(idem__encode_call_response(&call, true, &got.b, &got.n), IDEM_OK);
        cr_expect(got.n == want.n && memcmp(got.b, want.b, got.n) == 0, "%s: differs", since[i]);
        free(got.b);
        free(want.b);
        idem__call_fini(&call);
    }
    free(stored.b);
}

/* The client decodes replies into an arena, the payload pointing into the reply. */
Test(replay, arena_reply_decode_is_the_plain_decode)
{
    bytes stored = stored_response(IDEM_NOT_FOUND, "gone", "payload", 7, 60, 100);
    size_t n = stored.n;
    uint8_t *twice = malloc(n + 4);
    cr_assert_not_null(twice);
    memcpy(twice, stored.b, n);
    memcpy(twice + n, (const uint8_t[]){0x1a, 0x02, 'z', 'z'}, 4); /* payload again: it wins */
    static const uint8_t none[] = {0x08, 0x05, 0x12, 0x01, 'm'};
    static const uint8_t wrong_type[] = {0x18, 0x01};
    static const uint8_t long_len[] = {0x1a, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00, 'z'};
    struct {
        const uint8_t *b;
        size_t n;
    } frames[] = {{stored.b, n},
                  {twice, n + 4},
                  {none, sizeof(none)},
                  {wrong_type, sizeof(wrong_type)},
                  {stored.b, n - 3},
                  {stored.b, 9},
                  {long_len, sizeof(long_len)}};
    idem_arena *a = malloc(sizeof(*a));
    cr_assert_not_null(a);
    for (size_t i = 0; i < IDEM_ARRAY_LEN(frames); i++) {
        idem__arena_init(a);
        Idem__V1__Response *plain = idem__v1__response__unpack(NULL, frames[i].n, frames[i].b);
        Idem__V1__Response *in_arena = idem__decode_response_arena(frames[i].b, frames[i].n, a);
        cr_expect_eq(plain == NULL, in_arena == NULL, "frame %zu: decodes in one only", i);
        if (plain != NULL && in_arena != NULL) {
            cr_expect_eq(plain->code, in_arena->code);
            cr_expect_str_eq(plain->message, in_arena->message);
            cr_expect_str_eq(plain->request_id, in_arena->request_id);
            cr_expect_eq(plain->replayed, in_arena->replayed);
            cr_expect_eq(plain->payload.len, in_arena->payload.len, "frame %zu", i);
            cr_expect(plain->payload.len == 0 ||
                      memcmp(plain->payload.data, in_arena->payload.data, plain->payload.len) == 0);
            cr_assert_eq(plain->n_metadata, in_arena->n_metadata);
            for (size_t j = 0; j < plain->n_metadata; j++) {
                cr_expect_str_eq(plain->metadata[j]->key, in_arena->metadata[j]->key);
                cr_expect_str_eq(plain->metadata[j]->value, in_arena->metadata[j]->value);
            }
        }
        if (in_arena == NULL) {
            cr_expect_null(a->chunks, "frame %zu: a refused reply leaves the arena empty", i);
        }
        if (plain != NULL) {
            idem__v1__response__free_unpacked(plain, NULL);
        }
        idem__arena_reset(a);
    }
    free(a);
    free(twice);
    free(stored.b);
}

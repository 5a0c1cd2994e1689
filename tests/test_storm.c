/* Duplicate storms: many clients resending the same keys, and nng's own REQ resends. */
#include <criterion/criterion.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "idemrpc.pb-c.h"
#include "testutil.h"

#define THREADS 64
#define KEYS 10
#define SENDS 20
#define DISTINCT 5      /* new keys per thread, each sent twice */
#define TIME_LIMIT_S 30 /* the storm stops by itself */

static tu_server S;
static idem_client *clients[8];
static atomic_int executions, arrivals;

static idem_code h_charge(idem_call *call, void *arg)
{
    (void)arg;
    char out[96];
    int n = snprintf(out, sizeof(out), "exec=%d key=%s", atomic_fetch_add(&executions, 1) + 1,
                     idem_call_key(call));
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static idem_code h_slow(idem_call *call, void *arg)
{
    struct timespec ts = {0, 100 * 1000000L}; /* the work takes longer than a resend */
    nanosleep(&ts, NULL);
    return h_charge(call, arg);
}

static idem_code count_arrivals(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    atomic_fetch_add(&arrivals, 1);
    return idem_call_next(call, next);
}

static void setup(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.contexts = 48;
    o.default_chain = false;
    atomic_store(&executions, 0);
    atomic_store(&arrivals, 0);
    tu_server_create(&S, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_use(S.srv, "count", count_arrivals, NULL), IDEM_OK);
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_REQUEST_ID), IDEM_OK);
    cr_assert_eq(idem_server_use_builtin(S.srv, IDEM_BUILTIN_RESULT_CACHE), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "s.Pay/Charge", h_charge, NULL, &m), IDEM_OK);
    cr_assert_eq(idem_server_register(S.srv, "s.Pay/Slow", h_slow, NULL, &m), IDEM_OK);
    tu_server_listen(&S);
    for (size_t i = 0; i < 8; i++) {
        clients[i] = tu_client(S.url, 5000);
    }
}

static void teardown(void)
{
    for (size_t i = 0; i < 8; i++) {
        idem_client_close(clients[i]);
    }
    tu_server_destroy(&S, false);
}

TestSuite(storm, .init = setup, .fini = teardown, .timeout = 120);

/* First response seen per shared key; every later one must be byte-identical. */
static struct {
    pthread_mutex_t mu;
    char first[KEYS][96];
    atomic_int mismatches, aborted, failed, sent_distinct;
} T = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void check_same(char *first, const idem_result *r)
{
    pthread_mutex_lock(&T.mu);
    if (first[0] == '\0') {
        snprintf(first, 96, "%.*s", (int)r->payload_len, (const char *)r->payload);
    } else if (strlen(first) != r->payload_len || memcmp(first, r->payload, r->payload_len)) {
        atomic_fetch_add(&T.mismatches, 1);
    }
    pthread_mutex_unlock(&T.mu);
}

static bool send_key(idem_client *c, const char *key, idem_result *r)
{
    idem_request q = {
        .method = "s.Pay/Charge", .idempotency_key = key, .payload = "100", .payload_len = 3};
    idem_code code = idem_client_call(c, &q, r);
    atomic_fetch_add(code == IDEM_ABORTED ? &T.aborted : &T.failed, code != IDEM_OK);
    return code == IDEM_OK;
}

static void *storm_thread(void *p)
{
    long id = (long)p;
    idem_client *c = clients[id % 8];
    time_t stop_at = time(NULL) + TIME_LIMIT_S;
    char key[32];
    idem_result r;
    for (int s = 0; s < SENDS && time(NULL) < stop_at; s++) {
        for (int k = 0; k < KEYS; k++) {
            snprintf(key, sizeof(key), "storm-%d", (k + (int)id) % KEYS);
            if (send_key(c, key, &r)) {
                check_same(T.first[(k + id) % KEYS], &r);
            }
            idem_result_clear(&r);
        }
        if (s < DISTINCT) { /* interleaved: a new key, then its duplicate */
            char first[96] = "";
            snprintf(key, sizeof(key), "t%ld-%d", id, s);
            atomic_fetch_add(&T.sent_distinct, 1);
            for (int twice = 0; twice < 2; twice++) {
                if (send_key(c, key, &r)) {
                    check_same(first, &r);
                }
                idem_result_clear(&r);
            }
        }
    }
    return NULL;
}

Test(storm, sixty_four_clients_same_keys_one_effect_each)
{
    pthread_t t[THREADS];
    for (long i = 0; i < THREADS; i++) {
        pthread_create(&t[i], NULL, storm_thread, (void *)i);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
    }
    cr_expect_eq(atomic_load(&T.failed), 0, "every call answered");
    cr_expect_eq(atomic_load(&T.aborted), 0, "no ABORTED within the deadlines");
    cr_expect_eq(atomic_load(&T.mismatches), 0, "every response is the key's first, byte for byte");
    cr_expect_eq(atomic_load(&executions), KEYS + atomic_load(&T.sent_distinct),
                 "one effect per distinct key");
    cr_expect_gt(atomic_load(&arrivals), atomic_load(&executions) * 5, "it was a storm");
}

struct resend_arg {
    int id;
    int ok;
    int err; /* last nng error, 0 = none */
    nng_socket sock;
};

/* A raw REQ socket (opened and closed by the test) that resends every 20 ms: nng's own
 * duplicates. Runs off the test's main thread, so it records failures, never asserts. */
static void *resend_thread(void *p)
{
    struct resend_arg *a = p;
    nng_socket s = a->sock;
    int rv;
    if ((rv = nng_socket_set_ms(s, NNG_OPT_REQ_RESENDTIME, 20)) != 0 ||
        (rv = nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, 10000)) != 0 ||
        (rv = nng_dial(s, S.url, NULL, 0)) != 0) {
        a->err = rv;
        return NULL;
    }
    for (int k = 0; k < 3; k++) {
        char key[32], want[96];
        snprintf(key, sizeof(key), "resend-%d-%d", a->id, k);
        size_t len;
        void *frame = tu_pack_request("s.Pay/Slow", key, NULL, "1", &len);
        nng_msg *m;
        rv = nng_msg_alloc(&m, 0);
        if (rv == 0 && (rv = nng_msg_append(m, frame, len)) == 0 &&
            (rv = nng_sendmsg(s, m, 0)) != 0) {
            nng_msg_free(m);
        }
        free(frame);
        if (rv != 0 || (rv = nng_recvmsg(s, &m, 0)) != 0) {
            a->err = rv;
            continue;
        }
        Idem__V1__Response *r = idem__v1__response__unpack(NULL, nng_msg_len(m), nng_msg_body(m));
        nng_msg_free(m);
        snprintf(want, sizeof(want), " key=%s", key);
        a->ok += r != NULL && r->code == IDEM__V1__CODE__OK &&
                 strstr((const char *)r->payload.data, want) != NULL;
        tu_response_free(r);
    }
    return NULL;
}

Test(storm, nng_req_resends_are_duplicates_too)
{
    enum { N = 8 };
    pthread_t t[N];
    struct resend_arg a[N];
    for (int i = 0; i < N; i++) {
        a[i] = (struct resend_arg){.id = i};
        cr_assert_eq(nng_req0_open(&a[i].sock), 0);
        pthread_create(&t[i], NULL, resend_thread, &a[i]);
    }
    int ok = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(a[i].err, 0, "client %d: %s", i, nng_strerror(a[i].err));
        ok += a[i].ok;
    }
    /* The sockets are left open on purpose: with resends pending on the pipe, Debian's
     * nng 1.5.2 sometimes deadlocks in nng_close of a REQ socket (seen here about once in
     * ten runs; nanomsg/nng#1543, fixed after 1.5.2). The test process exits right after.
     * idem_client is not affected: it disables REQ resend. */
    cr_expect_eq(ok, N * 3, "every request answered with its own key's result");
    cr_expect_eq(atomic_load(&executions), N * 3, "one execution per key");
    cr_expect_gt(atomic_load(&arrivals), N * 3 * 2, "nng resent (got %d arrivals)",
                 atomic_load(&arrivals));
}

/* A new key's claim queued from nng's callback thread (result_cache's fast_claim): the
 * store's writer thread applies it and hands the call to a worker, which only runs the
 * handler. Through the real server and client, on a durable LMDB store with group
 * commit: a duplicate that races such a claim runs nothing and gets the first result,
 * and a claim whose batch and redo fail to commit is never answered OK. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "call.h"
#include "failing_disk.h"
#include "lmdb_internal.h"
#include "testutil.h"

static char *dir;
static idem_store *store;
static tu_server srv;
static atomic_int runs, fast_claims;
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool first_running, first_may_answer;
static int fail_at_first_run; /* fdatasyncs that fail once the first run has begun */

/* A server with `workers` handler threads on a durable store of its own, whose batches
 * stay open for their shared claims (30 s): a claim arriving after the accept window
 * waits in the queue until the open batch commits. */
static void start(size_t workers)
{
    dir = tu_tempdir("fast_claim");
    cr_assert_eq(idem_store_open_lmdb(&store, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    ((lmdb_store *)store)->gc.hold_us = 30u * 1000 * 1000; /* before its first write */
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = store;
    o.workers = workers;
    tu_server_create(&srv, &o);
}

static void setup(void)
{
    atomic_store(&runs, 0);
    atomic_store(&fast_claims, 0);
    atomic_store(&failing_syncs, 0);
    first_running = first_may_answer = false;
    fail_at_first_run = 0;
}

static void teardown(void)
{
    atomic_store(&failing_syncs, 0);
    tu_server_destroy(&srv, false);
    idem_store_close(store);
    tu_rmtree(dir);
}

TestSuite(fast_claim, .init = setup, .fini = teardown, .timeout = 60);

/* The first run waits at the gate (after making the next fail_at_first_run syncs fail);
 * every run answers "ran <n>" and counts whether the fast path claimed its key. */
static idem_code gated_handler(idem_call *c, void *arg)
{
    (void)arg;
    int run = atomic_fetch_add(&runs, 1);
    atomic_fetch_add(&fast_claims, c->fast_claim ? 1 : 0);
    if (run == 0) {
        atomic_store(&failing_syncs, fail_at_first_run);
        pthread_mutex_lock(&gate_mu);
        first_running = true;
        pthread_cond_broadcast(&gate_cv);
        while (!first_may_answer) {
            pthread_cond_wait(&gate_cv, &gate_mu);
        }
        pthread_mutex_unlock(&gate_mu);
    }
    char out[32];
    int n = snprintf(out, sizeof(out), "ran %d", run + 1);
    return idem_call_reply(c, IDEM_OK, out, (size_t)n);
}

static void listen(void)
{
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(srv.srv, "f.Gate/Pay", gated_handler, NULL, &m), IDEM_OK,
                 "%s", idem_errmsg());
    tu_server_listen(&srv);
}

static void open_gate(void)
{
    pthread_mutex_lock(&gate_mu);
    first_may_answer = true;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

static void await_first_running(void)
{
    pthread_mutex_lock(&gate_mu);
    while (!first_running) {
        pthread_cond_wait(&gate_cv, &gate_mu);
    }
    pthread_mutex_unlock(&gate_mu);
}

typedef struct pay {
    idem_client *c;
    idem_result r;
    idem_code code;
} pay;

static idem_client *client(uint32_t attempts)
{
    return tu_client_attempts(srv.url, 10000, attempts);
}

static void *send_pay(void *arg)
{
    pay *p = arg;
    idem_request q = {
        .method = "f.Gate/Pay", .idempotency_key = "k1", .payload = "100", .payload_len = 3};
    p->code = idem_client_call(p->c, &q, &p->r);
    return NULL;
}

/* Something is queued for the store's writer thread (its open batch is past taking it). */
static bool writer_has_queued(void)
{
    idem_group_commit *gc = &((lmdb_store *)store)->gc;
    pthread_mutex_lock(&gc->mu);
    bool queued = gc->head != NULL;
    pthread_mutex_unlock(&gc->mu);
    return queued;
}

static bool says(const idem_result *r, const char *text)
{
    return r->payload_len == strlen(text) && memcmp(r->payload, text, r->payload_len) == 0;
}

/* One worker, held by the first run's handler: the duplicate's claim can only have been
 * queued by nng's callback thread. It waits behind the first run's open batch, is applied
 * once that has committed, finds the result, and replays it: the handler ran once. */
Test(fast_claim, a_duplicate_whose_claim_the_callback_queued_gets_the_first_result)
{
    start(1);
    listen();
    pay a = {.c = client(1)}, b = {.c = client(1)};
    pthread_t ta, tb;
    cr_assert_eq(pthread_create(&ta, NULL, send_pay, &a), 0);
    await_first_running();
    cr_assert_eq(pthread_create(&tb, NULL, send_pay, &b), 0);
    for (int i = 0; i < 1000 && !writer_has_queued(); i++) { /* polling, bounded at 10 s */
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL);
    }
    cr_expect(writer_has_queued(), "the duplicate's claim was never queued for the writer");
    open_gate();
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    cr_expect_eq(a.code, IDEM_OK, "%s", a.r.message ? a.r.message : "");
    cr_expect_eq(b.code, IDEM_OK, "%s", b.r.message ? b.r.message : "");
    cr_expect(says(&a.r, "ran 1") && says(&b.r, "ran 1"), "a: %.*s, b: %.*s", (int)a.r.payload_len,
              (const char *)a.r.payload, (int)b.r.payload_len, (const char *)b.r.payload);
    cr_expect(b.r.replayed, "the duplicate was not a replay");
    cr_expect_eq(atomic_load(&runs), 1, "the handler ran %d times", atomic_load(&runs));
    cr_expect_eq(atomic_load(&fast_claims), 1, "the first key was not claimed by the fast path");
    idem_result_clear(&a.r);
    idem_result_clear(&b.r);
    idem_client_close(a.c);
    idem_client_close(b.c);
}

/* The fast path's claim and its completion share a batch whose commit fails, and so does
 * the claim's redo: nothing of the call reached the disk, so its client is not told OK.
 * Its retry runs under a claim of its own and every OK for the key is that one. */
Test(fast_claim, a_claim_the_callback_queued_whose_batch_fails_is_never_answered_ok)
{
    start(4);
    fail_at_first_run = 2; /* the batch holding claim and completion, then the claim's redo */
    listen();
    open_gate(); /* the first run does not wait: it only makes the syncs fail */
    pay a = {.c = client(1)};
    send_pay(&a);
    cr_expect_eq(atomic_load(&failing_syncs), 0, "the batch and the redo met the failures");
    cr_expect_neq(a.code, IDEM_OK, "a call whose claim never reached the disk got OK: %.*s",
                  (int)a.r.payload_len, (const char *)a.r.payload);
    pay b = {.c = client(10)}, c = {.c = client(1)};
    send_pay(&b);
    send_pay(&c);
    cr_assert_eq(b.code, IDEM_OK, "%s", b.r.message ? b.r.message : "");
    cr_assert_eq(c.code, IDEM_OK, "%s", c.r.message ? c.r.message : "");
    cr_expect(says(&b.r, "ran 2") && says(&c.r, "ran 2") && c.r.replayed, "b: %.*s, c: %.*s",
              (int)b.r.payload_len, (const char *)b.r.payload, (int)c.r.payload_len,
              (const char *)c.r.payload);
    cr_expect_eq(atomic_load(&runs), 2);
    cr_expect_eq(atomic_load(&fast_claims), 2, "a run was not claimed by the fast path");
    idem_result_clear(&a.r);
    idem_result_clear(&b.r);
    idem_result_clear(&c.r);
    idem_client_close(a.c);
    idem_client_close(b.c);
    idem_client_close(c.c);
}

/* ---- a server destroyed while new keys arrive ---- */

static atomic_int answered;
static atomic_bool clients_stop;

static idem_code quick_handler(idem_call *c, void *arg)
{
    (void)arg;
    return idem_call_reply(c, IDEM_OK, "ok", 2);
}

static void *new_keys(void *arg)
{
    idem_client *c = tu_client_attempts(srv.url, 200, 1);
    for (int i = 0; !atomic_load(&clients_stop); i++) {
        char key[48];
        snprintf(key, sizeof(key), "k-%p-%d", arg, i);
        idem_request q = {
            .method = "f.Quick/Pay", .idempotency_key = key, .payload = "1", .payload_len = 1};
        idem_result r;
        if (idem_client_call(c, &q, &r) == IDEM_OK) {
            atomic_fetch_add(&answered, 1);
        }
        idem_result_clear(&r);
    }
    idem_client_close(c);
    return NULL;
}

/* Destroying a server while new keys arrive: 10 rounds of 4 clients calling new keys as
 * the server is destroyed; under ASan a job touched after it was freed, or a leak, fails
 * the run. The front's callbacks queue claims until the front closes, after the
 * dispatcher stopped: the front's close waits until the store has handed each such job
 * back. (A review found that interleaving, a claim queued between the dispatcher's stop
 * and the front's close; this test did not hit it in 8 runs without the wait: the window
 * is a few instructions wide. It guards the shutdown path as a whole.) */
Test(fast_claim, a_server_destroyed_while_new_keys_arrive_frees_no_job_still_handed_back,
     .timeout = 120)
{
    for (int round = 0; round < 10; round++) {
        start(2);
        ((lmdb_store *)store)->gc.hold_us = 2000; /* the default hold */
        idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
        cr_assert_eq(idem_server_register(srv.srv, "f.Quick/Pay", quick_handler, NULL, &m),
                     IDEM_OK);
        tu_server_listen(&srv);
        atomic_store(&answered, 0);
        atomic_store(&clients_stop, false);
        pthread_t t[4];
        for (intptr_t i = 0; i < 4; i++) {
            cr_assert_eq(pthread_create(&t[i], NULL, new_keys, (void *)i), 0);
        }
        for (int waited = 0; atomic_load(&answered) < 40 + round * 7 && waited < 2000; waited++) {
            struct timespec ts = {0, 1000 * 1000}; /* polling the answers, bounded */
            nanosleep(&ts, NULL);
        }
        cr_assert_geq(atomic_load(&answered), 40, "round %d: the server answered too few", round);
        tu_server_destroy(&srv, false); /* while the clients keep sending */
        atomic_store(&clients_stop, true);
        for (int i = 0; i < 4; i++) {
            pthread_join(t[i], NULL);
        }
        idem_store_close(store);
        tu_rmtree(dir);
        store = NULL;
        dir = NULL;
        srv.srv = NULL;
    }
}

/* Deterministic reproductions of what the fault campaign (chaos/) found. Each
 * test states the documented behaviour; each failed before its fix. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lmdb_internal.h" /* the test pins LMDB pages to fill a server's store */
#include "testutil.h"

static idem_code put_balance(idem_call *call, void *arg)
{
    (void)arg;
    long long balance = 700;
    idem_code code =
        idem_txn_put(idem_call_txn(call), "ledger", "acct-00", 7, &balance, sizeof(balance));
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    return idem_call_reply(call, IDEM_OK, "ok", 2);
}

/* txn.h: idem_store_app_get "reads a business value outside a handler (own read txn)";
 * store.h offers IDEM_STORE_READONLY for readers such as idemctl or an auditor. Found by
 * idemrpc-chaos's checker, which opens the campaign's store read-only after the run:
 * the first app_get of a database answers INTERNAL "write begin: Permission denied",
 * because store_dbi (src/store/lmdb/txn.c) opens the business database's handle
 * through a write transaction even when the database already exists. */
Test(chaos_findings, app_get_reads_business_data_from_a_read_only_store)
{
    tu_server ts;
    idem_server_opts o;
    idem_server_opts_init(&o);
    tu_server_create(&ts, &o);
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(ts.srv, "f.Ledger/Put", put_balance, NULL, &tx), IDEM_OK);
    tu_server_listen(&ts);
    idem_client *c = tu_client(ts.url, 2000);
    idem_request q = {.method = "f.Ledger/Put", .idempotency_key = "put-1"};
    idem_result r;
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s", r.message ? r.message : "");
    idem_result_clear(&r);
    idem_client_close(c);
    char *dir = ts.dir;
    tu_server_destroy(&ts, true);

    idem_store *ro;
    cr_assert_eq(idem_store_open_lmdb(&ro, dir, 0, IDEM_STORE_READONLY), IDEM_OK, "%s",
                 idem_errmsg());
    void *v = NULL;
    size_t n = 0;
    idem_code code = idem_store_app_get(ro, "ledger", "acct-00", 7, &v, &n);
    cr_expect_eq(code, IDEM_OK, "app_get on a read-only store: %s %s", idem_code_name(code),
                 idem_errmsg());
    if (code == IDEM_OK) {
        long long balance;
        cr_assert_eq(n, sizeof(balance));
        memcpy(&balance, v, sizeof(balance));
        cr_expect_eq(balance, 700);
    }
    free(v);
    idem_store_close(ro);
    tu_rmtree(dir);
}

/* ---- a claim born with an expired lease ---- */

#define LEASE_MS 300

static atomic_int slow_runs;
static atomic_bool holding;

/* Holds the store's one LMDB writer for 1 s, as a SIGSTOPped process holding it does. */
static idem_code hold_writer(idem_call *call, void *arg)
{
    (void)arg;
    atomic_store(&holding, true);
    usleep(1000 * 1000);
    return idem_call_reply(call, IDEM_OK, "held", 4);
}

static idem_code slow_add(idem_call *call, void *arg)
{
    (void)arg;
    char out[32];
    int n = snprintf(out, sizeof(out), "run %d", atomic_fetch_add(&slow_runs, 1) + 1);
    usleep(800 * 1000);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

typedef struct bg_call {
    pthread_t th;
    const char *url, *method, *key;
    idem_code code;
    char payload[32];
    bool replayed;
} bg_call;

static void *bg_call_main(void *arg)
{
    bg_call *b = arg;
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 5000;
    /* Retried as a client does: a claim answered after its lease does not start its
     * handler (ABORTED "claim lost", retryable; issue 35), its retry gets the result. */
    o.retry.max_attempts = 5;
    o.retry.period_ms = 20;
    cr_assert_eq(idem_client_open(&c, &b->url, 1, &o), IDEM_OK);
    idem_request q = {
        .method = b->method, .idempotency_key = b->key, .payload = "1", .payload_len = 1};
    idem_result r;
    b->code = idem_client_call(c, &q, &r);
    snprintf(b->payload, sizeof(b->payload), "%.*s", (int)r.payload_len,
             r.payload ? (const char *)r.payload : "");
    b->replayed = r.replayed;
    idem_result_clear(&r);
    idem_client_close(c);
    return NULL;
}

static void bg_start(bg_call *b, const char *url, const char *method, const char *key)
{
    *b = (bg_call){.url = url, .method = method, .key = key};
    cr_assert_eq(pthread_create(&b->th, NULL, bg_call_main, b), 0);
}

static void register_methods(idem_server *srv)
{
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(srv, "f.Writer/Hold", hold_writer, NULL, &tx), IDEM_OK);
    cr_assert_eq(idem_server_register(srv, "f.Counter/Add", slow_add, NULL, &cached), IDEM_OK);
}

/* Two servers on one LMDB store (y shares x's), both with LEASE_MS leases. */
static void start_pair(tu_server *x, tu_server *y)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.lease_ms = LEASE_MS;
    tu_server_create(x, &o);
    idem_server_opts_init(&o);
    o.lease_ms = LEASE_MS;
    o.store = idem_server_store(x->srv);
    tu_server_create(y, &o);
    register_methods(x->srv);
    register_methods(y->srv);
    tu_server_listen(x);
    tu_server_listen(y);
}

/* README: "the same call sent 10x → one execution", and a handler slower than its lease
 * keeps it by renewal. Found by idemrpc-chaos (lmdb topology, seed 777: keys ran twice
 * on live processes while the other server was SIGSTOPped holding the LMDB writer).
 * interceptors/result_cache.c:290-291 (look_or_claim: `req.now_ms = idem__rt_now_ms(...)`,
 * `req.lease_until_ms = req.now_ms + lease`) reads the clock BEFORE idem_store_claim
 * waits for the writer; LMDB's claim (src/store/lmdb/claim.c:42, :114) stores that lease_until
 * as given. A claim that waited longer than the lease for the writer is committed
 * already expired, and the lease keeper renews it only lease/3 after the handler
 * starts: a duplicate arriving in that window (here on a second server on the same
 * store) takes it over and runs the handler a second time while the first still runs. */
Test(chaos_findings, a_claim_that_waited_for_the_writer_longer_than_its_lease_runs_once)
{
    tu_server x, y;
    start_pair(&x, &y);

    bg_call hold, first, second;
    bg_start(&hold, x.url, "f.Writer/Hold", "hold-1");
    while (!atomic_load(&holding)) {
        usleep(1000);
    }
    bg_start(&first, x.url, "f.Counter/Add", "pay-1"); /* its claim waits ~1 s */
    pthread_join(hold.th, NULL);                       /* the writer is free again */
    cr_assert_eq(hold.code, IDEM_OK);
    usleep(30 * 1000);                                  /* < LEASE_MS / 3 */
    bg_start(&second, y.url, "f.Counter/Add", "pay-1"); /* a retry, on the other server */
    pthread_join(first.th, NULL);
    pthread_join(second.th, NULL);

    cr_expect_eq(atomic_load(&slow_runs), 1, "the handler ran %d times for one key",
                 atomic_load(&slow_runs));
    cr_expect_str_eq(second.payload, first.payload, "first '%s' (%s), retry '%s' (%s)",
                     first.payload, idem_code_name(first.code), second.payload,
                     idem_code_name(second.code));
    tu_server_destroy(&y, true);
    tu_server_destroy(&x, false);
}

/* README: "a handler slower than its lease → the lease is renewed; one execution". Found
 * while chasing the open finding of issue 16 (lmdb, seed 16016, 300 s: a key ran twice
 * when the store took no write for about 2 s around a SIGKILL of the other server): the
 * lease keeper (src/dispatch/inflight.c, renew_one) computes `wall + lease` BEFORE
 * idem_store_renew waits for the LMDB writer, and LMDB's renew (src/store/lmdb/claim.c,
 * renew_apply) stores it as given. After any stall longer than the lease the live
 * owner's renewal commits a lease that has already run out, and a duplicate's claim
 * queued behind it (its re-read saw the lease run out during the stall) takes over. */
Test(chaos_findings, a_renewal_that_waited_for_the_writer_longer_than_its_lease_keeps_the_claim)
{
    tu_server x, y;
    start_pair(&x, &y);

    bg_call first, hold, second;
    bg_start(&first, x.url, "f.Counter/Add", "pay-2"); /* claims, runs 800 ms */
    while (atomic_load(&slow_runs) == 0) {
        usleep(1000);
    }
    usleep(20 * 1000);
    bg_start(&hold, x.url, "f.Writer/Hold", "hold-2"); /* the writer, for 1 s */
    while (!atomic_load(&holding)) {
        usleep(1000);
    }
    usleep(100 * 1000); /* the first renewal (at LEASE_MS / 3) waits for the writer */
    bg_start(&second, y.url, "f.Counter/Add", "pay-2"); /* parks, re-reads, claims */
    pthread_join(hold.th, NULL);
    pthread_join(first.th, NULL);
    pthread_join(second.th, NULL);

    cr_expect_eq(atomic_load(&slow_runs), 1, "the handler ran %d times for one key",
                 atomic_load(&slow_runs));
    cr_expect_eq(first.code, IDEM_OK, "%s", idem_code_name(first.code));
    cr_expect_str_eq(second.payload, first.payload, "first '%s' (%s), retry '%s' (%s)",
                     first.payload, idem_code_name(first.code), second.payload,
                     idem_code_name(second.code));
    tu_server_destroy(&y, true);
    tu_server_destroy(&x, false);
}

/* ---- a store that fills up ---- */

typedef struct ballast {
    idem_store *st;
    MDB_txn *pin;
    int n;
    size_t size; /* of the next value */
} ballast;

static idem_code ballast_put(idem_txn *t, void *arg)
{
    static const char zeros[65536];
    ballast *b = arg;
    char key[16];
    snprintf(key, sizeof(key), "b%06d", b->n);
    return idem_txn_put(t, "ballast", key, strlen(key), zeros, b->size);
}

static idem_code ballast_delete_all(idem_txn *t, void *arg)
{
    ballast *b = arg;
    idem_code code = IDEM_OK;
    for (int i = 0; i < b->n && code == IDEM_OK; i++) {
        char key[16];
        snprintf(key, sizeof(key), "b%06d", i);
        code = idem_txn_del(t, "ballast", key, strlen(key));
    }
    return code;
}

/* Fills the store to its last page as another program on it would (idemrpc-chaos's
 * store agent does the same): a read txn first (the pin: LMDB reuses no page freed while
 * it lasts, so no write of anyone can commit), then values until RESOURCE_EXHAUSTED. */
static void ballast_fill(ballast *b)
{
    static const size_t sizes[] = {65536, 4096, 256, 16};
    cr_assert_eq(mdb_txn_begin(((lmdb_store *)b->st)->env, NULL, MDB_RDONLY, &b->pin), 0);
    idem_code code = IDEM_OK;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        b->size = sizes[i];
        while ((code = idem_store_run_txn(b->st, ballast_put, b)) == IDEM_OK) {
            b->n++;
        }
    }
    cr_assert_eq(code, IDEM_RESOURCE_EXHAUSTED, "%s", idem_errmsg());
}

/* Space returns: the pin ends, the ballast goes. */
static void ballast_free(ballast *b)
{
    mdb_txn_abort(b->pin);
    cr_assert_eq(idem_store_run_txn(b->st, ballast_delete_all, b), IDEM_OK, "%s", idem_errmsg());
}

static atomic_int once_runs;
static atomic_bool once_running, once_go;

static idem_code add_when_told(idem_call *call, void *arg)
{
    (void)arg;
    char out[32];
    int n = snprintf(out, sizeof(out), "run %d", atomic_fetch_add(&once_runs, 1) + 1);
    atomic_store(&once_running, true);
    while (!atomic_load(&once_go)) {
        usleep(1000);
    }
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* Calls method/key on x in the background; once its handler says *running, fills the
 * store, lets the handler go on (*go) into the full store, keeps it full for three
 * leases, frees the space, then retries the call (*retry) once the first has ended. */
static void call_into_a_full_store(tu_server *x, const char *method, const char *key,
                                   atomic_bool *running, atomic_bool *go, bg_call *first,
                                   bg_call *retry)
{
    bg_start(first, x->url, method, key);
    while (!atomic_load(running)) {
        usleep(1000);
    }
    ballast b = {.st = idem_server_store(x->srv)};
    ballast_fill(&b);
    atomic_store(go, true);      /* the handler ends into a full store */
    usleep(3 * LEASE_MS * 1000); /* full for three leases: what the test is about */
    ballast_free(&b);
    pthread_join(first->th, NULL);
    bg_start(retry, x->url, method, key);
    pthread_join(retry->th, NULL);
}

/* README: store full → "RESOURCE_EXHAUSTED; nothing half-written", and a retry with the
 * same key replays the first result. Found by idemrpc-chaos's fill fault (lmdb topology):
 * a claim-mode handler that finished while the store was full answered OK, but
 * record_retrying (interceptors/result_cache.c) retried only UNAVAILABLE, so the
 * completion's RESOURCE_EXHAUSTED ended the claim's renewal and left it IN_PROGRESS; once
 * space returned and its lease had passed, the retry took it over and ran the handler a
 * second time, with a second, different OK. */
Test(chaos_findings, a_result_that_meets_a_full_store_is_recorded_when_space_returns)
{
    tu_server x;
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.lease_ms = LEASE_MS;
    o.map_size = 1 << 20;
    tu_server_create(&x, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(x.srv, "f.Counter/Once", add_when_told, NULL, &cached),
                 IDEM_OK);
    tu_server_listen(&x);

    bg_call first, retry;
    call_into_a_full_store(&x, "f.Counter/Once", "once-1", &once_running, &once_go, &first, &retry);
    cr_assert_eq(first.code, IDEM_OK, "%s", idem_code_name(first.code));

    cr_expect_eq(atomic_load(&once_runs), 1, "the handler ran %d times for one key",
                 atomic_load(&once_runs));
    cr_expect_str_eq(retry.payload, first.payload, "first '%s', retry '%s' (%s)", first.payload,
                     retry.payload, idem_code_name(retry.code));
    cr_expect(retry.replayed);
    tu_server_destroy(&x, false);
}

/* ---- a journaled step whose record meets a full store ---- */

static atomic_int step_runs;
static atomic_bool step_running, step_go;

/* The step's effect (counted), then its output once the test says so. */
static idem_code step_when_told(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call;
    (void)arg;
    char buf[32];
    int n = snprintf(buf, sizeof(buf), "charge %d", atomic_fetch_add(&step_runs, 1) + 1);
    atomic_store(&step_running, true);
    while (!atomic_load(&step_go)) {
        usleep(1000);
    }
    cr_assert_not_null(out->data = malloc((size_t)n));
    memcpy(out->data, buf, (size_t)n);
    out->len = (size_t)n;
    return IDEM_OK;
}

static idem_code pay_once(idem_call *call, void *arg)
{
    (void)arg;
    idem_step_result r;
    idem_code code = idem_call_step(call, "charge", step_when_told, NULL, &r);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    code = idem_call_reply(call, IDEM_OK, r.data, r.len);
    idem_step_result_clear(&r);
    return code;
}

/* downstream.h: a step's fn "may still run twice if the process dies after fn's effect
 * and before its record". Found by idemrpc-chaos (chaos.Trip/Book, lmdb fill fault; the
 * pg topology's PostgreSQL restart gives UNAVAILABLE the same way): a step whose record
 * met a full store lost it at once, with no process dying: idem_call_step
 * (src/toolkit/steps.c) returned the record txn's RESOURCE_EXHAUSTED, the call was
 * released, and the client's retry ran the step's effect a second time (a second
 * charge). The outcome's completion already waits out a full or unreachable store
 * (record_retrying, interceptors/result_cache.c); the step's record did not. */
Test(chaos_findings, a_step_whose_record_meets_a_full_store_runs_once)
{
    tu_server x;
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.lease_ms = LEASE_MS;
    o.map_size = 1 << 20;
    tu_server_create(&x, &o);
    idem_method_opts steps = {.flags = IDEM_METHOD_STEPS};
    cr_assert_eq(idem_server_register(x.srv, "f.Pay/Once", pay_once, NULL, &steps), IDEM_OK);
    tu_server_listen(&x);

    bg_call first, retry;
    call_into_a_full_store(&x, "f.Pay/Once", "pay-1", &step_running, &step_go, &first, &retry);

    cr_expect_eq(atomic_load(&step_runs), 1, "the step ran %d times for one call (first: %s)",
                 atomic_load(&step_runs), idem_code_name(first.code));
    cr_expect_eq(first.code, IDEM_OK, "%s", idem_code_name(first.code));
    cr_expect_eq(retry.code, IDEM_OK, "%s", idem_code_name(retry.code));
    cr_expect_str_eq(retry.payload, "charge 1", "retry '%s'", retry.payload);
    tu_server_destroy(&x, false);
}

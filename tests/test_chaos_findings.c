/* Deterministic reproductions of what the fault campaign (bench/chaos*.c) found. Each
 * test states the documented behaviour; each failed before its fix. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    o.retry.max_attempts = 1;
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
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.lease_ms = LEASE_MS;
    tu_server_create(&x, &o);
    idem_server_opts_init(&o);
    o.lease_ms = LEASE_MS;
    o.store = idem_server_store(x.srv);
    tu_server_create(&y, &o);
    register_methods(x.srv);
    register_methods(y.srv);
    tu_server_listen(&x);
    tu_server_listen(&y);

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

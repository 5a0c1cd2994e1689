/* The PostgreSQL store against a real server ($IDEMRPC_TEST_PG, started by .ci/run via
 * scripts/services.sh): the store contract, and several server instances sharing it. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "call.h"
#include "server_internal.h"
#include "testutil.h"

static idem_store *st;
static char prefix[40]; /* per-test key prefix: tests share one database */

static void setup(void)
{
    const char *pg = getenv("IDEMRPC_TEST_PG");
    if (pg == NULL) {
        cr_skip_test("IDEMRPC_TEST_PG not set (bash scripts/services.sh start sets it)");
    }
    cr_assert_eq(idem_store_open_postgres(&st, pg, 4), IDEM_OK, "%s", idem_errmsg());
    snprintf(prefix, sizeof(prefix), "t%016llx", (unsigned long long)idem__random_u64());
}

static void teardown(void)
{
    idem_store_close(st);
    st = NULL;
}

TestSuite(pg, .init = setup, .fini = teardown, .timeout = 120);

static idem_claim_req req_for(const char *key, uint8_t fp, uint64_t now)
{
    static char buf[8][96];
    static int next;
    char *k = buf[next++ % 8];
    snprintf(k, 96, "%s-%s", prefix, key);
    idem_claim_req r = {.key = {"tenant", "pg.Test/Op", k},
                        .owner = idem__random_u64(),
                        .now_ms = now,
                        .lease_until_ms = now + 1000,
                        .expires_ms = now + 60000};
    memset(r.fingerprint, fp, sizeof(r.fingerprint));
    return r;
}

static idem_claim_outcome claim(idem_claim_req *r, idem_record *rec)
{
    idem_claim_outcome out = 0;
    cr_assert_eq(idem_store_claim(st, r, &out, rec), IDEM_OK, "%s", idem_errmsg());
    return out;
}

/* (caller, method, key) are separate columns of the primary key: parts that would run
 * together in one string stay distinct. */
Test(pg, record_keys_keep_their_parts_apart)
{
    idem_claim_req r = req_for("parts", 1, idem__now_ms());
    const char *key = r.key.key;
    static const char *const parts[][2] = {
        {"ab", "c.S/M"}, {"a", "bc.S/M"}, {"a:b", "c.S/M"}, {"a", "b:c.S/M"}};
    for (size_t i = 0; i < 4; i++) {
        r.key = (idem_key_ref){parts[i][0], parts[i][1], key};
        r.owner = idem__random_u64();
        cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED, "%s|%s shares a row", parts[i][0],
                     parts[i][1]);
    }
}

Test(pg, claim_complete_replay_and_mismatch)
{
    uint64_t now = idem__now_ms();
    idem_claim_req a = req_for("k1", 1, now), b = req_for("k1", 1, now), c = req_for("k1", 2, now);
    b.key.key = c.key.key = a.key.key;
    idem_record rec;
    cr_expect_eq(claim(&a, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(claim(&b, NULL), IDEM_CLAIM_IN_PROGRESS);
    cr_expect_eq(claim(&c, NULL), IDEM_CLAIM_MISMATCH);
    cr_expect_eq(idem_store_complete(st, &b.key, b.owner, "x", 1, now + 60000), IDEM_ABORTED,
                 "only the owner completes");
    cr_assert_eq(idem_store_complete(st, &a.key, a.owner, "first", 5, now + 60000), IDEM_OK);
    cr_expect_eq(claim(&b, &rec), IDEM_CLAIM_COMPLETED);
    cr_expect_eq(rec.response_len, 5);
    cr_expect_eq(memcmp(rec.response, "first", 5), 0);
    idem_record_clear(&rec);
    cr_expect_eq(idem_store_get(st, &a.key, &rec), IDEM_OK);
    cr_expect_eq(rec.state, IDEM_REC_COMPLETED);
    idem_record_clear(&rec);
    cr_expect_eq(idem_store_delete(st, &a.key), IDEM_OK);
    cr_expect_eq(idem_store_get(st, &a.key, &rec), IDEM_NOT_FOUND);
}

/* Claims r again (a new owner) until its lease has run out on the database clock. */
static idem_claim_outcome claim_until_taken_over(idem_claim_req *r)
{
    idem_claim_outcome out = IDEM_CLAIM_IN_PROGRESS;
    uint64_t give_up = idem__mono_ms() + 5000;
    while (out == IDEM_CLAIM_IN_PROGRESS && idem__mono_ms() < give_up) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL); /* the lease is 50 ms of database time */
        r->owner++;
        out = claim(r, NULL);
    }
    return out;
}

Test(pg, release_and_expired_lease_takeover)
{
    uint64_t now = idem__now_ms();
    idem_claim_req a = req_for("k2", 1, now);
    cr_expect_eq(claim(&a, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(idem_store_release(st, &a.key, a.owner), IDEM_OK);
    a.lease_until_ms = now + 50;
    cr_expect_eq(claim(&a, NULL), IDEM_CLAIM_ACQUIRED, "released keys can be claimed again");
    idem_claim_req late = a;
    cr_expect_eq(claim_until_taken_over(&late), IDEM_CLAIM_TAKEN_OVER);
    cr_expect_eq(idem_store_complete(st, &a.key, a.owner, "old", 3, now + 60000), IDEM_ABORTED);
    cr_expect_eq(idem_store_complete(st, &late.key, late.owner, "new", 3, now + 60000), IDEM_OK);
}

Test(pg, leases_and_expiry_follow_the_database_clock_not_the_callers)
{
    uint64_t skewed = idem__now_ms() + 3600 * 1000; /* an instance one hour ahead */
    idem_claim_req a = req_for("skew", 1, idem__now_ms()), b = a;
    cr_expect_eq(claim(&a, NULL), IDEM_CLAIM_ACQUIRED);
    b.owner = a.owner + 1;
    b.now_ms = skewed;
    b.lease_until_ms = skewed + 1000;
    b.expires_ms = skewed + 60000;
    cr_expect_eq(claim(&b, NULL), IDEM_CLAIM_IN_PROGRESS, "no early takeover");
    cr_expect_eq(idem_store_complete(st, &a.key, a.owner, "r", 1, a.now_ms + 60000), IDEM_OK);
    cr_expect_eq(claim(&b, NULL), IDEM_CLAIM_COMPLETED, "and no early expiry");
}

Test(pg, store_assigned_owners_only_grow_and_renew_keeps_the_lease)
{
    idem_claim_req a = req_for("f1", 1, idem__now_ms()), b = req_for("f2", 1, idem__now_ms());
    idem_record ra, rb;
    a.owner = b.owner = 0;
    a.lease_until_ms = a.now_ms + 100;
    cr_expect_eq(claim(&a, &ra), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(claim(&b, &rb), IDEM_CLAIM_ACQUIRED);
    cr_expect_gt(rb.owner, ra.owner, "a later claim has a larger fence");
    for (int i = 0; i < 5; i++) { /* renewed past its first 100 ms */
        uint64_t now = idem__now_ms();
        cr_assert_eq(idem_store_renew(st, &a.key, ra.owner, now + 100, now), IDEM_OK);
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL); /* half a lease: the heartbeat the server keeps */
        idem_claim_req again = a;
        again.owner = ra.owner + 1000;
        cr_expect_eq(claim(&again, NULL), IDEM_CLAIM_IN_PROGRESS, "renewal %d kept it", i);
    }
    cr_expect_eq(idem_store_renew(st, &a.key, ra.owner + 1, idem__now_ms() + 100, idem__now_ms()),
                 IDEM_ABORTED, "only the owner renews");
}

Test(pg, release_restores_the_token_the_claim_consumed)
{
    uint64_t now = idem__now_ms();
    char tok[64];
    snprintf(tok, sizeof(tok), "%s-rtok", prefix);
    cr_assert_eq(idem_store_token_put(st, tok, "tenant", now + 60000), IDEM_OK);
    idem_claim_req r = req_for("rtok", 1, now);
    r.key.key = tok;
    r.token = tok;
    cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(idem_store_release(st, &r.key, r.owner), IDEM_OK);
    r.owner++;
    cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED, "the token is back: the retry claims");
    cr_expect_eq(idem_store_complete(st, &r.key, r.owner, "ok", 2, now + 60000), IDEM_OK);
    cr_expect_eq(idem_store_token_consume(st, tok, "tenant", now), IDEM_FAILED_PRECONDITION,
                 "a completion uses it up for good");
}

Test(pg, token_is_consumed_with_the_claim_and_scoped)
{
    uint64_t now = idem__now_ms();
    char tok[64];
    snprintf(tok, sizeof(tok), "%s-tok", prefix);
    cr_assert_eq(idem_store_token_put(st, tok, "tenant", now + 60000), IDEM_OK);
    cr_expect_eq(idem_store_token_put(st, tok, "tenant", now + 60000), IDEM_ALREADY_EXISTS);
    idem_claim_req r = req_for("tok", 1, now);
    r.key.key = tok;
    r.token = tok;
    r.key.caller = "intruder";
    idem_claim_outcome out;
    idem_record rec;
    cr_expect_eq(idem_store_claim(st, &r, &out, NULL), IDEM_PERMISSION_DENIED);
    r.key.caller = "tenant";
    cr_expect_eq(idem_store_get(st, &r.key, &rec), IDEM_NOT_FOUND, "a refused claim wrote nothing");
    cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED, "the token survived the refused claim");
    cr_expect_eq(idem_store_token_consume(st, tok, "tenant", now), IDEM_FAILED_PRECONDITION,
                 "used up by the claim");
    idem_claim_req again = r;
    again.owner++;
    cr_expect_eq(claim(&again, NULL), IDEM_CLAIM_IN_PROGRESS, "a retry finds the record");
}

Test(pg, sweep_deletes_expired_rows_in_bounded_batches)
{
    uint64_t now = idem__now_ms();
    char key[32];
    for (int i = 0; i < 30; i++) {
        snprintf(key, sizeof(key), "sw%d", i);
        idem_claim_req r = req_for(key, 1, now - 100000);
        r.expires_ms = 1; /* long expired: every sweep may take it */
        claim(&r, NULL);
    }
    size_t n, total = 0;
    do {
        cr_assert_eq(idem_store_sweep(st, now, 10, &n), IDEM_OK, "%s", idem_errmsg());
        cr_assert_leq(n, 10);
        total += n;
    } while (n == 10);
    cr_expect_geq(total, 30);
}

/* ---- two server instances on one database ---- */

#define KEYS 20
#define CLIENTS 32

static atomic_int executions[KEYS];
static tu_server srv[2];
static idem_store *stores[2];

static idem_code h_charge(idem_call *call, void *arg)
{
    (void)arg;
    const char *k = idem_call_key(call);
    int i = atoi(strrchr(k, '-') + 1);
    int n = atomic_fetch_add(&executions[i], 1) + 1;
    char out[64];
    int len = snprintf(out, sizeof(out), "%s ran %d time(s)", k, n);
    return idem_call_reply(call, IDEM_OK, out, (size_t)len);
}

static void start_instances(void)
{
    for (int i = 0; i < 2; i++) {
        idem_server_opts o;
        idem_server_opts_init(&o);
        o.contexts = 16;
        o.log_level = IDEM_LOG_OFF; /* the restart test makes calls fail on purpose */
        cr_assert_eq(idem_store_open_postgres(&stores[i], getenv("IDEMRPC_TEST_PG"), 16), IDEM_OK);
        o.store = stores[i];
        tu_server_create(&srv[i], &o);
        idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
        cr_assert_eq(idem_server_register(srv[i].srv, "pg.Pay/Charge", h_charge, NULL, &m),
                     IDEM_OK);
        tu_server_listen(&srv[i]);
    }
}

static void stop_instances(void)
{
    for (int i = 0; i < 2; i++) {
        tu_server_destroy(&srv[i], false);
        idem_store_close(stores[i]);
    }
}

static struct {
    pthread_mutex_t mu;
    char first[KEYS][64];
    atomic_int mismatches, failed, calls, attempts;
    atomic_bool keep_going; /* set while the database restarts */
} R = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void *client_thread(void *arg)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.deadline_ms = 30000;
    o.attempt_timeout_ms = 3000;
    o.retry.max_attempts = 20;
    const char *urls[] = {srv[0].url, srv[1].url};
    if (idem_client_open(&c, urls, 2, &o) != IDEM_OK) {
        atomic_fetch_add(&R.failed, 1);
        return NULL;
    }
    long id = (long)arg;
    for (int round = 0; round < 3 || atomic_load(&R.keep_going); round++) {
        for (int k = 0; k < KEYS; k++) {
            char key[96];
            int i = (k + (int)id) % KEYS;
            snprintf(key, sizeof(key), "%s-%d", prefix, i);
            idem_request q = {.method = "pg.Pay/Charge", .idempotency_key = key};
            idem_result r;
            idem_code code = idem_client_call(c, &q, &r);
            atomic_fetch_add(&R.calls, 1);
            atomic_fetch_add(&R.attempts, (int)r.attempts);
            if (code != IDEM_OK) {
                atomic_fetch_add(&R.failed, 1);
            } else {
                pthread_mutex_lock(&R.mu);
                if (R.first[i][0] == '\0') {
                    snprintf(R.first[i], sizeof(R.first[i]), "%s", (char *)r.payload);
                } else if (strcmp(R.first[i], r.payload) != 0) {
                    atomic_fetch_add(&R.mismatches, 1);
                }
                pthread_mutex_unlock(&R.mu);
            }
            idem_result_clear(&r);
        }
    }
    idem_client_close(c);
    return NULL;
}

static void run_storm(bool restart_db_midway)
{
    pthread_t t[CLIENTS];
    start_instances();
    atomic_store(&R.keep_going, restart_db_midway);
    for (long i = 0; i < CLIENTS; i++) {
        pthread_create(&t[i], NULL, client_thread, (void *)i);
    }
    if (restart_db_midway) {
        char cmd[512];
        snprintf(cmd, sizeof(cmd), "%s restart-pg", getenv("IDEMRPC_SERVICES"));
        cr_expect_eq(system(cmd), 0, "restarting PostgreSQL");
        atomic_store(&R.keep_going, false);
    }
    for (int i = 0; i < CLIENTS; i++) {
        pthread_join(t[i], NULL);
    }
    stop_instances();
    cr_expect_eq(atomic_load(&R.failed), 0, "every call answered OK in the end");
    if (restart_db_midway) {
        cr_expect_gt(atomic_load(&R.attempts), atomic_load(&R.calls),
                     "calls in flight during the restart were retried");
    }
    cr_expect_eq(atomic_load(&R.mismatches), 0, "all responses for a key are identical");
    for (int i = 0; i < KEYS; i++) {
        cr_expect_eq(atomic_load(&executions[i]), 1, "key %d ran %d times", i,
                     atomic_load(&executions[i]));
    }
}

Test(pg, two_instances_one_database_one_execution_per_key)
{
    run_storm(false);
}

Test(pg, database_restart_mid_run_is_retried_and_duplicates_nothing)
{
    if (getenv("IDEMRPC_SERVICES") == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set: cannot restart PostgreSQL");
    }
    run_storm(true);
}

static idem_code h_noop(idem_call *call, void *arg)
{
    (void)arg;
    return idem_call_reply(call, IDEM_OK, NULL, 0);
}

Test(pg, transactional_methods_are_refused_on_postgres)
{
    idem_server_opts o;
    idem_server *s;
    idem_server_opts_init(&o);
    o.store = st;
    cr_assert_eq(idem_server_create(&s, &o), IDEM_OK);
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL};
    cr_assert_eq(idem_server_register(s, "pg.Tx/Op", h_noop, NULL, &tx), IDEM_OK);
    cr_expect_eq(idem_server_listen(s, "tcp://127.0.0.1:0"), IDEM_FAILED_PRECONDITION);
    cr_expect_neq(strstr(idem_errmsg(), "needs the LMDB store"), NULL, "%s", idem_errmsg());
    idem_server_destroy(s);
}

/* ---- a claim is not the other instance's to take because their clocks disagree ---- */

static struct {
    atomic_int entered, executions;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool open;
} G = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static idem_code h_gated_charge(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&G.entered, 1);
    pthread_mutex_lock(&G.mu);
    while (!G.open) {
        pthread_cond_wait(&G.cv, &G.mu);
    }
    pthread_mutex_unlock(&G.mu);
    atomic_fetch_add(&G.executions, 1);
    return idem_call_reply(call, IDEM_OK, "charged", 7);
}

static void open_charge_gate(void)
{
    pthread_mutex_lock(&G.mu);
    G.open = true;
    pthread_cond_broadcast(&G.cv);
    pthread_mutex_unlock(&G.mu);
}

/* Server B's wall clock: an hour ahead, so every lease A grants looks long expired. */
static uint64_t an_hour_ahead(void *arg)
{
    (void)arg;
    return idem__now_ms() + 3600u * 1000u;
}

static void start_skewed_pair(void)
{
    for (int i = 0; i < 2; i++) {
        idem_server_opts o;
        idem_server_opts_init(&o);
        o.contexts = 8;
        o.max_wait_ms = 300; /* B's duplicate gives up waiting soon: the gate is shut */
        cr_assert_eq(idem_store_open_postgres(&stores[i], getenv("IDEMRPC_TEST_PG"), 4), IDEM_OK,
                     "%s", idem_errmsg());
        o.store = stores[i];
        tu_server_create(&srv[i], &o);
        if (i == 1) {
            idem__server_set_clock(srv[i].srv, an_hour_ahead, NULL);
        }
        idem_method_opts m = {.flags = IDEM_METHOD_CACHED, .lease_ms = 2000};
        cr_assert_eq(idem_server_register(srv[i].srv, "pg.Lease/Charge", h_gated_charge, NULL, &m),
                     IDEM_OK);
        tu_server_listen(&srv[i]);
    }
}

struct charge_arg {
    const char *url, *key;
    idem_result r;
    idem_code code;
};

static void *charge_on_a(void *p)
{
    struct charge_arg *a = p;
    idem_client *c = tu_client(a->url, 5000);
    idem_request q = {.method = "pg.Lease/Charge", .idempotency_key = a->key};
    a->code = idem_client_call(c, &q, &a->r);
    idem_client_close(c);
    return NULL;
}

/* One call on B as a raw frame without a deadline: B's clock would judge any deadline
 * long past, and the point is its lease arithmetic, not its deadline check. B waits at
 * most its max_wait_ms (300) for A, then must answer "in progress", never run. */
static Idem__V1__Response *charge_once_on_b(const char *key)
{
    size_t len;
    void *frame = tu_pack_request("pg.Lease/Charge", key, NULL, NULL, &len);
    Idem__V1__Response *r = tu_raw_call(srv[1].url, frame, len, 5000);
    free(frame);
    return r;
}

static bool await_entered(int n)
{
    for (int i = 0; i < 5000 && atomic_load(&G.entered) < n; i++) {
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL); /* polling a counter, bounded at 5 s */
    }
    return atomic_load(&G.entered) >= n;
}

Test(pg, instance_with_a_clock_an_hour_ahead_does_not_take_over_a_live_claim)
{
    char key[96];
    snprintf(key, sizeof(key), "%s-skew", prefix);
    start_skewed_pair();
    pthread_t t;
    struct charge_arg a = {.url = srv[0].url, .key = key};
    pthread_create(&t, NULL, charge_on_a, &a);
    cr_assert(await_entered(1), "the handler on A never started");
    Idem__V1__Response *b = charge_once_on_b(key);
    int entered = atomic_load(&G.entered);
    cr_expect_not_null(b, "B did not answer within 5 s");
    cr_expect_eq(entered, 1, "B took over the claim A holds");
    if (b != NULL) {
        cr_expect_eq(b->code, IDEM__V1__CODE__ABORTED, "B answered %s: %s", idem_code_name(b->code),
                     b->message);
        cr_expect_neq(strstr(b->message, "in progress"), NULL, "%s", b->message);
    }
    tu_response_free(b);
    open_charge_gate();
    pthread_join(t, NULL);
    cr_expect_eq(a.code, IDEM_OK, "%s", a.r.message);
    idem_result_clear(&a.r);
    stop_instances(); /* lets any handler still running finish before counting */
    cr_expect_eq(atomic_load(&G.executions), 1);
    idem_key_ref k = {"", "pg.Lease/Charge", key};
    idem_store_delete(st, &k);
}

/* The PostgreSQL store against a real server ($IDEMRPC_TEST_PG, started by .ci/run via
 * scripts/services.sh): the store contract, and several server instances sharing it. */
#include <criterion/criterion.h>
#include <libpq-fe.h>
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
    cr_assert_eq(tu_pg_open(&st, pg, 4), IDEM_OK, "%s", idem_errmsg());
    snprintf(prefix, sizeof(prefix), "t%016llx", (unsigned long long)idem__random_u64());
}

static void teardown(void)
{
    idem_store_close(st);
    st = NULL;
}

TestSuite(pg, .init = setup, .fini = teardown, .timeout = 120);

/* Waits, bounded at 5 s, until *v is no longer not_value (set by another thread). */
static bool await_int(atomic_int *v, int not_value)
{
    for (int i = 0; i < 500 && atomic_load(v) == not_value; i++) {
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL); /* polling a flag set by another thread, bounded at 5 s */
    }
    return atomic_load(v) != not_value;
}

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
    a.lease_until_ms = a.now_ms + 300;
    cr_expect_eq(claim(&a, &ra), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(claim(&b, &rb), IDEM_CLAIM_ACQUIRED);
    cr_expect_gt(rb.owner, ra.owner, "a later claim has a larger fence");
    /* Renewed past its first 300 ms; a third of a lease between renewals, as the server's
     * heartbeat, leaves room for a loaded machine's scheduling. */
    for (int i = 0; i < 5; i++) {
        uint64_t now = idem__now_ms();
        cr_assert_eq(idem_store_renew(st, &a.key, ra.owner, now + 300, now), IDEM_OK);
        struct timespec ts = {0, 100 * 1000000L};
        nanosleep(&ts, NULL);
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
        cr_assert_eq(tu_pg_open(&stores[i], getenv("IDEMRPC_TEST_PG"), 16), IDEM_OK);
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
    idem_store_stats s0 = {0}, s1 = {0};
    idem_store_stats_get(stores[0], &s0);
    idem_store_stats_get(stores[1], &s1);
    stop_instances();
    cr_expect_eq(atomic_load(&R.failed), 0, "every call answered OK in the end");
    if (restart_db_midway) { /* by the client's retryer, or by the store's reconnect */
        cr_expect(atomic_load(&R.attempts) > atomic_load(&R.calls) ||
                      s0.reconnects + s1.reconnects > 0,
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

/* ---- transactional handlers: the claim, the business SQL and the record, one txn ---- */

/* A schema of the test's own with the user's business tables, the seeds' pattern: a
 * callback table with a unique key, an order moved only out of CREATED. */
static char tx_schema[32];
static char *tx_conninfo;
static atomic_int tx_runs, tx_transient_left;

static void tx_schema_create(void)
{
    tx_conninfo = tu_pg_schema_create(tx_schema);
    PGconn *c = PQconnectdb(tx_conninfo);
    cr_assert_eq(PQstatus(c), CONNECTION_OK, "%s", PQerrorMessage(c));
    PGresult *r = PQexec(c, "CREATE TABLE pay_callback (out_trade_no text, channel text, amount "
                            "bigint, CONSTRAINT uk_pay_callback UNIQUE (out_trade_no, channel));"
                            "CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL);"
                            "INSERT INTO orders VALUES ('o1', 'CREATED'), ('o2', 'CREATED'),"
                            " ('o3', 'CREATED')");
    cr_assert_eq(PQresultStatus(r), PGRES_COMMAND_OK, "%s", PQresultErrorMessage(r));
    PQclear(r);
    PQfinish(c);
}

static void tx_schema_drop(void)
{
    tu_pg_schema_drop(tx_schema);
    free(tx_conninfo);
}

/* One string from the test's schema, e.g. "SELECT status FROM orders WHERE id = 'o1'". */
static char *tx_query(const char *sql)
{
    static char out[64];
    PGconn *c = PQconnectdb(tx_conninfo);
    PGresult *r = PQexec(c, sql);
    cr_assert_eq(PQresultStatus(r), PGRES_TUPLES_OK, "%s", PQresultErrorMessage(r));
    snprintf(out, sizeof(out), "%s", PQntuples(r) == 1 ? PQgetvalue(r, 0, 0) : "(none)");
    PQclear(r);
    PQfinish(c);
    return out;
}

static idem_code sql(idem_call *call, PGconn *c, const char *q, int n, const char *const *params,
                     const char *want_rows)
{
    PGresult *r = PQexecParams(c, q, n, NULL, params, NULL, NULL, 0);
    ExecStatusType s = PQresultStatus(r);
    bool ok =
        s == PGRES_COMMAND_OK && (want_rows == NULL || strcmp(PQcmdTuples(r), want_rows) == 0);
    idem_code code = ok ? IDEM_OK
                     : s == PGRES_COMMAND_OK
                         ? idem_call_fail(call, IDEM_FAILED_PRECONDITION, "order not in CREATED")
                         : idem_call_fail(call, IDEM_INTERNAL, "%s", PQresultErrorMessage(r));
    PQclear(r);
    return code;
}

/* Payload "ORDER MODE": records the callback, moves the order to PAID and keeps a
 * counter with idem_txn_*, all in the call's transaction; MODE "fail" then answers a
 * final error, "transient" answers UNAVAILABLE while tx_transient_left lasts. */
static idem_code h_pay_callback(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const char *p = idem_call_payload(call, &n);
    char order[16] = "", mode[16] = "";
    sscanf(p, "%15s %15s", order, mode);
    atomic_fetch_add(&tx_runs, 1);
    idem_txn *t = idem_call_txn(call);
    PGconn *c = idem_txn_pg_conn(t);
    if (c == NULL) {
        return idem_call_fail(call, IDEM_INTERNAL, "no PostgreSQL connection in the txn");
    }
    const char *const insert[] = {order, "wx", "100"};
    const char *const paid[] = {order};
    idem_code code;
    if ((code = sql(call, c, "INSERT INTO pay_callback VALUES ($1, $2, $3)", 3, insert, NULL)) !=
            IDEM_OK ||
        (code =
             sql(call, c, "UPDATE orders SET status = 'PAID' WHERE id = $1 AND status = 'CREATED'",
                 1, paid, "1")) != IDEM_OK ||
        (code = idem_txn_put(t, "paid", order, strlen(order), "100", 3)) != IDEM_OK) {
        return code != IDEM_OK ? code : idem_call_fail(call, code, "%s", idem_errmsg());
    }
    if (strcmp(mode, "fail") == 0) {
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "refused after writing");
    }
    if (strcmp(mode, "transient") == 0 && atomic_fetch_sub(&tx_transient_left, 1) > 0) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "try again");
    }
    return idem_call_reply(call, IDEM_OK, order, strlen(order));
}

static bool tx_no_notify; /* the stores tx_server opens re-read instead of listening */

static void tx_server(tu_server *ts, idem_store **store, size_t pool, idem_handler_fn fn)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.contexts = 8;
    idem_pg_opts po = {.pool_size = pool, .no_notify = tx_no_notify, .pooler = tu_pg_pooler()};
    cr_assert_eq(idem_store_open_postgres_ex(store, tx_conninfo, &po), IDEM_OK, "%s",
                 idem_errmsg());
    o.store = *store;
    tu_server_create(ts, &o);
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(ts->srv, "pg.Pay/Callback", fn, NULL, &tx), IDEM_OK, "%s",
                 idem_errmsg());
    tu_server_listen(ts);
}

static idem_code pay(const char *url, const char *key, const char *payload, uint32_t attempts,
                     idem_result *r)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 5000;
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 10;
    cr_assert_eq(idem_client_open(&c, (const char *[]){url}, 1, &o), IDEM_OK);
    idem_request q = {.method = "pg.Pay/Callback",
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = strlen(payload)};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

Test(pg, transactional_handler_commits_its_sql_its_kv_and_the_record_together)
{
    tu_server a;
    idem_store *sa;
    idem_result r;
    tx_schema_create();
    tx_server(&a, &sa, 4, h_pay_callback);
    atomic_store(&tx_runs, 0);
    for (int i = 0; i < 10; i++) { /* a payment callback delivered ten times */
        cr_assert_eq(pay(a.url, "cb-o1", "o1 ok", 1, &r), IDEM_OK, "%s", r.message);
        cr_expect_str_eq(r.payload, "o1");
        cr_expect_eq(r.replayed, i > 0);
        idem_result_clear(&r);
    }
    cr_expect_eq(atomic_load(&tx_runs), 1, "the handler ran once");
    cr_expect_str_eq(tx_query("SELECT count(*) FROM pay_callback WHERE out_trade_no = 'o1'"), "1");
    cr_expect_str_eq(tx_query("SELECT status FROM orders WHERE id = 'o1'"), "PAID");
    void *v;
    size_t n;
    cr_assert_eq(idem_store_app_get(sa, "paid", "o1", 2, &v, &n), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(n, 3);
    free(v);

    /* A final error: its writes are rolled back, the error is recorded and replayed. */
    atomic_store(&tx_runs, 0);
    for (int i = 0; i < 3; i++) {
        cr_expect_eq(pay(a.url, "cb-o2", "o2 fail", 1, &r), IDEM_FAILED_PRECONDITION);
        cr_expect_eq(r.replayed, i > 0);
        idem_result_clear(&r);
    }
    cr_expect_eq(atomic_load(&tx_runs), 1, "a recorded final error does not run again");
    cr_expect_str_eq(tx_query("SELECT count(*) FROM pay_callback WHERE out_trade_no = 'o2'"), "0");
    cr_expect_str_eq(tx_query("SELECT status FROM orders WHERE id = 'o2'"), "CREATED");
    cr_expect_eq(idem_store_app_get(sa, "paid", "o2", 2, &v, &n), IDEM_NOT_FOUND);

    /* Transient answers roll everything back, claim included: the retries run again,
     * and only the OK one leaves its rows. */
    atomic_store(&tx_runs, 0);
    atomic_store(&tx_transient_left, 2);
    cr_assert_eq(pay(a.url, "cb-o3", "o3 transient", 3, &r), IDEM_OK, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&tx_runs), 3);
    cr_expect_str_eq(tx_query("SELECT count(*) FROM pay_callback WHERE out_trade_no = 'o3'"), "1");
    cr_expect_str_eq(tx_query("SELECT status FROM orders WHERE id = 'o3'"), "PAID");

    tu_server_destroy(&a, false);
    idem_store_close(sa);
    tx_schema_drop();
}

/* The handler of the first call holds its transaction open until the gate opens. */
static struct {
    atomic_int entered;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool open;
} TG = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void open_tx_gate(void)
{
    pthread_mutex_lock(&TG.mu);
    TG.open = true;
    pthread_cond_broadcast(&TG.cv);
    pthread_mutex_unlock(&TG.mu);
}

static idem_code h_gated_callback(idem_call *call, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    if (strncmp(p, "o1", 2) == 0) {
        atomic_fetch_add(&TG.entered, 1);
        pthread_mutex_lock(&TG.mu);
        while (!TG.open) {
            pthread_cond_wait(&TG.cv, &TG.mu);
        }
        pthread_mutex_unlock(&TG.mu);
    }
    return h_pay_callback(call, arg);
}

struct pay_arg {
    const char *url, *key, *payload;
    idem_result r;
    idem_code code;
};

static void *pay_thread(void *p)
{
    struct pay_arg *a = p;
    a->code = pay(a->url, a->key, a->payload, 1, &a->r);
    return NULL;
}

/* A value of a server's /metrics, e.g. "idem_waiting_duplicates"; -1 when absent. */
static long metric(int http_port, const char *name)
{
    char needle[96];
    tu_http h;
    snprintf(needle, sizeof(needle), "\n%s ", name);
    tu_http_get(&h, http_port, "/metrics");
    const char *w = h.body != NULL ? strstr(h.body, needle) : NULL;
    long v = w != NULL ? atol(w + strlen(needle)) : -1;
    tu_http_free(&h);
    return v;
}

/* Waits, bounded at 5 s, until the counter name of the server at http_port is above 0. */
static bool await_metric(int http_port, const char *name)
{
    for (int i = 0; i < 500; i++) {
        if (metric(http_port, name) > 0) {
            return true;
        }
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL); /* polling a counter, bounded at 5 s */
    }
    return false;
}

static long waiting_on(int http_port)
{
    return metric(http_port, "idem_waiting_duplicates");
}

static bool await_waiting(int http_port)
{
    for (int i = 0; i < 500; i++) {
        if (waiting_on(http_port) >= 1) {
            return true;
        }
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL); /* polling a gauge, bounded at 5 s */
    }
    return false;
}

static void duplicate_on_another_instance(void)
{
    tu_server a, b;
    idem_store *sa, *sb;
    idem_result r;
    tx_schema_create();
    tx_server(&a, &sa, 4, h_gated_callback);
    tx_server(&b, &sb, 1, h_gated_callback); /* one connection: a waiter must not hold it */
    cr_assert_eq(idem_server_listen_http(b.srv, "http://127.0.0.1:0"), IDEM_OK);
    atomic_store(&tx_runs, 0);
    struct pay_arg first = {.url = a.url, .key = "cb-o1", .payload = "o1 ok"};
    struct pay_arg dup = {.url = b.url, .key = "cb-o1", .payload = "o1 ok"};
    pthread_t t1, t2;
    pthread_create(&t1, NULL, pay_thread, &first);
    cr_assert(await_int(&TG.entered, 0), "the handler on A never started");
    cr_assert_eq(atomic_load(&TG.entered), 1);
    pthread_create(&t2, NULL, pay_thread, &dup);
    cr_expect(await_waiting(idem_server_http_port(b.srv)), "B's duplicate is not waiting");

    /* While B's duplicate waits, B's only connection serves another call. */
    cr_expect_eq(pay(b.url, "cb-o2", "o2 ok", 1, &r), IDEM_OK, "%s", r.message);
    idem_result_clear(&r);

    open_tx_gate();
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    cr_expect_eq(first.code, IDEM_OK, "%s", first.r.message);
    cr_expect_eq(dup.code, IDEM_OK, "%s", dup.r.message);
    cr_expect(dup.r.replayed, "B replays A's result");
    cr_expect_str_eq(dup.r.payload, "o1");
    if (tx_no_notify || tu_pg_pooler()) { /* a pooler implies no_notify */
        cr_expect_eq(metric(idem_server_http_port(b.srv), "idem_store_announcements_total"), 0,
                     "no announcements without NOTIFY");
    } else { /* B may have replayed on a re-read before the NOTIFY arrived: await it */
        cr_expect(await_metric(idem_server_http_port(b.srv), "idem_store_announcements_total"),
                  "B heard A's commit announced");
    }
    idem_result_clear(&first.r);
    idem_result_clear(&dup.r);
    cr_expect_eq(atomic_load(&tx_runs), 2, "o1 once on A, o2 once on B");
    cr_expect_str_eq(tx_query("SELECT count(*) FROM pay_callback WHERE out_trade_no = 'o1'"), "1");

    tu_server_destroy(&a, false);
    tu_server_destroy(&b, false);
    idem_store_close(sa);
    idem_store_close(sb);
    tx_schema_drop();
}

Test(pg, a_duplicate_on_another_instance_waits_for_the_handler_txn_and_replays_it)
{
    duplicate_on_another_instance(); /* woken by the commit's NOTIFY */
}

/* idem_pg_opts.no_notify, for engines without LISTEN/NOTIFY: the same outcome, found by
 * the duplicate's re-reads. */
Test(pg, without_notifications_the_duplicate_still_replays_by_re_reading)
{
    tx_no_notify = true;
    duplicate_on_another_instance();
}

static idem_code read_absent_keys(idem_txn *t, void *arg)
{
    (void)arg;
    const void *v;
    size_t n;
    for (int i = 0; i < 5; i++) {
        char k[8];
        snprintf(k, sizeof(k), "k%d", i);
        cr_expect_eq(idem_txn_get(t, "sweep", k, strlen(k), &v, &n), IDEM_NOT_FOUND);
    }
    return idem_txn_put(t, "sweep", "kept", 4, "v", 1);
}

/* A locking read of an absent key leaves an empty row (the lock's anchor): the sweep
 * removes those, never a written one. */
Test(pg, the_sweep_removes_the_empty_rows_reads_leave_and_keeps_values)
{
    idem_store *s2;
    size_t deleted;
    tx_schema_create();
    cr_assert_eq(tu_pg_open(&s2, tx_conninfo, 2), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_run_txn(s2, read_absent_keys, NULL), IDEM_OK, "%s", idem_errmsg());
    cr_expect_str_eq(tx_query("SELECT count(*) FROM idem_kv WHERE v IS NULL"), "5");
    cr_assert_eq(idem_store_sweep(s2, idem__now_ms(), 100, &deleted), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(deleted, 0, "empty rows are neither records nor tokens");
    cr_expect_str_eq(tx_query("SELECT count(*) FROM idem_kv"), "1");
    void *v;
    size_t n;
    cr_assert_eq(idem_store_app_get(s2, "sweep", "kept", 4, &v, &n), IDEM_OK);
    free(v);
    idem_store_close(s2);
    tx_schema_drop();
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
        cr_assert_eq(tu_pg_open(&stores[i], getenv("IDEMRPC_TEST_PG"), 4), IDEM_OK,
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

Test(pg, instance_with_a_clock_an_hour_ahead_does_not_take_over_a_live_claim)
{
    char key[96];
    snprintf(key, sizeof(key), "%s-skew", prefix);
    start_skewed_pair();
    pthread_t t;
    struct charge_arg a = {.url = srv[0].url, .key = key};
    pthread_create(&t, NULL, charge_on_a, &a);
    cr_assert(await_int(&G.entered, 0), "the handler on A never started");
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

/* ---- found in review: waits that a handler transaction must not cause ---- */

static idem_store *rv_store;
static atomic_int rv_verdict = -1;

static idem_code rv_credit(idem_txn *t, void *arg)
{
    (void)arg;
    return idem_txn_put(t, "x", "k", 1, "v", 1);
}

static idem_code h_consume_inside(idem_call *call, void *arg)
{
    (void)arg;
    idem_consume_info info;
    atomic_store(&rv_verdict, idem_consume_ex(rv_store, "g", "m1", rv_credit, NULL, &info));
    return idem_call_reply(call, IDEM_OK, "ok", 2);
}

/* A pool slot connecting for the first time inside a handler used to run the schema's
 * ALTER TABLE, which waited for the handler's own transaction: a hang PostgreSQL cannot
 * see. idem_consume from a handler must answer REJECT at once. */
Test(pg, idem_consume_inside_a_transactional_handler_is_rejected_not_hung)
{
    tu_server a;
    tx_schema_create();
    tx_server(&a, &rv_store, 2, h_consume_inside); /* its second slot is not connected yet */
    struct pay_arg p = {.url = a.url, .key = "rv-1", .payload = "x"};
    pthread_t t;
    pthread_create(&t, NULL, pay_thread, &p);
    cr_expect(await_int(&rv_verdict, -1), "idem_consume inside the handler hung");
    cr_expect_eq(atomic_load(&rv_verdict), IDEM_CONSUME_REJECT);
    pthread_join(t, NULL);
    idem_result_clear(&p.r);
    tu_server_destroy(&a, false);
    idem_store_close(rv_store);
    tx_schema_drop();
}

static atomic_int rv_opened = -1;

static void *open_late(void *p)
{
    idem_store **out = p;
    atomic_store(&rv_opened, tu_pg_open(out, tx_conninfo, 1));
    return NULL;
}

/* An instance that starts (or reconnects) while another instance's handler transaction
 * is open must not wait for it: it only checks that the schema exists. */
Test(pg, an_instance_starting_during_a_handler_transaction_does_not_wait_for_it)
{
    tu_server a;
    idem_store *sa, *late = NULL;
    tx_schema_create();
    tx_server(&a, &sa, 4, h_gated_callback);
    struct pay_arg first = {.url = a.url, .key = "cb-o1", .payload = "o1 ok"};
    pthread_t t1, t2;
    pthread_create(&t1, NULL, pay_thread, &first);
    cr_assert(await_int(&TG.entered, 0), "the handler never started");
    pthread_create(&t2, NULL, open_late, &late);
    cr_expect(await_int(&rv_opened, -1), "the second store's open waited for the handler");
    cr_expect_eq(atomic_load(&rv_opened), IDEM_OK);
    open_tx_gate();
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    cr_expect_eq(first.code, IDEM_OK, "%s", first.r.message);
    idem_result_clear(&first.r);
    tu_server_destroy(&a, false);
    idem_store_close(sa);
    idem_store_close(late);
    tx_schema_drop();
}

/* Consumers of different messages: the first one's fn waits until the second one's fn
 * has run, which it can only do if the consume log's shared row is not held across fn. */
static atomic_int second_ran, first_in_fn;

static idem_code first_fn(idem_txn *t, void *arg)
{
    (void)t, (void)arg;
    atomic_store(&first_in_fn, 1);
    return await_int(&second_ran, 0) ? IDEM_OK : IDEM_DEADLINE_EXCEEDED;
}

static idem_code second_fn(idem_txn *t, void *arg)
{
    (void)t, (void)arg;
    atomic_store(&second_ran, 1);
    return IDEM_OK;
}

static atomic_int first_verdict = -1;

static void *first_consumer(void *arg)
{
    (void)arg;
    atomic_store(&first_verdict, idem_consume(rv_store, "billing", "msg-1", first_fn, NULL));
    return NULL;
}

Test(pg, consumers_of_different_messages_do_not_wait_for_each_others_fn)
{
    tx_schema_create();
    cr_assert_eq(tu_pg_open(&rv_store, tx_conninfo, 4), IDEM_OK);
    pthread_t a;
    pthread_create(&a, NULL, first_consumer, NULL);
    cr_assert(await_int(&first_in_fn, 0), "the first consumer's fn never ran");
    for (int i = 0; i < 500 && atomic_load(&first_verdict) < 0; i++) {
        /* the second consumer, until its fn has run (it may have to wait out the
         * first's commit, never its fn) */
        if (idem_consume(rv_store, "shipping", "msg-2", second_fn, NULL) == IDEM_CONSUME_ACK) {
            break;
        }
    }
    pthread_join(a, NULL);
    cr_expect_eq(atomic_load(&second_ran), 1);
    cr_expect_eq(atomic_load(&first_verdict), IDEM_CONSUME_ACK,
                 "the first consumer's fn waited for the second in vain");
    idem_store_close(rv_store);
    tx_schema_drop();
}

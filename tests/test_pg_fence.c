/* A fence that left the process is never handed out again, even when PostgreSQL crashes
 * before anything else flushed its draw. Through a real server and client on a schema of
 * the test's own in $IDEMRPC_TEST_PG, with the instance of $IDEMRPC_SERVICES: its WAL
 * writer, background writer and checkpointer are paused (so only a commit flushes WAL),
 * the handler takes its fence and waits, PostgreSQL is crashed (every process killed)
 * and started again, and the same key is called again: its new claim's fence must be
 * greater than the one the first run handed out. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

static char schema[32];
static char *conninfo;
static bool paused; /* the instance's writers are paused and it did not crash yet */

/* The first run waits at the gate the test opens; every run takes its fence. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int runs;
    bool open;
    uint64_t fence[2];
} G;

static void services(const char *verb)
{
    const char *svc = getenv("IDEMRPC_SERVICES");
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s %s", svc, verb);
    cr_assert_eq(system(cmd), 0, "%s failed", cmd);
}

static void setup(void)
{
    if (getenv("IDEMRPC_SERVICES") == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set: cannot crash PostgreSQL");
    }
    conninfo = tu_pg_schema_create(schema);
    memset(&G, 0, sizeof(G));
    pthread_mutex_init(&G.mu, NULL);
    pthread_cond_init(&G.cv, NULL);
}

static void teardown(void)
{
    if (paused) { /* a failure before the crash: the instance must not stay paused */
        services("crash-pg");
        paused = false;
    }
    if (conninfo != NULL) {
        tu_pg_schema_drop(schema);
        free(conninfo);
        conninfo = NULL;
    }
}

TestSuite(pg_fence, .init = setup, .fini = teardown, .timeout = 120);

/* Takes its fence before the gate, or after it when arg is not NULL ("late": the crash
 * then comes between the claim's draw and the fence's flush). */
static idem_code h_fenced(idem_call *call, void *arg)
{
    bool late = arg != NULL;
    uint64_t fence = late ? 0 : idem_call_fence(call);
    pthread_mutex_lock(&G.mu);
    int run = G.runs++;
    pthread_cond_broadcast(&G.cv);
    while (run == 0 && !G.open) {
        pthread_cond_wait(&G.cv, &G.mu);
    }
    pthread_mutex_unlock(&G.mu);
    fence = late ? idem_call_fence(call) : fence;
    pthread_mutex_lock(&G.mu);
    if (run < 2) {
        G.fence[run] = fence;
    }
    pthread_mutex_unlock(&G.mu);
    return idem_call_reply(call, IDEM_OK, "fenced", 6);
}

/* Waits, bounded at 20 s, until the handler ran n times. */
static bool await_runs(int n)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 20;
    pthread_mutex_lock(&G.mu);
    int rc = 0;
    while (G.runs < n && rc == 0) {
        rc = pthread_cond_timedwait(&G.cv, &G.mu, &until);
    }
    bool ok = G.runs >= n;
    pthread_mutex_unlock(&G.mu);
    return ok;
}

typedef struct bg_call {
    const char *url, *method, *key;
    idem_code code;
    pthread_t t;
} bg_call;

static idem_code call_once(const char *url, const char *method, const char *key, uint32_t attempts)
{
    idem_client *c = tu_client_attempts(url, 5000, attempts);
    idem_request q = {.method = method, .idempotency_key = key};
    idem_result r;
    idem_code code = idem_client_call(c, &q, &r);
    idem_result_clear(&r);
    idem_client_close(c);
    return code;
}

static void *bg_main(void *p)
{
    bg_call *a = p;
    a->code = call_once(a->url, a->method, a->key, 1);
    return NULL;
}

/* The first run of method (key "k-fence") takes its fence (late: after the crash),
 * PostgreSQL crashes before that run ends (nothing but a commit flushed WAL since the
 * pause), and a second run, of key, takes its own. */
static void fence_across_a_crash(unsigned flags, const char *key, bool late)
{
    idem_store *st;
    cr_assert_eq(tu_pg_open(&st, conninfo, 4), IDEM_OK, "%s", idem_errmsg());
    idem_server_opts so;
    idem_server_opts_init(&so);
    so.store = st;
    so.log_level = IDEM_LOG_OFF;
    tu_server ts;
    tu_server_create(&ts, &so);
    idem_method_opts m = {.flags = flags | IDEM_METHOD_KEY_REQUIRED, .lease_ms = 2000};
    cr_assert_eq(idem_server_register(ts.srv, "fence.T/Run", h_fenced, late ? &G : NULL, &m),
                 IDEM_OK);
    tu_server_listen(&ts);

    services("pause-pg-writers");
    paused = true;
    bg_call first = {.url = ts.url, .method = "fence.T/Run", .key = "k-fence"};
    cr_assert_eq(pthread_create(&first.t, NULL, bg_main, &first), 0);
    cr_assert(await_runs(1), "the first run did not start");
    services("crash-pg");
    paused = false;
    pthread_mutex_lock(&G.mu);
    G.open = true;
    pthread_cond_broadcast(&G.cv);
    pthread_mutex_unlock(&G.mu);
    pthread_join(first.t, NULL);

    idem_code code = call_once(ts.url, "fence.T/Run", key, 10); /* retried while it reconnects */
    cr_assert_eq(code, IDEM_OK, "%s", idem_code_name(code));
    cr_assert(await_runs(2), "the second run did not happen");
    cr_assert_neq(G.fence[1], 0, "the second run got no fence");
    if (late) { /* its draw may be lost: refused, and the call not answered OK */
        cr_expect_eq(G.fence[0], 0, "fence %llu drawn before the crash was handed out after it",
                     (unsigned long long)G.fence[0]);
        cr_expect_neq(first.code, IDEM_OK);
    } else {
        cr_assert_neq(G.fence[0], 0, "the first run got no fence");
    }
    cr_expect_gt(G.fence[1], G.fence[0],
                 "fence %llu handed out again after the crash (the first run's was %llu)",
                 (unsigned long long)G.fence[1], (unsigned long long)G.fence[0]);
    tu_server_destroy(&ts, false);
    idem_store_close(st);
}

/* The claim and its fence are made in the handler's open transaction, which the crash
 * ends: the key's next holder must not get the same fence. */
Test(pg_fence, a_handler_txn_fence_is_never_handed_out_again_after_a_database_crash)
{
    fence_across_a_crash(IDEM_METHOD_TRANSACTIONAL, "k-fence", false);
}

/* The crash comes between the claim's draw in the handler's txn and the handler's
 * request for its fence: the draw may be lost, so the fence is refused. */
Test(pg_fence, a_handler_txn_fence_drawn_before_a_database_crash_is_refused_after_it)
{
    fence_across_a_crash(IDEM_METHOD_TRANSACTIONAL, "k-fence", true);
}

/* The claim committed on its own before the handler ran (its completion is recorded
 * once the database is back): the next claim, of another key, gets a greater fence. */
Test(pg_fence, a_committed_claim_fence_is_never_handed_out_again_after_a_database_crash)
{
    fence_across_a_crash(IDEM_METHOD_CACHED, "k-fence-next", false);
}

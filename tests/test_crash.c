/* Crash tests with real processes: the server SIGKILLs itself at a chosen point of a
 * call (tests/crash_server.c) and the same call is retried with the same key.
 *
 * One suite, both stores: as `crash` (LMDB) the server is restarted on the same
 * directory; as `crash_pg` (IDEMRPC_TEST_BACKEND=postgres, a schema per test) the retry
 * fails over to a second instance on the same database, and the transactional methods
 * run with a 60 s lease: the retry (8 s deadline) only succeeds because PostgreSQL
 * rolled the dead session's transaction back, claim included, without a lease. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

static char *dir;
static char url[256], url2[256];
static char *pg; /* conninfo of this test's schema; NULL on LMDB */
static char schema[32];

static void setup(void)
{
    dir = tu_tempdir("crash");
    snprintf(url, sizeof(url), "ipc://%s/server.sock", dir);
    snprintf(url2, sizeof(url2), "ipc://%s/second.sock", dir);
    pg = tu_backend_is_pg() ? tu_pg_schema_create(schema) : NULL;
}

static void teardown(void)
{
    tu_rmtree(dir);
    if (pg != NULL) {
        tu_pg_schema_drop(schema);
        free(pg);
        pg = NULL;
    }
}

TestSuite(crash, .init = setup, .fini = teardown, .timeout = 60);

/* Starts crash_server on u and waits for its "ready" line. */
static tu_child spawn_on(const char *u, const char *crash_at, const char *lease_ms)
{
    tu_child c;
    const char *argv[] = {getenv("CRASH_SERVER"),
                          "--listen",
                          u,
                          "--db",
                          dir,
                          "--lease-ms",
                          lease_ms,
                          "--crash-at",
                          crash_at,
                          pg != NULL ? "--pg" : NULL,
                          pg,
                          NULL};
    tu_spawn(&c, argv);
    return c;
}

static void stop(tu_child *c)
{
    kill(c->pid, SIGTERM);
    int sig = tu_reap(c);
    cr_expect_eq(sig, 0, "clean shutdown on SIGTERM, not signal %d", sig);
}

/* Sends q to `to` with up to attempts attempts. */
static idem_code call_to(const char *to, const idem_request *q, uint32_t attempts, idem_result *r)
{
    idem_client_opts o;
    idem_client *cl;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 1000;
    o.deadline_ms = 8000;
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 50;
    o.retry.max_period_ms = 200;
    cr_assert_eq(idem_client_open(&cl, (const char *[]){to}, 1, &o), IDEM_OK);
    idem_code code = idem_client_call(cl, q, r);
    idem_client_close(cl);
    return code;
}

static idem_code send_to(const char *to, const char *method, const char *key, const char *payload,
                         uint32_t attempts, idem_result *r)
{
    idem_request q = {.method = method,
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = payload ? strlen(payload) : 0};
    return call_to(to, &q, attempts, r);
}

static long long read_count(const char *to, const char *method)
{
    idem_result r;
    cr_assert_eq(send_to(to, method, NULL, "", 3, &r), IDEM_OK, "%s", r.message);
    long long v = atoll(r.payload);
    idem_result_clear(&r);
    return v;
}

/* Crash at `point` during `method`, restart (LMDB) or fail over (PostgreSQL), retry with
 * the same key until it answers (a claim's lease may have to run out first). Then check
 * the number of effects and whether the answer was a replay of the first result. */
static void crash_and_retry(const char *method, const char *count_method, const char *point,
                            long long effects, bool replayed, const char *payload)
{
    idem_result r;
    bool transactional = strstr(method, "Ledger") != NULL;
    const char *lease = pg != NULL && transactional ? "60000" : "300";
    const char *retry_url = pg != NULL ? url2 : url;
    tu_child c = spawn_on(url, point, lease), other = {0};
    if (pg != NULL) {
        other = spawn_on(url2, "", lease);
    }
    cr_expect_neq(send_to(url, method, "op-1", "10", 1, &r), IDEM_OK, "the server died mid-call");
    idem_result_clear(&r);
    cr_assert_eq(tu_reap(&c), SIGKILL, "crash_server was killed at %s", point);

    if (pg != NULL) {
        c = other;
    } else {
        c = spawn_on(url, "", lease);
    }
    cr_assert_eq(send_to(retry_url, method, "op-1", "10", 30, &r), IDEM_OK, "%s", r.message);
    cr_expect_eq(r.replayed, replayed, "replayed after a crash at %s", point);
    cr_expect_str_eq(r.payload, payload);
    idem_result_clear(&r);
    cr_expect_eq(read_count(retry_url, count_method), effects, "effects after a crash at %s",
                 point);

    cr_assert_eq(send_to(retry_url, method, "op-1", "10", 3, &r), IDEM_OK);
    cr_expect(r.replayed, "a later duplicate replays");
    idem_result_clear(&r);
    cr_expect_eq(read_count(retry_url, count_method), effects, "and changes nothing");
    stop(&c);
}

#define LEDGER "crash.Ledger/Credit", "crash.Ledger/Balance"
#define FILE_ "crash.File/Append", "crash.File/Count"

/* Transactional: the effect and the record commit together, so every kill point ends
 * with exactly one credit. */
Test(crash, transactional_kill_before_claim_runs_once)
{
    crash_and_retry(LEDGER, "before_claim", 1 * 10, false, "10");
}

Test(crash, transactional_kill_after_claim_runs_once_after_lease)
{
    crash_and_retry(LEDGER, "after_claim", 1 * 10, false, "10");
}

Test(crash, transactional_kill_after_effect_leaves_no_effect_and_runs_once)
{
    crash_and_retry(LEDGER, "after_effect", 1 * 10, false, "10");
}

Test(crash, transactional_kill_after_commit_replays_first_result)
{
    crash_and_retry(LEDGER, "after_commit", 1 * 10, true, "10");
}

/* Claim mode: the effect lives outside the store. */
Test(crash, claim_kill_before_claim_runs_once)
{
    crash_and_retry(FILE_, "before_claim", 1, false, "appended");
}

Test(crash, claim_kill_after_claim_runs_once_after_lease)
{
    crash_and_retry(FILE_, "after_claim", 1, false, "appended");
}

Test(crash, claim_kill_after_effect_is_at_least_once_after_lease)
{
    /* The documented edge: the effect happened, the record did not; after the lease the
     * retry runs it again. Use IDEM_METHOD_TRANSACTIONAL to close it. */
    crash_and_retry(FILE_, "after_effect", 2, false, "appended");
}

Test(crash, claim_kill_after_commit_replays_first_result)
{
    crash_and_retry(FILE_, "after_commit", 1, true, "appended");
}

/* ---- a takeover keeps the first token ---- */

static void issue_token(const char *to, char *tok, size_t cap)
{
    idem_client *cl = tu_client(to, 1000);
    cr_assert_eq(idem_client_issue_token(cl, NULL, tok, cap, NULL), IDEM_OK, "%s", idem_errmsg());
    idem_client_close(cl);
}

static idem_code submit(const char *to, const char *key, const char *token, idem_result *r)
{
    idem_request q = {.method = "crash.Order/Submit", .idempotency_key = key, .token = token};
    idem_code code = call_to(to, &q, 30, r);
    if (code != IDEM_OK) {
        cr_log_info("%s with %s: %s", key, token, r->message ? r->message : "");
    }
    return code;
}

/* Order 1 is claimed with token t1 and its owner dies; the same order comes back with
 * t2 and takes over, and that run fails transiently (released: the client retries).
 * The record kept t1, the token its first claim consumed: the takeover checks t2 and
 * consumes nothing, so the release gives t1 back. It used to consume t2 and write it
 * over t1 in the record; the release restored t2 and t1 was gone for good. */
Test(crash, a_takeover_with_another_token_keeps_the_first_and_its_release_restores_it)
{
    tu_child c = spawn_on(url, "after_claim", "300"), other = {0};
    if (pg != NULL) {
        other = spawn_on(url2, "", "300");
    }
    char t1[64], t2[64];
    issue_token(url, t1, sizeof(t1));
    issue_token(url, t2, sizeof(t2));
    idem_result r;
    cr_expect_neq(submit(url, "order-1", t1, &r), IDEM_OK, "the server died mid-call");
    idem_result_clear(&r);
    cr_assert_eq(tu_reap(&c), SIGKILL, "crash_server was killed after the claim");
    c = pg != NULL ? other : spawn_on(url, "", "300");
    const char *to = pg != NULL ? url2 : url;

    cr_expect_eq(submit(to, "order-1", t2, &r), IDEM_OK, "taken over, released, run again");
    cr_expect_geq(r.attempts, 2, "the takeover's run answered UNAVAILABLE first");
    idem_result_clear(&r);
    cr_expect_eq(submit(to, "order-2", t1, &r), IDEM_OK,
                 "the first token came back with the takeover's release");
    cr_expect_not(r.replayed);
    idem_result_clear(&r);
    cr_expect_eq(submit(to, "order-1", t1, &r), IDEM_OK);
    cr_expect(r.replayed, "order 1 is done");
    idem_result_clear(&r);
    stop(&c);
}

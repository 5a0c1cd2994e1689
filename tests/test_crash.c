/* Crash tests with real processes: the server SIGKILLs itself at a chosen point of a
 * call (tests/crash_server.c), is restarted on the same LMDB directory, and the same
 * call is retried with the same key. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

static char *dir;
static char url[256];

static void setup(void)
{
    dir = tu_tempdir("crash");
    snprintf(url, sizeof(url), "ipc://%s/server.sock", dir);
}

static void teardown(void)
{
    tu_rmtree(dir);
}

TestSuite(crash, .init = setup, .fini = teardown, .timeout = 60);

/* Starts crash_server and waits for its "ready" line. */
static tu_child spawn(const char *crash_at)
{
    tu_child c;
    const char *argv[] = {getenv("CRASH_SERVER"), "--listen", url,          "--db",   dir,
                          "--lease-ms",           "300",      "--crash-at", crash_at, NULL};
    tu_spawn(&c, argv);
    return c;
}

static void stop(tu_child *c)
{
    kill(c->pid, SIGTERM);
    int sig = tu_reap(c);
    cr_expect_eq(sig, 0, "clean shutdown on SIGTERM, not signal %d", sig);
}

static idem_code send_once(const char *method, const char *key, const char *payload,
                           uint32_t attempts, idem_result *r)
{
    idem_client_opts o;
    idem_client *cl;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 1000;
    o.deadline_ms = 8000;
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 50;
    o.retry.max_period_ms = 200;
    cr_assert_eq(idem_client_open(&cl, (const char *[]){url}, 1, &o), IDEM_OK);
    idem_request q = {.method = method,
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = payload ? strlen(payload) : 0};
    idem_code code = idem_client_call(cl, &q, r);
    idem_client_close(cl);
    return code;
}

static long long read_count(const char *method)
{
    idem_result r;
    cr_assert_eq(send_once(method, NULL, "", 3, &r), IDEM_OK, "%s", r.message);
    long long v = atoll(r.payload);
    idem_result_clear(&r);
    return v;
}

/* Crash at `point` during `method`, restart, retry with the same key until it answers
 * (the lease may have to run out first). Then check the number of effects and whether
 * the answer was a replay of the first result. */
static void crash_and_retry(const char *method, const char *count_method, const char *point,
                            long long effects, bool replayed, const char *payload)
{
    idem_result r;
    tu_child c = spawn(point);
    cr_expect_neq(send_once(method, "op-1", "10", 1, &r), IDEM_OK, "the server died mid-call");
    idem_result_clear(&r);
    cr_assert_eq(tu_reap(&c), SIGKILL, "crash_server was killed at %s", point);

    c = spawn("");
    cr_assert_eq(send_once(method, "op-1", "10", 30, &r), IDEM_OK, "%s", r.message);
    cr_expect_eq(r.replayed, replayed, "replayed after a crash at %s", point);
    cr_expect_str_eq(r.payload, payload);
    idem_result_clear(&r);
    cr_expect_eq(read_count(count_method), effects, "effects after a crash at %s", point);

    cr_assert_eq(send_once(method, "op-1", "10", 3, &r), IDEM_OK);
    cr_expect(r.replayed, "a later duplicate replays");
    idem_result_clear(&r);
    cr_expect_eq(read_count(count_method), effects, "and changes nothing");
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

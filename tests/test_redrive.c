/* The re-driver's count of re-runs (redrive_max_runs) when two instances share one
 * store, on LMDB and on PostgreSQL: each re-driver reads the abandoned call, counts a
 * re-run in its own txn, then runs it, and the run's claim takes the record over. Two
 * re-drivers that both count before either one's run claims must count the one death
 * once, or the call gives up (and compensates) after fewer deaths than it may have. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../src/toolkit/steps_internal.h"
#include "testutil.h"
#if TU_HAVE_PG
#include "pgproxy.h"
#endif

#define CALLER "shop"
#define METHOD "redrive.Test/Order"
#define KEY "order-1"
#define MAX_RUNS 3u

static const uint8_t fp[IDEM_FINGERPRINT_LEN] = {7, 7, 7, 7};
static idem_store *stores[2];
static char *dir, *conninfo, schema[32];

static void teardown(void)
{
    for (int i = 0; i < 2; i++) {
        idem_store_close(stores[i]);
        stores[i] = NULL;
    }
    if (dir != NULL) {
        tu_rmtree(dir);
        dir = NULL;
    }
    if (conninfo != NULL) {
        tu_pg_schema_drop(schema);
        free(conninfo);
        conninfo = NULL;
    }
}

TestSuite(redrive, .fini = teardown, .timeout = 60);

typedef struct listing {
    uint8_t base[32];
    uint8_t runs;
} listing;

static size_t put_lp16(uint8_t *p, const char *s)
{
    size_t n = strlen(s);
    p[0] = (uint8_t)(n >> 8);
    p[1] = (uint8_t)n;
    memcpy(p + 2, s, n);
    return 2 + n;
}

/* The journal of a call that recorded a step and is listed with l->runs re-runs. */
static idem_code put_journal(idem_txn *t, void *arg)
{
    const listing *l = arg;
    idem__journal j;
    uint8_t v[256], head[16] = {0};
    size_t n = 0;
    idem__journal_of_base(l->base, &j);
    v[n++] = CALL_MAGIC;
    v[n++] = CALL_VERSION;
    v[n++] = 0;
    v[n++] = l->runs;
    memcpy(v + n, fp, sizeof(fp));
    n += sizeof(fp);
    n += put_lp16(v + n, CALLER);
    n += put_lp16(v + n, METHOD);
    n += put_lp16(v + n, KEY);
    v[n++] = 0; /* the request: not run here */
    idem_code code = idem_txn_put(t, IDEM__STEPS_DB, j.call_key, IDEM__JKEY, v, n);
    return code != IDEM_OK ? code
                           : idem_txn_put(t, IDEM__STEPS_DB, j.head_key, IDEM__JKEY, head,
                                          sizeof(head)); /* more than 8 bytes: a step */
}

/* A record of the call whose owner died: IN_PROGRESS, its lease run out. */
static void abandon_call(idem_store *st)
{
    idem_claim_req req = {.key = {CALLER, METHOD, KEY}, .owner = 41};
    idem_claim_outcome outcome;
    idem_record rec;
    memcpy(req.fingerprint, fp, sizeof(fp));
    req.now_ms = idem__now_ms();
    req.lease_until_ms = req.now_ms + 1;
    req.expires_ms = req.now_ms + 3600000;
    cr_assert_eq(idem_store_claim(st, &req, &outcome, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(outcome, IDEM_CLAIM_ACQUIRED);
    idem_record_clear(&rec);
    bool lapsed = false;
    for (int i = 0; i < 500 && !lapsed; i++) { /* bounded: the store's clock passes 1 ms */
        cr_assert_eq(idem_store_get(st, &req.key, &rec), IDEM_OK, "%s", idem_errmsg());
        lapsed = rec.lease_until_ms <= (rec.now_ms ? rec.now_ms : idem__now_ms());
        idem_record_clear(&rec);
        nanosleep(&(struct timespec){0, 2000000L}, NULL);
    }
    cr_assert(lapsed, "the owner's lease ran out");
}

/* The call as a re-driver's pass lists it. */
static void next_call(idem_store *st, idem__journaled_call *jc)
{
    uint8_t cursor[IDEM__JOURNAL_CURSOR] = {0};
    cr_assert_eq(idem__steps_next_call(st, cursor, jc), IDEM_OK, "%s", idem_errmsg());
}

static bool saga_started(idem_store *st, const uint8_t base[32])
{
    idem__journal j;
    bool exists = false;
    idem__journal_of_base(base, &j);
    cr_assert_eq(idem__journal_entry_exists(st, j.saga_key, &exists), IDEM_OK);
    return exists;
}

/* r1 and r2: two instances' stores on one database (the same handle on LMDB). The
 * call has had MAX_RUNS - 1 re-runs; its owner died once more; both re-drivers have
 * looked and count before either's run claims. */
static void both_count_one_death(idem_store *r1, idem_store *r2)
{
    listing l = {.runs = MAX_RUNS - 1};
    cr_assert(idem__journal_base(CALLER, METHOD, KEY, fp, l.base));
    cr_assert_eq(idem_store_run_txn(r1, put_journal, &l), IDEM_OK, "%s", idem_errmsg());
    abandon_call(r1);
    idem__journaled_call seen1, seen2, after;
    next_call(r1, &seen1);
    next_call(r2, &seen2);
    idem__redrive_verdict v1, v2;
    cr_assert_eq(idem__steps_count_run(r1, &seen1, MAX_RUNS, false, &v1), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(idem__steps_count_run(r2, &seen2, MAX_RUNS, false, &v2), IDEM_OK, "%s",
                 idem_errmsg());
    next_call(r1, &after);
    cr_expect_eq(v1, IDEM__REDRIVE_GO, "the first count runs the last re-run");
    cr_expect(v2 != IDEM__REDRIVE_COMPENSATE && v2 != IDEM__REDRIVE_GAVE_UP,
              "the second re-driver gave up after %u deaths (verdict %d)", MAX_RUNS - 1, v2);
    cr_expect_eq(after.runs, MAX_RUNS, "one death counted once (%u re-runs counted)", after.runs);
    cr_expect(!saga_started(r1, l.base), "its compensation started early");
    idem__journaled_call_clear(&seen1);
    idem__journaled_call_clear(&seen2);
    idem__journaled_call_clear(&after);
}

Test(redrive, two_re_drivers_count_one_death_once_on_lmdb)
{
    stores[0] = tu_store_open("redrive", &dir);
    both_count_one_death(stores[0], stores[0]);
}

Test(redrive, two_re_drivers_count_one_death_once_on_postgres)
{
    conninfo = tu_pg_schema_create(schema);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(tu_pg_open(&stores[i], conninfo, 2), IDEM_OK, "%s", idem_errmsg());
    }
    both_count_one_death(stores[0], stores[1]);
}

/* What a claim does to the listing (steps_redrive.c claim_txn): CALL_COUNTED cleared. */
static idem_code claimed_txn(idem_txn *t, void *arg)
{
    const uint8_t *base = arg;
    idem__journal j;
    const void *v;
    size_t n;
    uint8_t copy[256];
    idem__journal_of_base(base, &j);
    idem_code code = idem_txn_get(t, IDEM__STEPS_DB, j.call_key, IDEM__JKEY, &v, &n);
    if (code != IDEM_OK || n > sizeof(copy)) {
        return code != IDEM_OK ? code : IDEM_INTERNAL;
    }
    memcpy(copy, v, n);
    copy[2] &= (uint8_t)~CALL_COUNTED;
    return idem_txn_put(t, IDEM__STEPS_DB, j.call_key, IDEM__JKEY, copy, n);
}

/* A counts the death; B re-runs it uncounted and its run claims first (the death is
 * consumed); A's run is turned away and takes its count back: it must not, or the
 * death B re-ran counts for nothing and the call runs past redrive_max_runs. */
Test(redrive, a_count_whose_death_another_run_claimed_is_not_taken_back)
{
    stores[0] = tu_store_open("redrive", &dir);
    idem_store *st = stores[0];
    listing l = {.runs = 0};
    cr_assert(idem__journal_base(CALLER, METHOD, KEY, fp, l.base));
    cr_assert_eq(idem_store_run_txn(st, put_journal, &l), IDEM_OK, "%s", idem_errmsg());
    abandon_call(st);
    idem__journaled_call seen1, seen2, after;
    next_call(st, &seen1);
    next_call(st, &seen2);
    idem__redrive_verdict v1, v2, v3;
    cr_assert_eq(idem__steps_count_run(st, &seen1, MAX_RUNS, false, &v1), IDEM_OK);
    cr_assert_eq(idem__steps_count_run(st, &seen2, MAX_RUNS, false, &v2), IDEM_OK);
    cr_assert_eq(v2, IDEM__REDRIVE_GO_UNCOUNTED);
    cr_assert_eq(idem_store_run_txn(st, claimed_txn, l.base), IDEM_OK, "B's run claims");
    cr_assert_eq(idem__steps_count_run(st, &seen1, MAX_RUNS, true, &v3), IDEM_OK);
    next_call(st, &after);
    cr_expect_eq(after.runs, 1, "the death B re-ran still counts (%u re-runs counted)", after.runs);
    idem__journaled_call_clear(&seen1);
    idem__journaled_call_clear(&seen2);
    idem__journaled_call_clear(&after);
}

/* ---- through servers: what the give-up counts ---- */

/* A store that can be made slow: every fdatasync of a durable LMDB store waits SLOW_MS
 * (this program's fdatasync wins over libc's for liblmdb, as in test_lease.c), or every
 * chunk between the servers and PostgreSQL waits SLOW_MS in a proxy. Either way a claim
 * is answered after its lease (LEASE_MS) has run out. */
#define SLOW_MS 400
#define LEASE_MS 300

static atomic_uint slow_sync_ms;
#if TU_HAVE_PG
static pgproxy *proxy;
#endif

int fdatasync(int fd)
{
    unsigned ms = atomic_load(&slow_sync_ms);
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    if (ms > 0) {
        nanosleep(&ts, NULL);
    }
    return (int)syscall(SYS_fdatasync, fd);
}

static void slow_store_set(bool slow)
{
    atomic_store(&slow_sync_ms, slow ? SLOW_MS : 0);
#if TU_HAVE_PG
    if (proxy != NULL) {
        pgproxy_delay(proxy, slow ? SLOW_MS / 2 : 0);
    }
#endif
}

/* The calls' runs: the first (the client's, on a server whose re-driver waits) "dies"
 * after its hold: it stalls, and its server stops renewing its lease after max_run_ms.
 * The re-driver's first re-run claims on a slow store and loses its own lease before
 * it can pay, in a process that lives. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int runs;
    bool first_stalled, let_go, rerun_logged; /* the runs' gates */
    bool gave_up, finished;                   /* the re-driver's log said */
    atomic_int pays, undos;
} G = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void raise_flag(bool *flag)
{
    pthread_mutex_lock(&G.mu);
    *flag = true;
    pthread_cond_broadcast(&G.cv);
    pthread_mutex_unlock(&G.mu);
}

/* Waits for *flag, or for *or (may be NULL), for up to 20 s. */
static void await_flag(const bool *flag, const bool * or)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 20;
    pthread_mutex_lock(&G.mu);
    while (!*flag && (or == NULL || !* or) && pthread_cond_timedwait(&G.cv, &G.mu, &until) == 0) {
    }
    pthread_mutex_unlock(&G.mu);
}

static void redriver_log(void *arg, idem_log_level level, const char *line)
{
    (void)arg, (void)level;
    if (strstr(line, "redrive") != NULL) {
        cr_log_info("%s", line);
    }
    if (strstr(line, "not re-run any more") != NULL) {
        raise_flag(&G.gave_up);
    } else if (strstr(line, "ran it again: OK") != NULL) {
        raise_flag(&G.finished);
    } else if (strstr(line, "re-run 1 of 1") != NULL) {
        raise_flag(&G.rerun_logged);
    }
}

static idem_code effect_fn(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call, (void)out;
    atomic_fetch_add((atomic_int *)arg, 1);
    return IDEM_OK;
}

static idem_code unhold(idem_call *call, const char *step, const idem_step_result *done, void *arg)
{
    (void)call, (void)step, (void)done, (void)arg;
    atomic_fetch_add(&G.undos, 1);
    return IDEM_OK;
}

/* rd.Order/Book: hold (undone on a final failure), then pay. The first run stalls
 * between them until the test lets it go. */
static idem_code book(idem_call *call, void *arg)
{
    static atomic_int holds;
    idem_step_opts undo = {.undo = unhold};
    idem_step_result h = {0}, p = {0};
    (void)arg;
    pthread_mutex_lock(&G.mu);
    int run = ++G.runs;
    pthread_mutex_unlock(&G.mu);
    idem_code code = idem_call_step_with(call, "hold", effect_fn, &holds, &undo, &h);
    if (run == 1) {
        raise_flag(&G.first_stalled);
        await_flag(&G.let_go, NULL); /* "dead": its lease runs out */
    }
    if (code == IDEM_OK) {
        code = idem_call_step(call, "pay", effect_fn, &G.pays, &p);
    }
    code = code == IDEM_OK ? idem_call_reply(call, IDEM_OK, "booked", 6)
                           : idem_call_fail(call, code, "%s", idem_errmsg());
    idem_step_result_clear(&h);
    idem_step_result_clear(&p);
    return code;
}

/* A server on st: the first run's (its re-driver looks only after the test; a stalled
 * run's lease runs out soon), or the re-driver's (every 20 ms; max_run_ms well above a
 * slow run; redrive_max_runs 1). */
static void book_server(tu_server *ts, idem_store *st, bool redriver)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = st;
    o.lease_ms = LEASE_MS;
    o.max_run_ms = redriver ? 20000 : LEASE_MS;
    o.redrive_interval_ms = redriver ? 20 : 3600000; /* on: its claims list the call */
    o.redrive_max_runs = 1;
    o.log_level = redriver ? IDEM_LOG_INFO : IDEM_LOG_OFF;
    o.log_fn = redriver_log;
    tu_server_create(ts, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_STEPS};
    cr_assert_eq(idem_server_register(ts->srv, "rd.Order/Book", book, NULL, &m), IDEM_OK);
    tu_server_listen(ts);
}

/* Only a re-run that died counts against redrive_max_runs (1 here). The re-driver's
 * re-run of an abandoned call claims on a slow store, and finds its own lease lost
 * before it could pay, while its process lives: it did not die. Once the store is fast
 * again, the re-driver runs the call again and finishes it, instead of giving up and
 * undoing the hold after "1 re-runs of the call died". */
static void a_lost_claim_is_not_a_death(idem_store *st)
{
    tu_server first, rd;
    book_server(&first, st, false);
    book_server(&rd, st, true);
    idem_client *c = tu_client_attempts(first.url, 100, 1);
    idem_request q = {.method = "rd.Order/Book", .idempotency_key = "trip-1"};
    idem_result r;
    cr_assert_neq(idem_client_call(c, &q, &r), IDEM_OK, "the client gave up on its stalled run");
    idem_result_clear(&r);
    idem_client_close(c);
    await_flag(&G.first_stalled, NULL);
    slow_store_set(true);
    await_flag(&G.rerun_logged, &G.gave_up); /* the re-run on the slow store has ended */
    slow_store_set(false);
    await_flag(&G.finished, &G.gave_up);
    cr_expect(!G.gave_up, "the re-driver gave up: it counted a re-run that lost its lease");
    cr_expect(G.finished, "the re-driver finished the call");
    cr_expect_eq(atomic_load(&G.undos), 0, "the hold was undone");
    cr_expect_eq(atomic_load(&G.pays), 1, "paid %d times", atomic_load(&G.pays));
    raise_flag(&G.let_go);
    tu_server_destroy(&rd, false);
    tu_server_destroy(&first, false);
}

Test(redrive, a_rerun_that_lost_its_lease_alive_is_not_counted_as_died_on_lmdb, .timeout = 120)
{
    dir = tu_tempdir("redrive");
    cr_assert_eq(idem_store_open_lmdb(&stores[0], dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    a_lost_claim_is_not_a_death(stores[0]);
}

/* Slow: every statement of the re-driver's pass and of its re-run's claim crosses the
 * slow proxy (about 20 s). */
Test(redrive, a_rerun_that_lost_its_lease_alive_is_not_counted_as_died_on_postgres, .timeout = 120)
{
#if TU_HAVE_PG
    char *via;
    conninfo = tu_pg_schema_create(schema);
    proxy = pgproxy_start(conninfo);
    cr_assert_gt(asprintf(&via, "%s host=127.0.0.1 port=%d", conninfo, pgproxy_port(proxy)), 0);
    cr_assert_eq(tu_pg_open(&stores[0], via, 4), IDEM_OK, "%s", idem_errmsg());
    free(via);
    a_lost_claim_is_not_a_death(stores[0]);
    slow_store_set(false);
    idem_store_close(stores[0]);
    stores[0] = NULL;
    pgproxy_stop(proxy);
    proxy = NULL;
#else
    cr_skip_test("built without libpq");
#endif
}

/* The re-driver's count of re-runs (redrive_max_runs) when two instances share one
 * store, on LMDB and on PostgreSQL: each re-driver reads the abandoned call, counts a
 * re-run in its own txn, then runs it, and the run's claim takes the record over. Two
 * re-drivers that both count before either one's run claims must count the one death
 * once, or the call gives up (and compensates) after fewer deaths than it may have. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/toolkit/steps_internal.h"
#include "testutil.h"

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

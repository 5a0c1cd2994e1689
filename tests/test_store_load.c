/* The LMDB store's bulk load (load.c), what idemrpc-bench's scale stores are written
 * with: records in the store's own format, readable by claims and swept by expiry. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "lmdb/store_lmdb.h"
#include "testutil.h"

#define CALLER "bench"
#define METHOD "bench.Echo/Echo"
#define N 1000

static char *dir;
static idem_store *st;
static idem_record tmpl;
static char keybuf[17];
static bool reversed;

static void load_setup(void)
{
    st = tu_store_open("store_load", &dir);
    memset(&tmpl, 0, sizeof(tmpl));
    tmpl.state = IDEM_REC_COMPLETED;
    memset(tmpl.fingerprint, 0xa1, sizeof(tmpl.fingerprint));
    tmpl.owner = 7;
    tmpl.response = "stored-response";
    tmpl.response_len = strlen("stored-response");
    reversed = false;
}

static void load_teardown(void)
{
    idem_store_close(st);
    tu_rmtree(dir);
}

TestSuite(store_load, .init = load_setup, .fini = load_teardown);

/* Record i: key "%016x" of i * 1000 (ascending), expiring at 10 000 + i. */
static void key_at(void *arg, size_t i, idem_key_ref *ref, uint64_t *expires_ms)
{
    (void)arg;
    size_t at = reversed ? N - 1 - i : i;
    snprintf(keybuf, sizeof(keybuf), "%016zx", at * 1000);
    *ref = (idem_key_ref){CALLER, METHOD, keybuf};
    *expires_ms = 10000 + i;
}

static idem_claim_outcome claim_of(size_t i, idem_record *rec)
{
    char key[17];
    snprintf(key, sizeof(key), "%016zx", i * 1000);
    idem_claim_req req = {.key = {CALLER, METHOD, key},
                          .owner = 99,
                          .now_ms = 5000,
                          .lease_until_ms = 6000,
                          .expires_ms = 7000};
    memset(req.fingerprint, 0xa1, sizeof(req.fingerprint));
    idem_claim_outcome outcome;
    cr_assert_eq(idem_store_claim(st, &req, &outcome, rec), IDEM_OK, "%s", idem_errmsg());
    return outcome;
}

Test(store_load, loaded_records_replay_their_response)
{
    idem__lmdb_load_src src = {.n = N, .every = 3, .tmpl = &tmpl, .key_at = key_at};
    cr_assert_eq(idem__lmdb_load(st, &src), IDEM_OK, "%s", idem_errmsg());
    size_t probes[] = {0, 1, 2, 500, N - 1};
    for (size_t p = 0; p < sizeof(probes) / sizeof(probes[0]); p++) {
        idem_record rec;
        cr_assert_eq(claim_of(probes[p], &rec), IDEM_CLAIM_COMPLETED, "record %zu", probes[p]);
        cr_assert_eq(rec.response_len, tmpl.response_len);
        cr_assert(memcmp(rec.response, tmpl.response, rec.response_len) == 0);
        cr_assert_eq(rec.expires_ms, 10000 + probes[p]);
        idem_record_clear(&rec);
    }
    idem_store_stats s;
    cr_assert_eq(idem_store_stats_get(st, &s), IDEM_OK);
    cr_assert_eq(s.records, N);
    cr_assert_eq(s.completed, N);
}

Test(store_load, loaded_records_are_swept_at_their_expiry)
{
    idem__lmdb_load_src src = {.n = N, .every = 1, .tmpl = &tmpl, .key_at = key_at};
    size_t deleted;
    cr_assert_eq(idem__lmdb_load(st, &src), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_sweep(st, 10000 + 99, N, &deleted), IDEM_OK);
    cr_assert_eq(deleted, 100);
    idem_store_stats s;
    cr_assert_eq(idem_store_stats_get(st, &s), IDEM_OK);
    cr_assert_eq(s.records, N - 100);
}

Test(store_load, keys_out_of_order_are_refused)
{
    reversed = true;
    idem__lmdb_load_src src = {.n = N, .every = 1, .tmpl = &tmpl, .key_at = key_at};
    cr_assert_eq(idem__lmdb_load(st, &src), IDEM_INVALID_ARGUMENT);
}

Test(store_load, an_in_progress_template_is_refused)
{
    tmpl.state = IDEM_REC_IN_PROGRESS;
    idem__lmdb_load_src src = {.n = N, .every = 1, .tmpl = &tmpl, .key_at = key_at};
    cr_assert_eq(idem__lmdb_load(st, &src), IDEM_INVALID_ARGUMENT);
}

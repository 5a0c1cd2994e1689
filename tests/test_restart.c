/* The store outlives the process: replays and leases survive a server restart. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "call.h"
#include "lmdb_internal.h"
#include "testutil.h"

static atomic_int executions;

static idem_code h_count(idem_call *call, void *arg)
{
    (void)arg;
    char out[16];
    int n = snprintf(out, sizeof(out), "run %d", atomic_fetch_add(&executions, 1) + 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static void start_with(tu_server *ts, char *dir, uint64_t tomb_ttl_ms)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.lease_ms = 200;
    o.tombstone_ttl_ms = tomb_ttl_ms;
    memset(ts, 0, sizeof(*ts));
    if (dir == NULL) {
        tu_server_create(ts, &o);
    } else {
        o.db_path = dir;
        cr_assert_eq(idem_server_create(&ts->srv, &o), IDEM_OK, "%s", idem_errmsg());
        ts->dir = dir;
    }
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(ts->srv, "test.Pay/Charge", h_count, NULL, &m), IDEM_OK);
    tu_server_listen(ts);
}

static void start(tu_server *ts, char *dir)
{
    start_with(ts, dir, 0);
}

static idem_code charge(const char *url, const char *key, idem_result *r)
{
    idem_client *c = tu_client(url, 2000);
    idem_request q = {
        .method = "test.Pay/Charge", .idempotency_key = key, .payload = "100", .payload_len = 3};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

Test(restart, replay_survives_server_restart_on_the_same_store)
{
    tu_server ts;
    idem_result r;
    atomic_store(&executions, 0);
    start(&ts, NULL);
    cr_assert_eq(charge(ts.url, "charge-1", &r), IDEM_OK);
    cr_expect_str_eq(r.payload, "run 1");
    idem_result_clear(&r);
    tu_server_destroy(&ts, true);

    start(&ts, ts.dir);
    cr_assert_eq(charge(ts.url, "charge-1", &r), IDEM_OK);
    cr_expect(r.replayed);
    cr_expect_str_eq(r.payload, "run 1");
    cr_expect_eq(atomic_load(&executions), 1);
    idem_result_clear(&r);
    tu_server_destroy(&ts, false);
}

Test(restart, abandoned_claim_is_reclaimed_after_its_lease)
{
    char *dir = tu_tempdir("lease");
    idem_store *st;
    idem_claim_outcome out;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK);
    /* A crashed owner: IN_PROGRESS with a lease that is already over. */
    uint64_t now = (uint64_t)time(NULL) * 1000;
    idem_claim_req req = {.key = {"", "test.Pay/Charge", "charge-2"},
                          .owner = 7,
                          .now_ms = now - 1000,
                          .lease_until_ms = now - 1,
                          .expires_ms = now + 3600 * 1000};
    size_t plen = 3;
    idem__fingerprint("test.Pay/Charge", "100", plen, req.fingerprint);
    cr_assert_eq(idem_store_claim(st, &req, &out, NULL), IDEM_OK);
    cr_assert_eq(out, IDEM_CLAIM_ACQUIRED);
    idem_store_close(st);

    tu_server ts;
    idem_result r;
    atomic_store(&executions, 0);
    start(&ts, dir);
    cr_expect_eq(charge(ts.url, "charge-2", &r), IDEM_OK, "%s", r.message);
    cr_expect_not(r.replayed, "the unknown outcome is re-run (at-least-once)");
    cr_expect_eq(atomic_load(&executions), 1);
    idem_result_clear(&r);
    tu_server_destroy(&ts, false);
}

static void put_be(uint8_t *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--, v >>= 8) {
        p[i] = (uint8_t)v;
    }
}

/* Puts the tombstone of ref into "tombs" of the closed store at dir, as an earlier
 * release wrote it: the first layout (44 bytes, and an expiry entry 'T' at until), or
 * 6b9f435's (33 bytes: fingerprint ‖ code ‖ be48 expired_at ‖ be40 kept ‖ be40 ran). */
static void put_old_tombstone(const char *dir, const idem_key_ref *ref, bool first,
                              const uint8_t fp[IDEM_TOMBSTONE_FP_LEN], uint64_t first_at,
                              uint64_t expired_at, uint64_t until)
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi tombs, expiry;
    rec_key rk;
    uint8_t digest[32], tv[44], ik[IDEM__LMDB_INDEX_KEY_LEN], iv[1 + 16];
    cr_assert_eq(idem__lmdb_rec_key_make(&rk, ref), IDEM_OK);
    cr_assert(idem__sha256((const void *const[]){rk.bytes}, (const size_t[]){rk.len}, 1, digest));
    memcpy(tv, fp, 16);
    if (first) {
        idem__put_be64(tv + 16, first_at);
        idem__put_be64(tv + 24, expired_at);
        idem__put_be64(tv + 32, until);
        idem__put_be32(tv + 40, IDEM_OK);
    } else {
        tv[16] = IDEM_OK;
        put_be(tv + 17, expired_at, 6);
        put_be(tv + 23, until - expired_at, 5);
        put_be(tv + 28, expired_at - first_at, 5);
    }
    iv[0] = 'T';
    memcpy(iv + 1, digest, 16);
    cr_assert_eq(idem__lmdb_index_key(ik, until, digest, 16), 0);
    MDB_val k = {16, digest}, v = {first ? 44 : 33, tv}, xk = {sizeof(ik), ik},
            xv = {sizeof(iv), iv};
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_set_maxdbs(env, 64), 0);
    cr_assert_eq(mdb_env_open(env, dir, 0, 0600), 0);
    cr_assert_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, "tombs", 0, &tombs), 0);
    cr_assert_eq(mdb_dbi_open(txn, "expiry", 0, &expiry), 0);
    cr_assert_eq(mdb_put(txn, tombs, &k, &v, 0), 0);
    if (first) {
        cr_assert_eq(mdb_put(txn, expiry, &xk, &xv, 0), 0);
    }
    cr_assert_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
}

/* An LMDB store whose tombstone an earlier layout wrote (no migration): a new server
 * answers the late duplicate from it, and the sweep deletes it at its until: the first
 * layout's through its expiry entry, 6b9f435's by the scan of "tombs". */
static void old_layout_answers_and_is_swept(bool first)
{
    char *dir = tu_tempdir("tomb_layout");
    idem_store *st;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    idem_store_close(st);
    uint64_t now = (uint64_t)time(NULL) * 1000, until = now + 3600 * 1000;
    idem_key_ref ref = {"", "test.Pay/Charge", "charge-3"};
    uint8_t fp[IDEM_FINGERPRINT_LEN];
    idem__fingerprint("test.Pay/Charge", "100", 3, fp);
    put_old_tombstone(dir, &ref, first, fp, now - 2000, now - 1000, until);

    tu_server ts;
    idem_result r;
    atomic_store(&executions, 0);
    start_with(&ts, dir, 3600 * 1000);
    cr_assert_eq(charge(ts.url, "charge-3", &r), IDEM_ALREADY_EXISTS, "%s", r.message);
    const char *gone = idem_result_metadata(&r, "idem-result-gone");
    cr_expect(gone != NULL && strcmp(gone, "OK") == 0, "%s", gone ? gone : "(none)");
    cr_expect_eq(atomic_load(&executions), 0);
    idem_result_clear(&r);
    tu_server_destroy(&ts, true); /* keeps dir */

    idem_tombstone t;
    size_t n;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_tombstone_get(st, &ref, &t), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(t.until_ms, until);
    cr_expect_eq(t.first_at_ms, now - 2000);
    cr_assert_eq(idem_store_sweep(st, until - 1, 10, &n), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(n, 0, "the sweep before its until deleted %zu", n);
    cr_assert_eq(idem_store_sweep(st, until, 10, &n), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(n, 1, "the sweep at its until deleted %zu", n);
    cr_expect_eq(idem_store_tombstone_get(st, &ref, &t), IDEM_NOT_FOUND);
    idem_store_close(st);
    tu_rmtree(dir);
}

Test(restart, tombstones_of_the_first_layout_answer_and_are_swept)
{
    old_layout_answers_and_is_swept(true);
}

Test(restart, tombstones_of_the_33_byte_layout_answer_and_are_swept)
{
    old_layout_answers_and_is_swept(false);
}

/* LMDB tombstones in their present layout (src/store/lmdb/tomb_db.c): enough of them
 * that every bucket is a sub-database, written in a random order, each found exactly by
 * its key, deleted alone, and swept in bounded batches that go on where they stopped. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "store.h"
#include "testutil.h"

enum { N = 3000, KEEP = 100000, T0 = 1000000 };
#define PAY "pay.Pay/Charge"

static char *dir;
static idem_store *st;

static void setup(void)
{
    st = tu_store_open("tomb_buckets", &dir);
}

static void teardown(void)
{
    idem_store_close(st);
    tu_rmtree(dir);
}

TestSuite(tomb_buckets, .init = setup, .fini = teardown);

static void key_of(int i, char out[16])
{
    snprintf(out, 16, "order-%d", i);
}

/* Record i's result expires at T0 + 10 + (i · 7919 mod 97): the sweep writes the
 * tombstones in a random order of their key hashes. */
static uint64_t expiry_of(int i)
{
    return T0 + 10 + (uint64_t)i * 7919 % 97;
}

static idem_claim_req req_of(int i, const char *key, uint64_t now, uint64_t horizon)
{
    idem_claim_req req = {.key = {"", PAY, key},
                          .now_ms = now,
                          .lease_until_ms = now + 100,
                          .expires_ms = now + 200,
                          .tombstone_ttl_ms = horizon};
    memcpy(req.fingerprint, &i, sizeof(i));
    req.fingerprint[IDEM_FINGERPRINT_LEN - 1] = 0x5a;
    return req;
}

/* N completed records whose results expired, swept into N tombstones. */
static void fill_and_sweep(void)
{
    char key[16];
    size_t n, total = 0;
    cr_assert_eq(idem__store_tomb_keep(st, KEEP), IDEM_OK, "%s", idem_errmsg());
    for (int i = 0; i < N; i++) {
        key_of(i, key);
        idem_claim_req req = req_of(i, key, T0, 0);
        idem_claim_outcome out;
        idem_record rec;
        cr_assert_eq(idem_store_claim(st, &req, &out, &rec), IDEM_OK, "%s", idem_errmsg());
        cr_assert_eq(idem__store_complete_at(st, &req.key, rec.owner, "", 0, expiry_of(i), T0, 0),
                     IDEM_OK, "%s", idem_errmsg());
        idem_record_clear(&rec);
    }
    for (int round = 0; round < N && (total == 0 || n > 0); round++) {
        cr_assert_eq(idem_store_sweep(st, T0 + 200, 500, &n), IDEM_OK, "%s", idem_errmsg());
        cr_assert_leq(n, 500);
        total += n;
    }
    cr_assert_eq(total, N, "swept %zu records", total);
}

static bool count(void *arg, const idem_key_ref *key, const uint8_t *hash, const idem_tombstone *t)
{
    (void)t;
    cr_assert(key == NULL && hash != NULL, "LMDB names a tombstone by its key's hash");
    ++*(size_t *)arg;
    return true;
}

Test(tomb_buckets, each_is_found_by_its_key_with_what_it_keeps)
{
    char key[16];
    idem_tombstone t;
    idem_store_stats s;
    size_t visited = 0;
    fill_and_sweep();
    for (int i = 0; i < N; i++) {
        key_of(i, key);
        idem_claim_req req = req_of(i, key, T0, 0);
        cr_assert_eq(idem_store_tombstone_get(st, &req.key, &t), IDEM_OK, "%s", key);
        cr_assert_eq(t.fingerprint_len, 8);
        cr_assert_arr_eq(t.fingerprint, req.fingerprint, 8, "%s", key);
        cr_assert_eq(t.expired_at_ms, expiry_of(i));
        cr_assert_eq(t.until_ms, expiry_of(i) + KEEP);
        cr_assert_eq(t.first_at_ms, T0);
        cr_assert_eq(t.code, IDEM_OK);
    }
    cr_assert_eq(idem_store_tombstone_get(st, &(idem_key_ref){"", PAY, "never"}, &t),
                 IDEM_NOT_FOUND);
    cr_assert_eq(idem_store_stats_get(st, &s), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(s.tombstones, N);
    cr_assert_eq(idem_store_tombstone_foreach(st, count, &visited), IDEM_OK);
    cr_assert_eq(visited, N);
}

Test(tomb_buckets, a_claim_reads_the_same_request_and_another_by_the_kept_prefix)
{
    char key[16];
    idem_claim_outcome out;
    idem_record rec;
    fill_and_sweep();
    key_of(17, key);
    idem_claim_req same = req_of(17, key, T0 + 300, KEEP);
    same.fingerprint[IDEM_FINGERPRINT_LEN - 1] = 0; /* past the 8 bytes kept */
    cr_assert_eq(idem_store_claim(st, &same, &out, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(out, IDEM_CLAIM_TOMBSTONE);
    idem_record_clear(&rec);
    idem_claim_req other = req_of(18, key, T0 + 300, KEEP);
    cr_assert_eq(idem_store_claim(st, &other, &out, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(out, IDEM_CLAIM_MISMATCH);
    idem_record_clear(&rec);
}

Test(tomb_buckets, one_is_deleted_alone_and_the_sweep_deletes_the_rest_in_bounded_batches)
{
    char key[16];
    idem_tombstone t;
    size_t n, swept = 0;
    fill_and_sweep();
    for (int i = 0; i < N; i += 3) {
        key_of(i, key);
        cr_assert_eq(idem_store_tombstone_delete(st, &(idem_key_ref){"", PAY, key}), IDEM_OK);
    }
    for (int i = 0; i < N; i++) {
        key_of(i, key);
        cr_assert_eq(idem_store_tombstone_get(st, &(idem_key_ref){"", PAY, key}, &t),
                     i % 3 == 0 ? IDEM_NOT_FOUND : IDEM_OK, "%s", key);
    }
    cr_assert_eq(idem_store_sweep(st, T0 + 10 + KEEP - 1, 100, &n), IDEM_OK);
    cr_assert_eq(n, 0, "a tombstone swept before its until");
    for (int round = 0; round < N && swept < N - (N + 2) / 3; round++) {
        cr_assert_eq(idem_store_sweep(st, T0 + 200 + KEEP, 100, &n), IDEM_OK, "%s", idem_errmsg());
        cr_assert_leq(n, 100);
        swept += n;
    }
    cr_assert_eq(swept, N - (N + 2) / 3);
    cr_assert_eq(idem_store_sweep(st, T0 + 200 + KEEP, 100, &n), IDEM_OK);
    cr_assert_eq(n, 0);
}

/* Spans past 24.8 days are kept in whole seconds: the horizon rounded up (kept at most a
 * second longer), the first run rounded down (at most a second earlier). */
Test(tomb_buckets, long_horizons_and_long_results_keep_their_second)
{
    const uint64_t day = 24ull * 3600 * 1000, keep = 400 * day + 1, expires = T0 + 30 * day + 500;
    idem_claim_req req = req_of(1, "long", T0, 0);
    idem_claim_outcome out;
    idem_record rec;
    idem_tombstone t;
    size_t n;
    cr_assert_eq(idem__store_tomb_keep(st, keep), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_claim(st, &req, &out, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem__store_complete_at(st, &req.key, rec.owner, "", 0, expires, T0, 0), IDEM_OK);
    idem_record_clear(&rec);
    cr_assert_eq(idem_store_sweep(st, expires, 10, &n), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_tombstone_get(st, &req.key, &t), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(t.expired_at_ms, expires);
    cr_assert(t.until_ms >= expires + keep && t.until_ms < expires + keep + 1000, "%" PRIu64,
              t.until_ms - expires);
    cr_assert(t.first_at_ms <= T0 && t.first_at_ms > T0 - 1000, "%" PRIu64, t.first_at_ms);
    cr_assert_eq(idem_store_sweep(st, expires + keep - 1, 10, &n), IDEM_OK);
    cr_assert_eq(n, 0, "a tombstone swept before its horizon");
}

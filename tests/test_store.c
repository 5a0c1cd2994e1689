/* Unit tests of the LMDB idem_store: the claim state machine, leases, expiry and sweeping,
 * one-time tokens, key bounds, a full map and persistence. Every test gets a fresh store
 * in its own temp dir and runs on a fake clock (T0 + offsets), never on sleeps. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "store.h"
#include "testutil.h"

#define T0 UINT64_C(1700000000000) /* the fake "now", unix ms */
#define LEASE_MS UINT64_C(30000)
#define TTL_MS UINT64_C(86400000)
#define CALLER "tenant-a"
#define METHOD "shop.Orders/Create"
#define FP_A 0xa1 /* two distinct request fingerprints */
#define FP_B 0xb2

static char *dir;
static idem_store *st;

static void store_setup(void)
{
    st = tu_store_open("store", &dir);
}

static void store_teardown(void)
{
    idem_store_close(st);
    st = NULL;
    tu_rmtree(dir);
    dir = NULL;
}

TestSuite(store, .init = store_setup, .fini = store_teardown);

/* ---- helpers ---- */

static idem_key_ref key_of(const char *key)
{
    return (idem_key_ref){CALLER, METHOD, key};
}

/* A claim of key by owner at now for a request whose fingerprint is 32 x fp. */
static idem_claim_req claim_req(const char *key, uint8_t fp, uint64_t owner, uint64_t now)
{
    idem_claim_req r = {.key = key_of(key),
                        .owner = owner,
                        .now_ms = now,
                        .lease_until_ms = now + LEASE_MS,
                        .expires_ms = now + LEASE_MS + TTL_MS};
    memset(r.fingerprint, fp, sizeof(r.fingerprint));
    return r;
}

/* Claims and asserts the call itself succeeded; rec may be NULL. */
static idem_claim_outcome claim(const idem_claim_req *r, idem_record *rec)
{
    idem_claim_outcome out = 0;
    cr_assert_eq(idem_store_claim(st, r, &out, rec), IDEM_OK, "claim %s: %s", r->key.key,
                 idem_errmsg());
    return out;
}

/* Claims key at T0 as owner and completes it with response, expiring at expires. */
static void put_completed(const char *key, uint8_t fp, uint64_t owner, const char *response,
                          uint64_t expires)
{
    idem_claim_req r = claim_req(key, fp, owner, T0);
    idem_key_ref k = key_of(key);
    cr_assert_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED, "claim %s", key);
    cr_assert_eq(idem_store_complete(st, &k, owner, response, strlen(response), expires), IDEM_OK,
                 "complete %s: %s", key, idem_errmsg());
}

/* n completed records "<prefix>-<i>" expiring at expires. */
static void put_many_completed(const char *prefix, size_t n, uint64_t expires)
{
    for (size_t i = 0; i < n; i++) {
        char key[64];
        snprintf(key, sizeof(key), "%s-%zu", prefix, i);
        put_completed(key, FP_A, i + 1, "{}", expires);
    }
}

/* n tokens "<prefix>-<i>" for CALLER expiring at expires. */
static void put_many_tokens(const char *prefix, size_t n, uint64_t expires)
{
    for (size_t i = 0; i < n; i++) {
        char tok[64];
        snprintf(tok, sizeof(tok), "%s-%zu", prefix, i);
        cr_assert_eq(idem_store_token_put(st, tok, CALLER, expires), IDEM_OK, "%s", idem_errmsg());
    }
}

static idem_code get(const char *key, idem_record *rec)
{
    idem_key_ref k = key_of(key);
    return idem_store_get(st, &k, rec);
}

static idem_store_stats stats(void)
{
    idem_store_stats s;
    cr_assert_eq(idem_store_stats_get(st, &s), IDEM_OK, "%s", idem_errmsg());
    return s;
}

static size_t sweep(uint64_t now, size_t max)
{
    size_t deleted = (size_t)-1;
    cr_assert_eq(idem_store_sweep(st, now, max, &deleted), IDEM_OK, "%s", idem_errmsg());
    return deleted;
}

/* ---- the claim state machine ---- */

/* A store keeps 29 business databases besides its own four: the 30th is refused with a
 * clear error, before its write touches anything (group commit runs it in a batch's txn
 * with others), and the store goes on. */
Test(store, a_thirtieth_business_database_is_refused_clearly)
{
    char name[16];
    void *v = NULL;
    size_t n = 0;
    for (int i = 0; i < 29; i++) {
        snprintf(name, sizeof(name), "db%d", i);
        cr_assert_eq(idem_store_app_get(st, name, "k", 1, &v, &n), IDEM_NOT_FOUND, "%s: %s", name,
                     idem_errmsg());
    }
    cr_expect_eq(idem_store_app_get(st, "db29", "k", 1, &v, &n), IDEM_FAILED_PRECONDITION);
    cr_expect_str_eq(idem_errmsg(), "at most 29 business databases per store");
    idem_claim_req r = claim_req("after", FP_A, 11, T0);
    idem_record rec;
    cr_expect_eq(claim(&r, &rec), IDEM_CLAIM_ACQUIRED, "the store goes on");
    idem_record_clear(&rec);
}

Test(store, claim_of_absent_key_acquires)
{
    idem_claim_req r = claim_req("k1", FP_A, 11, T0);
    idem_record rec;
    cr_assert_eq(claim(&r, &rec), IDEM_CLAIM_ACQUIRED);
    idem_record_clear(&rec);

    cr_assert_eq(get("k1", &rec), IDEM_OK);
    cr_expect_eq(rec.state, IDEM_REC_IN_PROGRESS);
    cr_expect_eq(rec.owner, 11);
    /* The lease runs from the claim's commit: plus however long the claim waited for it
     * (whole ms; a loaded machine makes that more than 0). */
    cr_expect(rec.lease_until_ms >= T0 + LEASE_MS && rec.lease_until_ms < T0 + LEASE_MS + 5000,
              "lease until %llu", (unsigned long long)rec.lease_until_ms);
    cr_expect_eq(rec.first_at_ms, T0);
    cr_expect_arr_eq(rec.fingerprint, r.fingerprint, IDEM_FINGERPRINT_LEN);
    cr_expect_eq(rec.response_len, 0);
    idem_record_clear(&rec);
}

Test(store, second_claim_with_same_fingerprint_is_in_progress)
{
    idem_claim_req first = claim_req("k1", FP_A, 11, T0);
    idem_claim_req dup = claim_req("k1", FP_A, 22, T0 + 1);
    idem_record rec;
    cr_assert_eq(claim(&first, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(claim(&dup, &rec), IDEM_CLAIM_IN_PROGRESS);
    cr_expect_eq(rec.owner, 11, "the record shows who holds the lease");
    idem_record_clear(&rec);

    cr_assert_eq(get("k1", &rec), IDEM_OK);
    cr_expect_eq(rec.owner, 11, "the duplicate changed nothing");
    idem_record_clear(&rec);
}

Test(store, claim_with_other_fingerprint_is_mismatch)
{
    idem_claim_req first = claim_req("k1", FP_A, 11, T0);
    idem_claim_req other = claim_req("k1", FP_B, 22, T0 + 1);
    idem_record rec;
    cr_assert_eq(claim(&first, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(claim(&other, NULL), IDEM_CLAIM_MISMATCH, "against IN_PROGRESS");

    idem_key_ref k = key_of("k1");
    cr_assert_eq(idem_store_complete(st, &k, 11, "r", 1, T0 + TTL_MS), IDEM_OK);
    cr_expect_eq(claim(&other, NULL), IDEM_CLAIM_MISMATCH, "against COMPLETED");

    cr_assert_eq(get("k1", &rec), IDEM_OK);
    cr_expect_eq(rec.state, IDEM_REC_COMPLETED);
    cr_expect_eq(rec.owner, 11);
    idem_record_clear(&rec);
}

Test(store, completed_record_replays_its_response_to_later_claims)
{
    static const char response[] = "\x08\x00\x1a\x02ok"; /* any bytes */
    idem_claim_req dup = claim_req("k1", FP_A, 22, T0 + 5);
    idem_record rec;
    put_completed("k1", FP_A, 11, response, T0 + TTL_MS);

    cr_assert_eq(claim(&dup, &rec), IDEM_CLAIM_COMPLETED);
    cr_expect_eq(rec.state, IDEM_REC_COMPLETED);
    cr_expect_eq(rec.first_at_ms, T0);
    cr_expect_eq(rec.expires_ms, T0 + TTL_MS);
    cr_assert_eq(rec.response_len, strlen(response));
    cr_expect_arr_eq(rec.response, response, strlen(response));
    idem_record_clear(&rec);
    cr_expect_null(rec.response, "idem_record_clear frees and resets the response");
}

Test(store, complete_or_release_by_wrong_owner_is_aborted)
{
    idem_claim_req r = claim_req("k1", FP_A, 11, T0);
    idem_key_ref k = key_of("k1");
    idem_record rec;
    cr_assert_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED);

    cr_expect_eq(idem_store_complete(st, &k, 99, "x", 1, T0 + TTL_MS), IDEM_ABORTED);
    cr_expect_eq(idem_store_release(st, &k, 99), IDEM_ABORTED);
    cr_assert_eq(get("k1", &rec), IDEM_OK);
    cr_expect_eq(rec.state, IDEM_REC_IN_PROGRESS, "still held by the owner");
    cr_expect_eq(rec.owner, 11);
    idem_record_clear(&rec);
}

Test(store, complete_or_release_of_unclaimed_or_completed_key_is_aborted)
{
    idem_key_ref never = key_of("never-claimed"), done = key_of("done");
    cr_expect_eq(idem_store_complete(st, &never, 11, "x", 1, T0 + TTL_MS), IDEM_ABORTED);
    cr_expect_eq(idem_store_release(st, &never, 11), IDEM_ABORTED);

    put_completed("done", FP_A, 11, "first", T0 + TTL_MS);
    cr_expect_eq(idem_store_complete(st, &done, 11, "second", 6, T0 + TTL_MS), IDEM_ABORTED);
    cr_expect_eq(idem_store_release(st, &done, 11), IDEM_ABORTED);

    idem_record rec;
    cr_assert_eq(get("done", &rec), IDEM_OK);
    cr_assert_eq(rec.response_len, 5);
    cr_expect_arr_eq(rec.response, "first", 5, "the first result is never overwritten");
    idem_record_clear(&rec);
}

Test(store, release_removes_record_so_next_claim_acquires)
{
    idem_claim_req first = claim_req("k1", FP_A, 11, T0);
    idem_claim_req retry = claim_req("k1", FP_B, 22, T0 + 1);
    idem_key_ref k = key_of("k1");
    idem_record rec;
    cr_assert_eq(claim(&first, NULL), IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(idem_store_release(st, &k, 11), IDEM_OK);
    cr_expect_eq(get("k1", &rec), IDEM_NOT_FOUND);
    cr_expect_eq(claim(&retry, NULL), IDEM_CLAIM_ACQUIRED, "no fingerprint is remembered");
}

Test(store, live_lease_is_not_taken_over)
{
    idem_claim_req first = claim_req("k1", FP_A, 11, T0);
    idem_claim_req late = claim_req("k1", FP_A, 22, first.lease_until_ms - 1);
    cr_assert_eq(claim(&first, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(claim(&late, NULL), IDEM_CLAIM_IN_PROGRESS);
}

Test(store, expired_lease_is_taken_over_and_old_owner_loses_it)
{
    idem_claim_req first = claim_req("k1", FP_A, 11, T0);
    idem_key_ref k = key_of("k1");
    idem_record rec;
    cr_assert_eq(claim(&first, &rec), IDEM_CLAIM_ACQUIRED);
    /* At the lease the store wrote (it runs from the commit, so a claim that waited for
     * the writer on a busy machine has a little more than first.lease_until_ms). */
    idem_claim_req next = claim_req("k1", FP_A, 22, rec.lease_until_ms); /* lease <= now */
    cr_assert_eq(claim(&next, NULL), IDEM_CLAIM_TAKEN_OVER);

    cr_expect_eq(idem_store_complete(st, &k, 11, "old", 3, T0 + TTL_MS), IDEM_ABORTED);
    cr_expect_eq(idem_store_release(st, &k, 11), IDEM_ABORTED);
    cr_expect_eq(idem_store_complete(st, &k, 22, "new", 3, T0 + TTL_MS), IDEM_OK);
    cr_assert_eq(get("k1", &rec), IDEM_OK);
    cr_expect_eq(rec.owner, 22);
    cr_assert_eq(rec.response_len, 3);
    cr_expect_arr_eq(rec.response, "new", 3);
    idem_record_clear(&rec);
}

Test(store, completed_record_past_expiry_is_treated_as_absent)
{
    idem_claim_req before = claim_req("k1", FP_B, 22, T0 + 99);
    idem_claim_req after = claim_req("k1", FP_B, 22, T0 + 100); /* expires_ms <= now */
    put_completed("k1", FP_A, 11, "old", T0 + 100);

    cr_expect_eq(claim(&before, NULL), IDEM_CLAIM_MISMATCH, "not yet expired");
    cr_expect_eq(claim(&after, NULL), IDEM_CLAIM_ACQUIRED,
                 "an expired record neither replays nor mismatches");
    idem_record rec;
    cr_assert_eq(get("k1", &rec), IDEM_OK);
    cr_expect_eq(rec.state, IDEM_REC_IN_PROGRESS);
    cr_expect_eq(rec.owner, 22);
    idem_record_clear(&rec);
}

Test(store, claim_owner_must_be_nonzero)
{
    idem_claim_req r = claim_req("k1", FP_A, 0, T0);
    idem_claim_outcome out;
    idem_record rec;
    cr_expect_eq(idem_store_claim(st, &r, &out, NULL), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(get("k1", &rec), IDEM_NOT_FOUND);
}

Test(store, delete_removes_any_record)
{
    idem_key_ref k = key_of("k1");
    idem_claim_req again = claim_req("k1", FP_B, 22, T0);
    put_completed("k1", FP_A, 11, "r", T0 + TTL_MS);
    cr_expect_eq(idem_store_delete(st, &k), IDEM_OK);
    cr_expect_eq(idem_store_delete(st, &k), IDEM_NOT_FOUND);
    cr_expect_eq(claim(&again, NULL), IDEM_CLAIM_ACQUIRED);
}

Test(store, keys_are_scoped_by_caller_and_method)
{
    idem_claim_req r = claim_req("k1", FP_B, 22, T0);
    put_completed("k1", FP_A, 11, "r", T0 + TTL_MS);
    r.key.caller = "tenant-b";
    cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED, "other caller, same key");
    r.key.caller = CALLER;
    r.key.method = "shop.Orders/Cancel";
    cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED, "other method, same key");
}

/* The record key is caller \0 method \0 key: parts that would run together without the
 * separators ("ab"+"c.S/M" and "a"+"bc.S/M", ":" in any part) stay distinct, and no part
 * can hold a NUL (C strings here; the codec refuses NULs on the wire:
 * decode_request/rejects_embedded_nul_in_strings). */
Test(store, record_keys_keep_their_parts_apart)
{
    static const idem_key_ref refs[] = {
        {"ab", "c.S/M", "k"},  {"a", "bc.S/M", "k"},  {"a", "b.S/M", "ck"},  {"a", "b.S/Mc", "k"},
        {"a:b", "c.S/M", "k"}, {"a", "b:c.S/M", "k"}, {"a", "c.S/M", "b:k"}, {"", "a.S/M", "k"}};
    for (size_t i = 0; i < IDEM_ARRAY_LEN(refs); i++) {
        idem_claim_req r = claim_req("x", FP_A, 10 + i, T0);
        r.key = refs[i];
        cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED, "%s|%s|%s shares a record",
                     refs[i].caller, refs[i].method, refs[i].key);
    }
}

/* ---- retention ---- */

Test(store, sweep_deletes_only_expired_records_and_tokens)
{
    idem_claim_req abandoned = claim_req("abandoned", FP_A, 7, T0);
    abandoned.expires_ms = T0 + 50; /* an IN_PROGRESS record nobody completed */
    cr_assert_eq(claim(&abandoned, NULL), IDEM_CLAIM_ACQUIRED);
    put_many_completed("old", 3, T0 + 100);
    put_many_completed("live", 2, T0 + TTL_MS);
    put_many_tokens("old-tok", 4, T0 + 100);
    put_many_tokens("live-tok", 1, T0 + TTL_MS);

    cr_expect_eq(sweep(T0 + 49, 1000), 0, "nothing is due yet");
    cr_expect_eq(sweep(T0 + 100, 1000), 1 + 3 + 4);

    idem_record rec;
    idem_store_stats s = stats();
    cr_expect_eq(s.records, 2);
    cr_expect_eq(s.tokens, 1);
    cr_expect_eq(get("abandoned", &rec), IDEM_NOT_FOUND);
    cr_expect_eq(get("old-0", &rec), IDEM_NOT_FOUND);
    cr_expect_eq(get("live-0", &rec), IDEM_OK);
    idem_record_clear(&rec);
    cr_expect_eq(idem_store_token_consume(st, "live-tok-0", CALLER, T0 + 100), IDEM_OK);
}

Test(store, sweep_deletes_in_batches_bounded_by_max)
{
    put_many_completed("exp", 2000, T0 + 10);
    put_many_tokens("exp-tok", 500, T0 + 10);
    put_many_completed("live", 10, T0 + TTL_MS);

    cr_expect_eq(sweep(T0 + 10, 1000), 1000);
    cr_expect_eq(sweep(T0 + 10, 1000), 1000);
    cr_expect_eq(sweep(T0 + 10, 1000), 500);
    cr_expect_eq(sweep(T0 + 10, 1000), 0);
    idem_store_stats s = stats();
    cr_expect_eq(s.records, 10);
    cr_expect_eq(s.tokens, 0);
}

Test(store, completion_moves_the_sweep_time_to_the_result_expiry)
{
    idem_claim_req r = claim_req("k1", FP_A, 11, T0);
    idem_key_ref k = key_of("k1");
    r.expires_ms = T0 + 10;
    cr_assert_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(idem_store_complete(st, &k, 11, "r", 1, T0 + 1000), IDEM_OK);

    cr_expect_eq(sweep(T0 + 500, 1000), 0, "the claim's expiry no longer applies");
    idem_record rec;
    cr_expect_eq(get("k1", &rec), IDEM_OK);
    idem_record_clear(&rec);
    cr_expect_eq(sweep(T0 + 1000, 1000), 1);
    cr_expect_eq(get("k1", &rec), IDEM_NOT_FOUND);
}

/* ---- one-time tokens ---- */

Test(store, token_is_consumed_exactly_once)
{
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + 1000), IDEM_OK);
    cr_expect_eq(idem_store_token_consume(st, "tok1", CALLER, T0), IDEM_OK);
    cr_expect_eq(idem_store_token_consume(st, "tok1", CALLER, T0), IDEM_FAILED_PRECONDITION);
    cr_expect_eq(stats().tokens, 0);
}

static atomic_int token_winners;

static void *consume_token(void *arg)
{
    (void)arg;
    if (idem_store_token_consume(st, "contested", CALLER, T0) == IDEM_OK) {
        atomic_fetch_add(&token_winners, 1);
    }
    return NULL;
}

Test(store, token_has_exactly_one_winner_among_64_concurrent_consumers)
{
    enum { N = 64 };
    pthread_t t[N];
    atomic_store(&token_winners, 0);
    cr_assert_eq(idem_store_token_put(st, "contested", CALLER, T0 + 1000), IDEM_OK);
    for (int i = 0; i < N; i++) {
        pthread_create(&t[i], NULL, consume_token, NULL);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
    }
    cr_expect_eq(atomic_load(&token_winners), 1);
}

Test(store, unknown_token_is_failed_precondition)
{
    cr_expect_eq(idem_store_token_consume(st, "never-issued", CALLER, T0),
                 IDEM_FAILED_PRECONDITION);
    cr_expect_eq(idem_store_token_consume(st, "", CALLER, T0), IDEM_FAILED_PRECONDITION);
}

Test(store, expired_token_is_failed_precondition)
{
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + 1000), IDEM_OK);
    cr_expect_eq(idem_store_token_consume(st, "tok1", CALLER, T0 + 1000), IDEM_FAILED_PRECONDITION,
                 "expires_ms <= now is expired");
}

Test(store, token_of_other_scope_is_permission_denied_and_stays_consumable)
{
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + 1000), IDEM_OK);
    cr_expect_eq(idem_store_token_consume(st, "tok1", "tenant-b", T0), IDEM_PERMISSION_DENIED);
    cr_expect_eq(idem_store_token_consume(st, "tok1", "", T0), IDEM_PERMISSION_DENIED);
    cr_expect_eq(idem_store_token_consume(st, "tok1", CALLER, T0), IDEM_OK);
}

Test(store, token_put_does_not_overwrite)
{
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + 1000), IDEM_OK);
    cr_expect_eq(idem_store_token_put(st, "tok1", "tenant-b", T0 + 1000), IDEM_ALREADY_EXISTS);
    cr_expect_eq(idem_store_token_consume(st, "tok1", CALLER, T0), IDEM_OK,
                 "the first scope still holds");
}

Test(store, claim_with_token_consumes_it_in_the_same_transaction)
{
    idem_claim_req r = claim_req("tok1", FP_A, 11, T0);
    r.token = "tok1";
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + 1000), IDEM_OK);
    cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(stats().tokens, 0);
    cr_expect_eq(idem_store_token_consume(st, "tok1", CALLER, T0), IDEM_FAILED_PRECONDITION);
}

Test(store, claim_with_unknown_token_writes_nothing)
{
    idem_claim_req r = claim_req("k1", FP_A, 11, T0);
    idem_claim_outcome out;
    idem_record rec;
    r.token = "never-issued";
    cr_expect_eq(idem_store_claim(st, &r, &out, NULL), IDEM_FAILED_PRECONDITION);
    cr_expect_eq(get("k1", &rec), IDEM_NOT_FOUND);
    cr_expect_eq(stats().records, 0);
}

Test(store, claim_with_token_of_other_caller_writes_nothing)
{
    idem_claim_req r = claim_req("k1", FP_A, 11, T0);
    idem_claim_outcome out;
    idem_record rec;
    r.token = "tok1";
    cr_assert_eq(idem_store_token_put(st, "tok1", "tenant-b", T0 + 1000), IDEM_OK);
    cr_expect_eq(idem_store_claim(st, &r, &out, NULL), IDEM_PERMISSION_DENIED);
    cr_expect_eq(get("k1", &rec), IDEM_NOT_FOUND);
    cr_expect_eq(idem_store_token_consume(st, "tok1", "tenant-b", T0), IDEM_OK,
                 "the token is still there for its owner");
}

Test(store, retry_with_used_token_replays_the_first_result)
{
    idem_claim_req retry = claim_req("tok1", FP_A, 22, T0 + 1);
    idem_record rec;
    retry.token = "tok1"; /* already consumed by the first claim */
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + 1000), IDEM_OK);
    cr_assert_eq(idem_store_token_consume(st, "tok1", CALLER, T0), IDEM_OK);
    put_completed("tok1", FP_A, 11, "first", T0 + TTL_MS);

    cr_expect_eq(claim(&retry, &rec), IDEM_CLAIM_COMPLETED);
    cr_expect_eq(rec.response_len, 5);
    idem_record_clear(&rec);
}

/* ---- key bounds ---- */

Test(store, key_bounds_are_enforced_by_every_operation)
{
    char caller128[IDEM_MAX_CALLER + 2], key256[IDEM_MAX_KEY + 2];
    memset(caller128, 'c', IDEM_MAX_CALLER + 1), caller128[IDEM_MAX_CALLER + 1] = '\0';
    memset(key256, 'k', IDEM_MAX_KEY + 1), key256[IDEM_MAX_KEY + 1] = '\0';
    const idem_key_ref bad[] = {
        {caller128, METHOD, "k1"}, /* caller of 128 bytes */
        {CALLER, "", "k1"},        /* empty method */
        {CALLER, NULL, "k1"},      /* no method */
        {CALLER, METHOD, key256},  /* key of 256 bytes */
        {CALLER, METHOD, ""},      /* empty key */
    };
    for (size_t i = 0; i < IDEM_ARRAY_LEN(bad); i++) {
        idem_claim_req r = claim_req("k1", FP_A, 11, T0);
        idem_claim_outcome out;
        idem_record rec;
        r.key = bad[i];
        cr_expect_eq(idem_store_claim(st, &r, &out, NULL), IDEM_INVALID_ARGUMENT, "#%zu", i);
        cr_expect_eq(idem_store_complete(st, &bad[i], 11, "x", 1, T0), IDEM_INVALID_ARGUMENT,
                     "#%zu", i);
        cr_expect_eq(idem_store_release(st, &bad[i], 11), IDEM_INVALID_ARGUMENT, "#%zu", i);
        cr_expect_eq(idem_store_get(st, &bad[i], &rec), IDEM_INVALID_ARGUMENT, "#%zu", i);
        cr_expect_eq(idem_store_delete(st, &bad[i]), IDEM_INVALID_ARGUMENT, "#%zu", i);
    }
    cr_expect_eq(stats().records, 0);
}

Test(store, keys_at_the_bounds_are_accepted)
{
    char caller127[IDEM_MAX_CALLER + 1], key255[IDEM_MAX_KEY + 1];
    memset(caller127, 'c', IDEM_MAX_CALLER), caller127[IDEM_MAX_CALLER] = '\0';
    memset(key255, 'k', IDEM_MAX_KEY), key255[IDEM_MAX_KEY] = '\0';
    idem_claim_req r = claim_req(key255, FP_A, 11, T0);
    idem_record rec;
    r.key.caller = caller127;
    cr_expect_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(idem_store_get(st, &r.key, &rec), IDEM_OK);
    idem_record_clear(&rec);
}

/* ---- capacity and persistence ---- */

#define FULL_RESPONSE_LEN 4096

static void fill_response(uint8_t *buf, size_t i)
{
    for (size_t j = 0; j < FULL_RESPONSE_LEN; j++) {
        buf[j] = (uint8_t)(i * 31 + j);
    }
}

/* Claims and completes "full-<i>" with ~4 KiB responses until the map is full; returns
 * how many completed. The key that hit the limit must be left as it was before the
 * failing write: absent (claim failed) or IN_PROGRESS (complete failed). */
static size_t fill_until_exhausted(idem_store *small)
{
    uint8_t response[FULL_RESPONSE_LEN];
    for (size_t i = 0; i < 10000; i++) {
        char key[32];
        snprintf(key, sizeof(key), "full-%zu", i);
        idem_claim_req r = claim_req(key, FP_A, i + 1, T0);
        idem_claim_outcome out;
        idem_record rec;
        idem_code code = idem_store_claim(small, &r, &out, NULL);
        if (code == IDEM_RESOURCE_EXHAUSTED) {
            cr_expect_eq(idem_store_get(small, &r.key, &rec), IDEM_NOT_FOUND, "%s", key);
            return i;
        }
        cr_assert_eq(code, IDEM_OK, "claim %s: %s", key, idem_errmsg());
        fill_response(response, i);
        code = idem_store_complete(small, &r.key, r.owner, response, sizeof(response), T0 + TTL_MS);
        if (code == IDEM_RESOURCE_EXHAUSTED) {
            cr_assert_eq(idem_store_get(small, &r.key, &rec), IDEM_OK, "%s", key);
            cr_expect_eq(rec.state, IDEM_REC_IN_PROGRESS, "failed complete wrote nothing");
            idem_record_clear(&rec);
            return i;
        }
        cr_assert_eq(code, IDEM_OK, "complete %s: %s", key, idem_errmsg());
    }
    cr_assert_fail("a 256 KiB map never filled up");
    return 0;
}

static void expect_full_records_intact(idem_store *small, size_t n)
{
    uint8_t response[FULL_RESPONSE_LEN];
    for (size_t i = 0; i < n; i++) {
        char key[32];
        idem_record rec;
        snprintf(key, sizeof(key), "full-%zu", i);
        idem_key_ref k = key_of(key);
        cr_assert_eq(idem_store_get(small, &k, &rec), IDEM_OK, "%s: %s", key, idem_errmsg());
        fill_response(response, i);
        cr_expect_eq(rec.state, IDEM_REC_COMPLETED, "%s", key);
        cr_assert_eq(rec.response_len, FULL_RESPONSE_LEN, "%s", key);
        cr_expect_arr_eq(rec.response, response, FULL_RESPONSE_LEN, "%s", key);
        idem_record_clear(&rec);
    }
}

Test(store, full_map_is_resource_exhausted_and_keeps_earlier_records)
{
    char path[4096];
    idem_store *small;
    snprintf(path, sizeof(path), "%s/small", dir);
    cr_assert_eq(idem_store_open_lmdb(&small, path, 256 * 1024, IDEM_STORE_NOSYNC), IDEM_OK, "%s",
                 idem_errmsg());

    size_t n = fill_until_exhausted(small);
    cr_log_info("%zu records of 4 KiB fit in a 256 KiB map", n);
    cr_expect_gt(n, 3, "a few records fit before the map is full");
    expect_full_records_intact(small, n);

    idem_store_close(small);
    cr_assert_eq(idem_store_open_lmdb(&small, path, 256 * 1024, IDEM_STORE_NOSYNC), IDEM_OK,
                 "reopen after MDB_MAP_FULL: %s", idem_errmsg());
    expect_full_records_intact(small, n);
    idem_store_close(small);
}

Test(store, reopen_keeps_records_and_tokens)
{
    idem_record rec;
    put_completed("k1", FP_A, 11, "first", T0 + TTL_MS);
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + 1000), IDEM_OK);
    idem_store_close(st);
    st = NULL;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());

    cr_assert_eq(get("k1", &rec), IDEM_OK);
    cr_expect_eq(rec.state, IDEM_REC_COMPLETED);
    cr_assert_eq(rec.response_len, 5);
    cr_expect_arr_eq(rec.response, "first", 5);
    idem_record_clear(&rec);
    cr_expect_eq(idem_store_token_consume(st, "tok1", CALLER, T0), IDEM_OK);
}

Test(store, stats_count_records_by_state_and_tokens)
{
    idem_claim_req a = claim_req("running-a", FP_A, 1, T0);
    idem_claim_req b = claim_req("running-b", FP_A, 2, T0);
    idem_store_stats s = stats();
    cr_expect_eq(s.records + s.in_progress + s.completed + s.tokens, 0, "empty store");
    cr_expect_eq(s.map_size, (size_t)1 << 30, "map_size 0 opens 1 GiB");

    cr_assert_eq(claim(&a, NULL), IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(claim(&b, NULL), IDEM_CLAIM_ACQUIRED);
    put_many_completed("done", 3, T0 + TTL_MS);
    put_many_tokens("tok", 4, T0 + TTL_MS);
    s = stats();
    cr_expect_eq(s.records, 5);
    cr_expect_eq(s.in_progress, 2);
    cr_expect_eq(s.completed, 3);
    cr_expect_eq(s.tokens, 4);
    cr_expect_gt(s.map_used, 0);
    cr_expect_leq(s.map_used, s.map_size);
}

/* A handler txn: claim key, then begin the business txn the record will commit in. */
static idem_txn *begin_handler_txn(const char *key, idem_claim_req *r)
{
    *r = (idem_claim_req){.key = {CALLER, METHOD, key},
                          .owner = 42,
                          .now_ms = T0,
                          .lease_until_ms = T0 + LEASE_MS,
                          .expires_ms = T0 + TTL_MS};
    idem_claim_outcome out;
    cr_assert_eq(idem_store_claim(st, r, &out, NULL), IDEM_OK);
    idem_txn *t;
    cr_assert_eq(idem__store_txn_begin(st, &t), IDEM_OK);
    return t;
}

Test(store, business_write_of_an_aborted_handler_txn_is_gone_and_the_db_still_works)
{
    idem_claim_req r;
    idem_txn *t = begin_handler_txn("tx-1", &r);
    cr_assert_eq(idem_txn_put(t, "ledger", "a", 1, "100", 3), IDEM_OK);
    idem__store_txn_abort(t); /* e.g. the handler answered UNAVAILABLE */
    void *v;
    size_t n;
    cr_expect_eq(idem_store_app_get(st, "ledger", "a", 1, &v, &n), IDEM_NOT_FOUND);

    t = begin_handler_txn("tx-2", &r);
    cr_assert_eq(idem_txn_put(t, "ledger", "a", 1, "200", 3), IDEM_OK);
    cr_assert_eq(idem__store_txn_complete_commit(t, &r.key, r.owner, "ok", 2, T0 + TTL_MS, T0),
                 IDEM_OK);
    cr_assert_eq(idem_store_app_get(st, "ledger", "a", 1, &v, &n), IDEM_OK);
    cr_expect_eq(n, 3);
    cr_expect_eq(memcmp(v, "200", 3), 0);
    free(v);
    idem_record rec;
    cr_assert_eq(idem_store_get(st, &r.key, &rec), IDEM_OK);
    cr_expect_eq(rec.state, IDEM_REC_COMPLETED, "effect and record committed together");
    idem_record_clear(&rec);
}

Test(store, handler_txn_that_lost_its_claim_commits_nothing)
{
    idem_claim_req r;
    idem_txn *t = begin_handler_txn("tx-3", &r);
    cr_assert_eq(idem_txn_put(t, "ledger", "b", 1, "1", 1), IDEM_OK);
    cr_expect_eq(idem__store_txn_complete_commit(t, &r.key, r.owner + 1, "ok", 2, T0 + TTL_MS, T0),
                 IDEM_ABORTED);
    void *v;
    size_t n;
    cr_expect_eq(idem_store_app_get(st, "ledger", "b", 1, &v, &n), IDEM_NOT_FOUND);
}

/* ---- fences, renewal, kept tokens (issue 10) ---- */

Test(store, store_assigned_owners_are_strictly_increasing_and_persist)
{
    idem_record r1, r2;
    idem_claim_req a = claim_req("f1", FP_A, 0, T0), b = claim_req("f2", FP_A, 0, T0);
    cr_assert_eq(claim(&a, &r1), IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(claim(&b, &r2), IDEM_CLAIM_ACQUIRED);
    cr_expect_gt(r1.owner, 0);
    cr_expect_gt(r2.owner, r1.owner);
    idem_store_close(st);
    st = NULL;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NOSYNC), IDEM_OK, "%s",
                 idem_errmsg());
    idem_record r3;
    idem_claim_req c = claim_req("f3", FP_A, 0, T0);
    cr_assert_eq(claim(&c, &r3), IDEM_CLAIM_ACQUIRED);
    cr_expect_gt(r3.owner, r2.owner, "the counter survives a restart");
    idem_claim_req none = claim_req("f4", FP_A, 0, T0);
    idem_claim_outcome out;
    cr_expect_eq(idem_store_claim(st, &none, &out, NULL), IDEM_INVALID_ARGUMENT,
                 "an assigned owner needs rec to come back in");
}

Test(store, renew_extends_only_the_owners_lease)
{
    idem_claim_req first = claim_req("k1", FP_A, 11, T0);
    idem_key_ref k = key_of("k1");
    cr_assert_eq(claim(&first, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(idem_store_renew(st, &k, 22, T0 + 2 * LEASE_MS, T0), IDEM_ABORTED);
    cr_assert_eq(idem_store_renew(st, &k, 11, T0 + 2 * LEASE_MS, T0 + LEASE_MS / 2), IDEM_OK);
    idem_claim_req late = claim_req("k1", FP_A, 33, T0 + LEASE_MS + 1);
    cr_expect_eq(claim(&late, NULL), IDEM_CLAIM_IN_PROGRESS, "past the first lease, still held");
    idem_claim_req later = claim_req("k1", FP_A, 44, T0 + 2 * LEASE_MS);
    cr_expect_eq(claim(&later, NULL), IDEM_CLAIM_TAKEN_OVER, "past the renewed one, taken");
}

Test(store, release_restores_the_consumed_token_and_completion_uses_it_up)
{
    idem_key_ref k = key_of("tok1");
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + 1000), IDEM_OK);
    idem_claim_req r = claim_req("tok1", FP_A, 11, T0);
    r.token = "tok1";
    cr_assert_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED);
    cr_expect_eq(stats().tokens, 0, "consumed by the claim");
    cr_assert_eq(idem_store_release(st, &k, 11), IDEM_OK);
    cr_expect_eq(stats().tokens, 1, "a released claim gives it back");
    r.owner = 22;
    idem_record rec;
    cr_assert_eq(claim(&r, &rec), IDEM_CLAIM_ACQUIRED, "so the retry can use it");
    idem_claim_req takeover = claim_req("tok1", FP_A, 33, rec.lease_until_ms); /* as written */
    takeover.token = "tok1";
    cr_assert_eq(claim(&takeover, NULL), IDEM_CLAIM_TAKEN_OVER, "a takeover needs no token");
    cr_assert_eq(idem_store_release(st, &k, 33), IDEM_OK);
    cr_expect_eq(stats().tokens, 1, "and inherits the kept one");
    r.owner = 44;
    cr_assert_eq(claim(&r, NULL), IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(idem_store_complete(st, &k, 44, "ok", 2, T0 + TTL_MS), IDEM_OK);
    cr_expect_eq(stats().tokens, 0);
    cr_expect_eq(idem_store_token_consume(st, "tok1", CALLER, T0), IDEM_FAILED_PRECONDITION);
}

Test(store, a_takeover_keeps_its_token_and_any_other_token_must_be_valid)
{
    cr_assert_eq(idem_store_token_put(st, "tok1", CALLER, T0 + LEASE_MS * 4), IDEM_OK);
    idem_claim_req first = claim_req("k1", FP_A, 11, T0);
    idem_record rec;
    first.token = "tok1";
    cr_assert_eq(claim(&first, &rec), IDEM_CLAIM_ACQUIRED);
    idem_claim_req bogus = claim_req("k1", FP_A, 22, rec.lease_until_ms); /* as written */
    bogus.token = "never-issued";
    idem_claim_outcome out;
    cr_expect_eq(idem_store_claim(st, &bogus, &out, NULL), IDEM_FAILED_PRECONDITION,
                 "an unknown token cannot take over an abandoned claim");
    idem_claim_req same = claim_req("k1", FP_A, 33, rec.lease_until_ms);
    same.token = "tok1";
    cr_expect_eq(claim(&same, NULL), IDEM_CLAIM_TAKEN_OVER, "the kept token is the one it needs");
}

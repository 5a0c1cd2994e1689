/* Tombstones at the store's interface, on both stores (tomb_store on LMDB, tomb_store_pg
 * on PostgreSQL): what a claim does with a key's tombstone. The server-level promises
 * are test_tombstones.c's. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store.h"
#include "testutil.h"

#define PAY "t.Pay/Charge"

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A claim of key by request fp (one byte repeated), its outcome; *owner its owner. */
static idem_claim_outcome claim(idem_store *st, const char *key, uint8_t fp, uint64_t horizon,
                                uint64_t lease_ms, uint64_t ttl_ms, uint64_t *owner)
{
    uint64_t now = now_ms();
    idem_claim_req req = {.key = {"", PAY, key},
                          .owner = 0,
                          .now_ms = now,
                          .lease_until_ms = now + lease_ms,
                          .expires_ms = now + lease_ms + ttl_ms,
                          .tombstone_ttl_ms = horizon};
    memset(req.fingerprint, fp, sizeof(req.fingerprint));
    idem_claim_outcome out = 0;
    idem_record rec;
    cr_assert_eq(idem_store_claim(st, &req, &out, &rec), IDEM_OK, "%s", idem_errmsg());
    if (owner != NULL) {
        *owner = rec.owner;
    }
    idem_record_clear(&rec);
    return out;
}

/* docs/semantics.md, "A key's life": a key whose record is gone and that has no
 * tombstone of its own ("no record; expired or swept, no tombstone") runs the same
 * request's claim (RUN); and "COMPLETED, TTL and tombstone horizon expired: treated as
 * no record (the claim deletes the tombstone)". Request B's claim on a server (or method)
 * without a horizon acquires a key whose tombstone (request A's) a horizon still keeps:
 * on LMDB that claim deletes A's tombstone (a key has a record or a tombstone, never
 * both); on PostgreSQL it leaves it next to B's record (pg/tombs.c). B's owner crashes;
 * its IN_PROGRESS record expires and is swept without a tombstone. B's retry, now on a
 * server with a horizon, is refused "key reused" (INVALID_ARGUMENT, final: the client
 * stops) on PostgreSQL because of A's stale tombstone - B's submission is lost - while
 * LMDB ran it (found by review on 9ce15c9). */
Test(tomb_store, a_crashed_requests_retry_is_not_refused_by_an_earlier_requests_tombstone)
{
    enum { KEEP = 600000, HORIZON = 600000 };
    tu_backend b = {0};
    idem_store *st = tu_backend_open(&b, "tomb_stale");
    cr_assert_eq(idem__store_tomb_keep(st, KEEP), IDEM_OK, "%s", idem_errmsg());
    uint64_t owner, t0 = now_ms();
    size_t n;
    idem_tombstone t;
    idem_key_ref k = {"", PAY, "order-7"};
    /* request A: done, its result expired and swept: A's tombstone */
    cr_assert_eq(claim(st, k.key, 0xA, HORIZON, 1000, 50, &owner), IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(idem__store_complete_at(st, &k, owner, "", 0, t0 + 50, t0, 0), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(idem_store_sweep(st, now_ms() + 5000, 100, &n), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_tombstone_get(st, &k, &t), IDEM_OK, "no tombstone: %s", idem_errmsg());
    /* request B under the key, on an instance without a horizon: runs; its owner dies */
    cr_assert_eq(claim(st, k.key, 0xB, 0, 50, 50, NULL), IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(idem_store_sweep(st, now_ms() + 5000, 100, &n), IDEM_OK, "%s", idem_errmsg());
    idem_record rec;
    cr_assert_eq(idem_store_get(st, &k, &rec), IDEM_NOT_FOUND, "B's expired record not swept");
    /* B's retry on an instance with the horizon */
    idem_claim_outcome out = claim(st, k.key, 0xB, HORIZON, 1000, 1000, NULL);
    bool tomb = idem_store_tombstone_get(st, &k, &t) == IDEM_OK;
    tu_backend_close(&b);
    cr_expect_eq(out, IDEM_CLAIM_ACQUIRED,
                 "B's retry after its crash: outcome %d (%s), not ACQUIRED; A's tombstone %s",
                 (int)out, out == IDEM_CLAIM_MISMATCH ? "MISMATCH: key reused" : "?",
                 tomb ? "still there" : "gone");
}

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

/* A COMPLETED record at key, its result expiring at expires. */
static void completed(idem_store *st, const char *key, uint64_t t0, uint64_t expires)
{
    idem_claim_req req = {.key = {"", PAY, key},
                          .owner = 0,
                          .now_ms = t0,
                          .lease_until_ms = t0 + 100,
                          .expires_ms = expires};
    memset(req.fingerprint, 7, sizeof(req.fingerprint));
    idem_claim_outcome out;
    idem_record rec;
    cr_assert_eq(idem_store_claim(st, &req, &out, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(out, IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(idem__store_complete_at(st, &req.key, rec.owner, "", 0, expires, t0, 0), IDEM_OK,
                 "%s", idem_errmsg());
    idem_record_clear(&rec);
}

/* The server's sweeper (sweeper.c sweep_due): batches until one comes back short. */
static size_t sweep_due(idem_store *st, uint64_t now, size_t batch)
{
    size_t n, total = 0;
    do {
        cr_assert_eq(idem_store_sweep(st, now, batch, &n), IDEM_OK, "%s", idem_errmsg());
        total += n;
    } while (n == batch);
    return total;
}

/* docs/semantics.md "Tombstones": "a tombstone is deleted within a pass of that scan
 * after its horizon (N / (8 x batch) sweeps)". The scan's position was kept only in the
 * process (found by review on 9ce15c9): a process that opened the store started at the
 * first tombstone again. A server restarted (a deploy, a crash) before a pass ends, or
 * idemctl purge --expired (one process per purge), never reaches the due tombstones
 * after the first 8 x batch that are not due: they are never swept, and "tombs" grows.
 * Here 300 tombstones, 10 of them due, sweeper batch 1 (8 read per sweep): a pass is
 * 38 sweeps; 60 processes sweep once each. */
Test(tomb_store, lmdb_due_tombstones_are_swept_though_the_server_restarts_before_a_pass_ends)
{
    if (tu_backend_is_pg()) {
        cr_skip_test("LMDB's scan");
    }
    enum { DUE = 10, LATER = 290, KEEP = 100000, RESTARTS = 60, BATCH = 1 };
    char *dir;
    idem_store *st = tu_store_open("tomb_scan", &dir);
    cr_assert_eq(idem__store_tomb_keep(st, KEEP), IDEM_OK, "%s", idem_errmsg());
    const uint64_t t0 = now_ms();
    char key[16];
    for (int i = 0; i < DUE; i++) { /* expire first: due first */
        snprintf(key, sizeof(key), "a%d", i);
        completed(st, key, t0, t0 + 10);
    }
    for (int i = 0; i < LATER; i++) {
        snprintf(key, sizeof(key), "b%d", i);
        completed(st, key, t0, t0 + KEEP / 2);
    }
    sweep_due(st, t0 + 1000, 1000);            /* a*: tombstones until t0 + 10 + KEEP */
    sweep_due(st, t0 + KEEP / 2 + 1000, 1000); /* b*: until t0 + KEEP / 2 + KEEP */
    idem_store_stats s;
    cr_assert_eq(idem_store_stats_get(st, &s), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(s.tombstones, DUE + LATER, "%zu tombstones", s.tombstones);
    idem_store_close(st);

    const uint64_t at = t0 + KEEP + 1000; /* the a* are past their until, the b* are not */
    size_t swept = 0;
    bool restart = getenv("TOMB_STORE_NO_RESTART") == NULL; /* set: the control, one process */
    if (!restart) {
        cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NOSYNC), IDEM_OK);
    }
    for (int r = 0; r < RESTARTS; r++) { /* the server starts, sweeps, is restarted */
        if (restart) {
            cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NOSYNC), IDEM_OK, "%s",
                         idem_errmsg());
        }
        swept += sweep_due(st, at, BATCH);
        if (restart) {
            idem_store_close(st);
        }
    }
    if (!restart) {
        idem_store_close(st);
    }
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NOSYNC), IDEM_OK, "%s",
                 idem_errmsg());
    int left = 0;
    for (int i = 0; i < DUE; i++) {
        idem_tombstone t;
        snprintf(key, sizeof(key), "a%d", i);
        left += idem_store_tombstone_get(st, &(idem_key_ref){"", PAY, key}, &t) == IDEM_OK;
    }
    idem_store_close(st);
    tu_rmtree(dir);
    cr_expect_eq(left, 0,
                 "%d of %d tombstones past their until were never swept by %d sweeps (one per "
                 "process; %zu swept): a pass is %d sweeps",
                 left, DUE, RESTARTS, swept, (DUE + LATER) / (8 * BATCH));
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

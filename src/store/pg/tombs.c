/* Tombstones on PostgreSQL (docs/semantics.md "Tombstones"): idem_tombstones(caller,
 * method, key) PRIMARY KEY, the first 16 bytes of the request's fingerprint, the
 * outcome's code, first_at, expired_at and until (unix ms, the database's clock).
 *
 * Invariants (as on LMDB, src/store/lmdb/tombs.c):
 *   - the sweep turns an expired COMPLETED record into its tombstone in the statement
 *     that deletes the record (S_SWEEP_RECORDS), kept for the longest horizon of the
 *     servers on the store (idem_meta "tomb_keep", which only grows);
 *   - a claim with a horizon that inserted the key's row reads the key's tombstone in
 *     the claim's transaction: within the horizon the tombstone answers and the row is
 *     deleted again; past it the tombstone is deleted and the claim acquires. The
 *     insert holds the key, so no sweep writes the key's tombstone before the claim
 *     commits, and a sweep that committed before the insert is seen by the read after it
 *     (READ COMMITTED: a snapshot per statement). A claim without a horizon reads no
 *     tombstone (no round trip where they are off) and deletes the key's in the
 *     statement that draws its fence (S_CLAIM_FENCE), as LMDB does: a key has a record
 *     or a tombstone, never both (else an earlier request's tombstone would refuse this
 *     one's retry as "key reused" once its record is gone);
 *   - an expired COMPLETED record the sweep has not reached answers as its tombstone
 *     (claim.c). */
#include <stdio.h>
#include <string.h>

#include "pg_internal.h"

#define TOMB_PAGE 500 /* S_TOMB_PAGE's LIMIT */

/* The tombstone in TOMB_COLS at column off of row. */
static idem_code row_tomb(const PGresult *r, int row, int off, idem_tombstone *t)
{
    if (PQgetlength(r, row, off) != IDEM_TOMBSTONE_FP_LEN) {
        return idem__err(IDEM_DATA_LOSS, "tombstone has an unknown format");
    }
    memcpy(t->fingerprint, PQgetvalue(r, row, off), IDEM_TOMBSTONE_FP_LEN);
    const unsigned char *c = (const unsigned char *)PQgetvalue(r, row, off + 1);
    t->code = PQgetlength(r, row, off + 1) == 2 ? (idem_code)(c[0] << 8 | c[1]) : IDEM_UNKNOWN;
    t->first_at_ms = (uint64_t)idem__pg_col_i64(r, row, off + 2);
    t->expired_at_ms = (uint64_t)idem__pg_col_i64(r, row, off + 3);
    t->until_ms = (uint64_t)idem__pg_col_i64(r, row, off + 4);
    return IDEM_OK;
}

/* The claim's answer from the key's tombstone, on a row this claim just inserted
 * (*decided: the row is deleted again), at the database's time now_ms. */
idem_code idem__pg_tomb_claim(pool_slot *c, const idem_claim_req *req, uint64_t now_ms,
                              idem_claim_outcome *outcome, idem_record *rec, bool *decided)
{
    pg_args a = {0};
    idem_code code;
    idem_tombstone t;
    *decided = false;
    arg_key(&a, &req->key);
    PGresult *r = idem__pg_exec(c, S_TOMB_GET, &a, PGRES_TUPLES_OK, &code);
    if (r == NULL) {
        return code;
    }
    code = PQntuples(r) == 1 ? row_tomb(r, 0, 0, &t) : IDEM_NOT_FOUND;
    PQclear(r);
    if (code != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    if (!idem__tomb_decides(&t, req, now_ms)) {
        return idem__pg_run(c, S_TOMB_DEL, &a, PGRES_COMMAND_OK); /* stale: the key is free */
    }
    *decided = true;
    idem__tomb_answer(&t, req, outcome, rec);
    return idem__pg_run(c, S_CLAIM_UNDO, &a, PGRES_COMMAND_OK);
}

/* Kept in idem_meta, so that every instance's sweep (idemctl's too) keeps that long. */
idem_code idem__pg_tomb_keep(idem_store *base, uint64_t keep_ms)
{
    pg_args a = {0};
    if (keep_ms == 0) {
        return IDEM_OK;
    }
    arg_i64(&a, keep_ms > INT64_MAX ? INT64_MAX : keep_ms);
    return idem__pg_exec_pooled((pg_store *)base, S_TOMB_KEEP, &a, PGRES_COMMAND_OK, NULL);
}

idem_code idem__pg_tomb_get(idem_store *base, const idem_key_ref *key, idem_tombstone *out)
{
    pg_args a = {0};
    PGresult *r;
    arg_key(&a, key);
    idem_code code = idem__pg_exec_pooled((pg_store *)base, S_TOMB_GET, &a, PGRES_TUPLES_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    code = PQntuples(r) == 1 ? row_tomb(r, 0, 0, out) : idem__err(IDEM_NOT_FOUND, "no tombstone");
    PQclear(r);
    return code;
}

idem_code idem__pg_tomb_del(idem_store *base, const idem_key_ref *key)
{
    pg_args a = {0};
    arg_key(&a, key);
    return idem__pg_exec_one_row((pg_store *)base, S_TOMB_DEL, &a, IDEM_NOT_FOUND, "no tombstone");
}

/* Pages through the tombstones in key order (keyset pagination, 500 per query). */
idem_code idem__pg_tomb_foreach(idem_store *base, idem_tombstone_visit_fn fn, void *arg)
{
    char caller[IDEM_MAX_CALLER + 1] = "", method[IDEM_MAX_METHOD + 1] = "",
                                  key[IDEM_MAX_KEY + 1] = "";
    for (bool go_on = true; go_on;) {
        pg_args a = {0};
        PGresult *r;
        arg_key(&a, &(idem_key_ref){caller, method, key});
        idem_code code =
            idem__pg_exec_pooled((pg_store *)base, S_TOMB_PAGE, &a, PGRES_TUPLES_OK, &r);
        if (code != IDEM_OK) {
            return code;
        }
        int n = PQntuples(r);
        go_on = n == TOMB_PAGE;
        for (int i = 0; i < n; i++) {
            idem_tombstone t;
            snprintf(caller, sizeof(caller), "%s", PQgetvalue(r, i, 0));
            snprintf(method, sizeof(method), "%s", PQgetvalue(r, i, 1));
            snprintf(key, sizeof(key), "%s", PQgetvalue(r, i, 2));
            if (row_tomb(r, i, 3, &t) == IDEM_OK &&
                !fn(arg, &(idem_key_ref){caller, method, key}, NULL, &t)) {
                PQclear(r);
                return IDEM_OK;
            }
        }
        PQclear(r);
    }
    return IDEM_OK;
}

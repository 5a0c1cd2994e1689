/* Lease renewals on PostgreSQL: a live owner keeps its claim.
 *
 * The lease keeper (src/dispatch/keeper.c) renews every due lease of the process in one
 * round: S_RENEW_BATCH takes the leases as five array parameters and renews, in one
 * statement, each row still IN_PROGRESS under its owner that no other session holds
 * (FOR UPDATE SKIP LOCKED: a stalled claimer on another instance holding one row delays
 * no other lease). The round's answer is bounded by half the shortest lease; its
 * connection, when one must be made, by one attempt as long as a statement (connect.c:
 * the host that answered last first, a hung one cut short). A row not renewed is
 * answered per lease: IDEM_UNAVAILABLE (held, or no answer: tried again soon) or
 * IDEM_ABORTED (no longer this owner's). */
#include <stdio.h>
#include <stdlib.h>

#include "pg_internal.h"

#define CLAIM_LOST "claim lost: the record is gone or owned by another claim"

idem_code idem__pg_renew(idem_store *base, const idem_key_ref *key, uint64_t owner,
                         uint64_t lease_until_ms, uint64_t now_ms)
{
    pg_args a = {0};
    arg_key(&a, key);
    arg_i64(&a, owner);
    arg_i64(&a, lease_until_ms - now_ms);
    return idem__pg_exec_one_row((pg_store *)base, S_RENEW, &a, IDEM_ABORTED, CLAIM_LOST);
}

/* Writes x as a quoted element of an array literal. */
static void array_put(FILE *f, bool first, const char *x)
{
    fputs(first ? "{\"" : ",\"", f);
    for (; *x != '\0'; x++) {
        if (*x == '"' || *x == '\\') {
            fputc('\\', f);
        }
        fputc(*x, f);
    }
    fputc('"', f);
}

/* The five array literals of S_RENEW_BATCH for r[0..n), malloc'd into col. */
static bool renew_arrays(char *col[5], const idem__renewal *r, size_t n)
{
    size_t len[5];
    FILE *f[5];
    bool ok = true;
    for (int c = 0; c < 5; c++) {
        ok = (f[c] = open_memstream(&col[c], &len[c])) != NULL && ok;
    }
    for (size_t i = 0; ok && i < n; i++) {
        char owner[24], lease[24];
        snprintf(owner, sizeof(owner), "%lld", (long long)r[i].owner);
        snprintf(lease, sizeof(lease), "%lld", (long long)(r[i].lease_until_ms - r[i].now_ms));
        array_put(f[0], i == 0, r[i].key.caller != NULL ? r[i].key.caller : "");
        array_put(f[1], i == 0, r[i].key.method);
        array_put(f[2], i == 0, r[i].key.key);
        array_put(f[3], i == 0, owner);
        array_put(f[4], i == 0, lease);
    }
    for (int c = 0; c < 5; c++) {
        if (f[c] != NULL) {
            fputc('}', f[c]);
            ok = fclose(f[c]) == 0 && ok;
        }
    }
    return ok;
}

/* One round trip, its answer bounded by half the shortest lease (a renewal later than
 * that is of little use): rows another session holds are skipped and tried again next
 * round. */
idem_code idem__pg_renew_batch(idem_store *base, idem__renewal *r, size_t n)
{
    pg_store *st = (pg_store *)base;
    char *col[5] = {0};
    pg_args a = {0};
    uint64_t shortest = UINT64_MAX;
    for (size_t i = 0; i < n; i++) {
        uint64_t lease = r[i].lease_until_ms - r[i].now_ms;
        shortest = lease < shortest ? lease : shortest;
        r[i].code = IDEM_ABORTED; /* unless the answer has the row */
    }
    idem_code code =
        renew_arrays(col, r, n) ? IDEM_OK : idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    for (int c = 0; c < 5; c++) {
        arg_text(&a, col[c] != NULL ? col[c] : "{}");
    }
    pool_slot *pc;
    PGresult *res = NULL;
    uint32_t bound = shortest / 2 < st->stmt_ms ? (uint32_t)(shortest / 2) + 1 : st->stmt_ms;
    if (code == IDEM_OK) { /* its own connection: handlers may hold every pooled one */
        if ((code = idem__pg_renew_slot_get(st, bound, &pc)) == IDEM_OK) {
            res = idem__pg_exec(pc, S_RENEW_BATCH, &a, PGRES_TUPLES_OK, &code);
        }
        idem__pg_renew_slot_put(st, pc);
    }
    for (int c = 0; c < 5; c++) {
        free(col[c]);
    }
    for (size_t i = 0; code != IDEM_OK && i < n; i++) {
        r[i].code = code; /* not tried, or no answer: not renewed this time */
    }
    for (int row = 0; res != NULL && row < PQntuples(res); row++) {
        int64_t i = idem__pg_col_i64(res, row, 0) - 1;
        if (i >= 0 && (size_t)i < n) {
            r[i].code = *PQgetvalue(res, row, 1) ? IDEM_OK : IDEM_UNAVAILABLE;
        }
    }
    PQclear(res);
    return IDEM_OK;
}

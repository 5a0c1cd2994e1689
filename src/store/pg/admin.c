/* What the sweeper and operators ask of the PostgreSQL store: the sweep of expired rows
 * (records, tokens, then tombstones) in bounded batches that never wait for a live
 * transaction's rows, the counts, and a
 * walk over the records (keyset pagination). */
#include <stdio.h>
#include <stdlib.h>

#include "pg_internal.h"

#define FOREACH_PAGE 500

/* S_SWEEP_KV takes only the limit. */
static idem_code sweep_table(pg_store *st, enum stmt s, uint64_t now_ms, size_t max,
                             size_t *deleted)
{
    pg_args a = {0};
    PGresult *r;
    if (s != S_SWEEP_KV) {
        arg_i64(&a, now_ms - idem__now_ms()); /* a shift of the database clock */
    }
    arg_i64(&a, max);
    bool counted = s == S_SWEEP_RECORDS; /* it answers its count (its CTE writes more) */
    idem_code code =
        idem__pg_exec_pooled(st, s, &a, counted ? PGRES_TUPLES_OK : PGRES_COMMAND_OK, &r);
    if (code == IDEM_OK) {
        *deleted += counted ? (PQntuples(r) == 1 ? (size_t)idem__pg_col_i64(r, 0, 0) : 0)
                            : strtoul(PQcmdTuples(r), NULL, 10);
        PQclear(r);
    }
    return code;
}

idem_code idem__pg_sweep(idem_store *base, uint64_t now_ms, size_t max, size_t *deleted)
{
    pg_store *st = (pg_store *)base;
    idem_code code = sweep_table(st, S_SWEEP_RECORDS, now_ms, max, deleted);
    if (code == IDEM_OK && *deleted < max) {
        code = sweep_table(st, S_SWEEP_TOKENS, now_ms, max - *deleted, deleted);
    }
    if (code == IDEM_OK && *deleted < max) {
        code = sweep_table(st, S_SWEEP_TOMBS, now_ms, max - *deleted, deleted);
    }
    if (code == IDEM_OK && *deleted < max) {
        size_t empty = 0; /* not records or tokens: not counted */
        code = sweep_table(st, S_SWEEP_KV, now_ms, max - *deleted, &empty);
    }
    return code;
}

idem_code idem__pg_stats(idem_store *base, idem_store_stats *out)
{
    PGresult *r;
    idem_code code = idem__pg_exec_pooled((pg_store *)base, S_STATS, NULL, PGRES_TUPLES_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    if (PQntuples(r) == 1) {
        out->records = (size_t)idem__pg_col_i64(r, 0, 0);
        out->in_progress = (size_t)idem__pg_col_i64(r, 0, 1);
        out->completed = (size_t)idem__pg_col_i64(r, 0, 2);
        out->tokens = (size_t)idem__pg_col_i64(r, 0, 3);
        out->tombstones = (size_t)idem__pg_col_i64(r, 0, 4);
    }
    out->reconnects = __atomic_load_n(&((pg_store *)base)->reconnects, __ATOMIC_RELAXED);
    PQclear(r);
    return IDEM_OK;
}

/* Pages through the records in key order (keyset pagination, 500 per query). */
idem_code idem__pg_foreach(idem_store *base, idem_store_visit_fn fn, void *arg)
{
    char caller[IDEM_MAX_CALLER + 1] = "", method[IDEM_MAX_METHOD + 1] = "",
                                  key[IDEM_MAX_KEY + 1] = "";
    for (;;) {
        pg_args a = {0};
        PGresult *r;
        arg_key(&a, &(idem_key_ref){caller, method, key});
        idem_code code = idem__pg_exec_pooled((pg_store *)base, S_PAGE, &a, PGRES_TUPLES_OK, &r);
        if (code != IDEM_OK) {
            return code;
        }
        int n = PQntuples(r);
        bool go_on = n == FOREACH_PAGE;
        for (int i = 0; i < n; i++) {
            idem_record rec;
            snprintf(caller, sizeof(caller), "%s", PQgetvalue(r, i, 0));
            snprintf(method, sizeof(method), "%s", PQgetvalue(r, i, 1));
            snprintf(key, sizeof(key), "%s", PQgetvalue(r, i, 2));
            if (idem__pg_row_record(r, i, 3, &rec, false) == IDEM_OK &&
                !fn(arg, &(idem_key_ref){caller, method, key}, &rec)) {
                PQclear(r);
                return IDEM_OK;
            }
        }
        PQclear(r);
        if (!go_on) {
            return IDEM_OK;
        }
    }
}

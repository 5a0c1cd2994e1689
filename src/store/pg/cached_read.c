/* The PostgreSQL store's record read and forget, with its replay cache
 * (replay_cache.h): a read answered locally when the cache holds the COMPLETED record,
 * the cache filled by the reads that find one, and a forget that drops the key here and
 * announces itself so that other instances drop it too. */
#include "pg_internal.h"

idem_code idem__pg_delete(idem_store *base, const idem_key_ref *key)
{
    pg_store *st = (pg_store *)base;
    pg_args a = {0};
    PGresult *r;
    arg_key(&a, key);
    arg_announce(&a, st, key);
    idem_code code = idem__pg_exec_pooled(st, S_DELETE, &a, PGRES_TUPLES_OK, &r);
    idem__pg_rcache_drop_hash(st->rcache, idem__key_hash(key)); /* whatever the outcome */
    if (code != IDEM_OK) {
        return code;
    }
    bool deleted = PQntuples(r) == 1 && idem__pg_col_i64(r, 0, 0) == 1;
    PQclear(r);
    return deleted ? IDEM_OK : idem__err(IDEM_NOT_FOUND, "no record");
}

/* A COMPLETED record the replay cache holds is answered without a round trip. */
idem_code idem__pg_get(idem_store *base, const idem_key_ref *key, idem_record *rec)
{
    pg_store *st = (pg_store *)base;
    pg_args a = {0};
    PGresult *r;
    pg_rcache_miss miss = {0};
    if (idem__pg_rcache_get(st->rcache, key, rec, &miss)) {
        return IDEM_OK;
    }
    arg_key(&a, key);
    idem_code code = idem__pg_exec_pooled(st, S_GET, &a, PGRES_TUPLES_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    code = PQntuples(r) == 1 ? idem__pg_row_record(r, 0, 0, rec, true)
                             : idem__err(IDEM_NOT_FOUND, "no record");
    PQclear(r);
    if (code == IDEM_OK) {
        idem__pg_rcache_put(st->rcache, key, rec, &miss);
    }
    return code;
}

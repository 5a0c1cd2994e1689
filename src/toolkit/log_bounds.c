/* The bounds of an append-only log kept in a business database (the consume dedupe's
 * expiry log, consume.c; the outbox, outbox.c): key 'q' → be64 head ‖ be64 next, head
 * the oldest entry that may still be there, next the sequence number the next append
 * takes. Absent: an empty log at 0. The _at variants keep a second log's bounds under
 * another one-byte key of the same database (the outbox's kept log, outbox_kept.c). */
#include <stdlib.h>

#include "toolkit_internal.h"

static const uint8_t BOUNDS_KEY[1] = {'q'};

idem_code idem__log_bounds_decode(const char *db, const void *v, size_t n, uint64_t *head,
                                  uint64_t *next)
{
    if (n != 16) {
        return idem__err(IDEM_DATA_LOSS, "%s: bad log bounds", db);
    }
    *head = idem__get_be64(v);
    *next = idem__get_be64((const uint8_t *)v + 8);
    return IDEM_OK;
}

idem_code idem__log_bounds_get(idem_txn *t, const char *db, uint64_t *head, uint64_t *next)
{
    return idem__log_bounds_get_at(t, db, BOUNDS_KEY[0], head, next);
}

idem_code idem__log_bounds_get_at(idem_txn *t, const char *db, uint8_t key, uint64_t *head,
                                  uint64_t *next)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, db, &key, 1, &v, &n);
    *head = *next = 0;
    if (code == IDEM_NOT_FOUND) {
        return IDEM_OK;
    }
    return code != IDEM_OK ? code : idem__log_bounds_decode(db, v, n, head, next);
}

idem_code idem__log_bounds_read(idem_store *st, const char *db, uint64_t *head, uint64_t *next)
{
    return idem__log_bounds_read_at(st, db, BOUNDS_KEY[0], head, next);
}

idem_code idem__log_bounds_read_at(idem_store *st, const char *db, uint8_t key, uint64_t *head,
                                   uint64_t *next)
{
    void *v;
    size_t n;
    idem_code code = idem_store_app_get(st, db, &key, 1, &v, &n);
    *head = *next = 0;
    if (code == IDEM_NOT_FOUND) {
        return IDEM_OK;
    }
    if (code == IDEM_OK) {
        code = idem__log_bounds_decode(db, v, n, head, next);
        free(v);
    }
    return code;
}

idem_code idem__log_bounds_put(idem_txn *t, const char *db, uint64_t head, uint64_t next)
{
    return idem__log_bounds_put_at(t, db, BOUNDS_KEY[0], head, next);
}

idem_code idem__log_bounds_put_at(idem_txn *t, const char *db, uint8_t key, uint64_t head,
                                  uint64_t next)
{
    uint8_t v[16];
    idem__put_be64(v, head);
    idem__put_be64(v + 8, next);
    return idem_txn_put(t, db, &key, 1, v, sizeof(v));
}

/* The fence counter: the store-assigned owners of claims. It lives in the meta database
 * and only grows, in the claim's own write txn, so a fence is drawn once and never held
 * by two claims; st->fence_floor keeps a fence a failed batch's redo tried from being
 * drawn again. */
#include <stdatomic.h>

#include "lmdb_internal.h"

/* The store-assigned owners' counter in txn: *last the last one handed out (0: none). */
static idem_code fence_last(lmdb_store *st, MDB_txn *txn, uint64_t *last)
{
    MDB_val k = {5, "fence"}, v;
    int rc = mdb_get(txn, st->meta, &k, &v);
    *last = rc == 0 && v.mv_size == 8 ? idem__get_be64(v.mv_data) : 0;
    return rc == 0 || rc == MDB_NOTFOUND ? IDEM_OK : idem__lmdb_code(rc, "fence get");
}

static idem_code fence_put(lmdb_store *st, MDB_txn *txn, uint64_t value)
{
    MDB_val k = {5, "fence"}, v;
    uint8_t b[8];
    idem__put_be64(b, value);
    v = (MDB_val){8, b};
    int rc = mdb_put(txn, st->meta, &k, &v, 0);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "fence put");
}

/* The next store-assigned owner: a counter that only grows, in the claim's txn, and
 * past any fence a redo of this process tried (fence_floor): a fence drawn in a batch
 * whose commit and redo failed is not drawn again here. The store has "meta" (the
 * claim checks that before its first write). */
idem_code idem__lmdb_next_fence(lmdb_store *st, MDB_txn *txn, uint64_t *out)
{
    uint64_t last, floor = atomic_load(&st->fence_floor);
    idem_code code;
    if ((code = fence_last(st, txn, &last)) != IDEM_OK) {
        return code;
    }
    *out = (last > floor ? last : floor) + 1;
    return fence_put(st, txn, *out);
}

/* The counter moved to owner: a shared claim re-applied with the owner it drew in a
 * batch that failed (that draw was rolled back with it). The counter already at owner
 * or past it means another writer drew owner (or a later fence) between the failed
 * commit and this redo: owner may be that writer's now, and a fence is never held by
 * two claims, so the claim is lost (ABORTED) instead. */
idem_code idem__lmdb_fence_redraw(lmdb_store *st, MDB_txn *txn, uint64_t owner)
{
    uint64_t last, floor = atomic_load(&st->fence_floor);
    while (floor < owner && !atomic_compare_exchange_weak(&st->fence_floor, &floor, owner)) {
    }
    idem_code code = fence_last(st, txn, &last);
    if (code != IDEM_OK) {
        return code;
    }
    if (last >= owner) {
        return idem__err(IDEM_ABORTED, "claim lost: its fence was drawn again while its "
                                       "failed batch was re-run");
    }
    return fence_put(st, txn, owner);
}

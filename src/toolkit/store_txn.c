/* idem_store_run_txn: a business write transaction outside an RPC call. */
#include "store.h"

#include "idemrpc/toolkit.h"

idem_code idem_store_run_txn(idem_store *st, idem_txn_fn fn, void *arg)
{
    idem_txn *t;
    idem_code code;
    if (st == NULL || fn == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "store txn needs a store and a function");
    }
    if ((code = idem__store_txn_begin(st, &t)) != IDEM_OK) {
        return code;
    }
    if ((code = fn(t, arg)) != IDEM_OK) {
        idem__store_txn_abort(t); /* none of fn's writes remain */
        return code;
    }
    return idem__store_txn_commit(t);
}

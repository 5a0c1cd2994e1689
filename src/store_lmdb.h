/* LMDB-specific internals of idem_store, for the transactional handler API. */
#ifndef IDEMRPC_STORE_LMDB_H
#define IDEMRPC_STORE_LMDB_H

#include <lmdb.h>

#include "internal.h"

#define IDEM_LMDB_MAX_DBS 32

MDB_env *idem__store_lmdb_env(idem_store *st);

/* IN_PROGRESS(owner) → COMPLETED inside the caller's write txn. */
idem_code idem__store_complete_txn(idem_store *st, MDB_txn *txn, const idem_key_ref *ref,
                                   uint64_t owner, const void *response, size_t len,
                                   uint64_t expires_ms);

#endif

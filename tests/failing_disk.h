/* A disk that fails on demand, for the programs that link failing_disk.c: fdatasync(2)
 * of a store's data.mdb, as LMDB calls it, answers EIO the next failing_syncs times (a
 * disk error at commit), then syncs again; of its write-ahead log (wal.log), the next
 * failing_log_syncs times. The program's definition wins over libc's for liblmdb. */
#ifndef IDEMRPC_TEST_FAILING_DISK_H
#define IDEMRPC_TEST_FAILING_DISK_H

#include <lmdb.h>
#include <stdatomic.h>

#include "internal.h"

extern atomic_int failing_syncs, failing_log_syncs;

/* A group-commit write (idem_write_fn) that puts key "x" in the main db: a commit
 * without a write would not sync, nor fail. ctx unused. */
idem_code failing_disk_put_x(MDB_txn *txn, void *ctx);

#endif

/* See failing_disk.h. */
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "failing_disk.h"

atomic_int failing_syncs;

int fdatasync(int fd)
{
    int left = atomic_load(&failing_syncs);
    while (left > 0 && !atomic_compare_exchange_weak(&failing_syncs, &left, left - 1)) {
    }
    if (left > 0) {
        errno = EIO;
        return -1;
    }
    return (int)syscall(SYS_fdatasync, fd);
}

idem_code failing_disk_put_x(MDB_txn *txn, void *ctx)
{
    (void)ctx;
    MDB_dbi dbi;
    MDB_val k = {1, "x"}, v = {1, "1"};
    int rc = mdb_dbi_open(txn, NULL, 0, &dbi);
    return rc == 0 && mdb_put(txn, dbi, &k, &v, 0) == 0 ? IDEM_OK
                                                        : idem__err(IDEM_INTERNAL, "put x");
}

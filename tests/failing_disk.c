/* See failing_disk.h. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "failing_disk.h"

atomic_int failing_syncs, failing_log_syncs;

/* fd's path ends with name. */
static bool fd_is(int fd, const char *name)
{
    char link[64], path[4096];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof(path) - 1);
    size_t len = strlen(name);
    return n >= (ssize_t)len && memcmp(path + n - len, name, len) == 0;
}

/* Takes one of *left's failures, if any is left. */
static bool take(atomic_int *left)
{
    int n = atomic_load(left);
    while (n > 0 && !atomic_compare_exchange_weak(left, &n, n - 1)) {
    }
    return n > 0;
}

int fdatasync(int fd)
{
    if ((atomic_load(&failing_syncs) > 0 && fd_is(fd, "/data.mdb") && take(&failing_syncs)) ||
        (atomic_load(&failing_log_syncs) > 0 && fd_is(fd, "/wal.log") &&
         take(&failing_log_syncs))) {
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

/* See power_cut.h. The program's definitions of pwrite, write, writev, fdatasync and fsync
 * win over libc's for liblmdb (ELF interposition); they reach the kernel by syscall. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "power_cut.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int log_fd = -1;
static const char *data_path;
static const char *plan = ""; /* guarded by mu */
void (*_Atomic power_cut_before_sync)(void);

static void init(void)
{
    const char *log = getenv("IDEMRPC_UNDO_LOG");
    data_path = getenv("IDEMRPC_UNDO_DATA");
    if (log != NULL && data_path != NULL) {
        log_fd = (int)syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_CREAT | O_APPEND, 0600);
    }
}

void power_cut_record(const char *log, const char *data)
{
    pthread_once(&once, init); /* so that it cannot run later and undo this */
    pthread_mutex_lock(&mu);
    if (log_fd >= 0) {
        syscall(SYS_close, log_fd);
    }
    data_path = data;
    log_fd = log == NULL
                 ? -1
                 : (int)syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_CREAT | O_APPEND, 0600);
    pthread_mutex_unlock(&mu);
}

static int write_all(int fd, const void *p, size_t n)
{
    for (size_t done = 0; done < n;) {
        ssize_t w = syscall(SYS_write, fd, (const char *)p + done, n - done);
        if (w <= 0) {
            return -1;
        }
        done += (size_t)w;
    }
    return 0;
}

/* Logs that the process wrote to path, a file of the store's directory that is not the
 * data file (mu held): the recorder cannot undo it, so the cut must refuse to pass. */
static void log_other(const char *path)
{
    undo_rec r = {POWER_CUT_OTHER, 0, strlen(path), 0};
    if (write_all(log_fd, &r, sizeof(r)) != 0 || write_all(log_fd, path, r.len) != 0) {
        _exit(97);
    }
}

/* path (fd's) is in the data file's directory. */
static bool in_store_dir(const char *path)
{
    const char *slash = strrchr(data_path, '/');
    size_t n = slash != NULL ? (size_t)(slash - data_path) + 1 : 0;
    return n > 0 && strncmp(path, data_path, n) == 0 && strchr(path + n, '/') == NULL;
}

/* fd is the data file, written without O_DSYNC. A write through fd to another file of
 * the store's directory is logged as one the cut cannot undo (log_other). */
static bool logged_fd(int fd)
{
    struct stat a, b;
    pthread_once(&once, init);
    if (log_fd < 0 || fstat(fd, &a) != 0 || !S_ISREG(a.st_mode) || stat(data_path, &b) != 0) {
        return false;
    }
    if (a.st_ino == b.st_ino && a.st_dev == b.st_dev) {
        return !(fcntl(fd, F_GETFL) & O_DSYNC);
    }
    char link[64], path[4096];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof(path) - 1);
    path[n > 0 ? n : 0] = '\0';
    if (n > 0 && in_store_dir(path)) {
        pthread_mutex_lock(&mu);
        log_other(path);
        pthread_mutex_unlock(&mu);
    }
    return false;
}

/* Logs the bytes [off, off + n) of fd's file before they are overwritten (mu held).
 * Exits the process when it cannot: a write it could not undo would void the test. */
static void log_preimage(int fd, uint64_t off, uint64_t n)
{
    struct stat st;
    if (fstat(fd, &st) != 0) {
        _exit(97);
    }
    uint64_t size = (uint64_t)st.st_size;
    uint64_t have = off >= size ? 0 : (off + n > size ? size - off : n);
    undo_rec r = {POWER_CUT_WRITE, off, have, size};
    char *buf = malloc(have + 1);
    if (buf == NULL || (have > 0 && pread(fd, buf, have, (off_t)off) != (ssize_t)have)) {
        _exit(97);
    }
    /* One write: a SIGKILL leaves the record whole or absent (a regular file). */
    char *rec = malloc(sizeof(r) + have);
    if (rec == NULL) {
        _exit(97);
    }
    memcpy(rec, &r, sizeof(r));
    memcpy(rec + sizeof(r), buf, have);
    if (write_all(log_fd, rec, sizeof(r) + have) != 0) {
        _exit(97);
    }
    free(rec);
    free(buf);
}

/* liblmdb binds "pwrite"; a program built with _FILE_OFFSET_BITS=64 names it pwrite64. */
ssize_t pwrite_recorded(int fd, const void *buf, size_t n, off_t off) __asm__("pwrite");
ssize_t pwrite_recorded(int fd, const void *buf, size_t n, off_t off)
{
    if (!logged_fd(fd)) {
        return syscall(SYS_pwrite64, fd, buf, n, off);
    }
    pthread_mutex_lock(&mu);
    log_preimage(fd, (uint64_t)off, n);
    ssize_t rc = syscall(SYS_pwrite64, fd, buf, n, off);
    pthread_mutex_unlock(&mu);
    return rc;
}

ssize_t pwrite64_recorded(int fd, const void *buf, size_t n, off_t off) __asm__("pwrite64");
ssize_t pwrite64_recorded(int fd, const void *buf, size_t n, off_t off)
{
    return pwrite_recorded(fd, buf, n, off);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    if (!logged_fd(fd)) {
        return syscall(SYS_writev, fd, iov, cnt);
    }
    size_t n = 0;
    for (int i = 0; i < cnt; i++) {
        n += iov[i].iov_len;
    }
    pthread_mutex_lock(&mu);
    log_preimage(fd, (uint64_t)lseek(fd, 0, SEEK_CUR), n);
    ssize_t rc = syscall(SYS_writev, fd, iov, cnt);
    pthread_mutex_unlock(&mu);
    return rc;
}

ssize_t write(int fd, const void *buf, size_t n)
{
    if (!logged_fd(fd)) {
        return syscall(SYS_write, fd, buf, n);
    }
    pthread_mutex_lock(&mu);
    log_preimage(fd, (uint64_t)lseek(fd, 0, SEEK_CUR), n);
    ssize_t rc = syscall(SYS_write, fd, buf, n);
    pthread_mutex_unlock(&mu);
    return rc;
}

void power_cut_plan(const char *p)
{
    pthread_mutex_lock(&mu);
    plan = p;
    pthread_mutex_unlock(&mu);
}

size_t power_cut_plan_left(void)
{
    pthread_mutex_lock(&mu);
    size_t n = strlen(plan);
    pthread_mutex_unlock(&mu);
    return n;
}

/* A sync of the data file marks what was logged before it began as on disk, or, when it
 * fails (its step of the plan), as lost. */
static int synced(int fd, long nr)
{
    if (!logged_fd(fd)) {
        return (int)syscall(nr, fd);
    }
    void (*hook)(void) = atomic_load(&power_cut_before_sync);
    if (hook != NULL) {
        hook();
    }
    pthread_mutex_lock(&mu);
    off_t before = lseek(log_fd, 0, SEEK_END);
    bool fail = *plan == 'f';
    plan += *plan != '\0';
    pthread_mutex_unlock(&mu);
    int rc = fail ? -1 : (int)syscall(nr, fd);
    if (rc == 0 || fail) {
        undo_rec r = {fail ? POWER_CUT_FAILED : POWER_CUT_SYNC, (uint64_t)before, 0, 0};
        pthread_mutex_lock(&mu);
        if (write_all(log_fd, &r, sizeof(r)) != 0) {
            _exit(97);
        }
        pthread_mutex_unlock(&mu);
    }
    if (fail) {
        errno = EIO;
    }
    return rc;
}

int fdatasync(int fd)
{
    return synced(fd, SYS_fdatasync);
}

int fsync(int fd)
{
    return synced(fd, SYS_fsync);
}

/* See power_cut.h. The program's definitions of pwrite, write, writev, ftruncate, fallocate,
 * fdatasync and fsync win over libc's for liblmdb (ELF interposition); they reach the kernel by
 * syscall. */
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
static char wal_path[4096];   /* wal.log in data_path's directory */
static const char *plan = ""; /* guarded by mu */
void (*_Atomic power_cut_before_sync)(void);

/* Sets data_path and wal_path (mu held, or before any thread: init). */
static void set_data(const char *data)
{
    data_path = data;
    power_cut_wal_path(data != NULL ? data : "", wal_path, sizeof(wal_path));
}

static int open_log(const char *log)
{
    return (int)syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_CREAT | O_APPEND, 0600);
}

static void init(void)
{
    const char *log = getenv("IDEMRPC_UNDO_LOG");
    set_data(getenv("IDEMRPC_UNDO_DATA"));
    if (log != NULL && data_path != NULL) {
        log_fd = open_log(log);
    }
}

void power_cut_record(const char *log, const char *data)
{
    pthread_once(&once, init); /* so that it cannot run later and undo this */
    pthread_mutex_lock(&mu);
    if (log_fd >= 0) {
        syscall(SYS_close, log_fd);
    }
    set_data(data);
    log_fd = log == NULL ? -1 : open_log(log);
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

/* Logs that the process changed path, a file of the store's directory, in a way the cut
 * cannot undo (mu held): the cut must refuse to pass. */
static void log_other(const char *path)
{
    undo_rec r = {POWER_CUT_OTHER, 0, 0, strlen(path), 0, 0};
    if (write_all(log_fd, &r, sizeof(r)) != 0 || write_all(log_fd, path, r.len) != 0) {
        _exit(97);
    }
}

static void log_other_locked(const char *path)
{
    pthread_mutex_lock(&mu);
    log_other(path);
    pthread_mutex_unlock(&mu);
}

/* path (fd's) is in the data file's directory. */
static bool in_store_dir(const char *path)
{
    const char *slash = strrchr(data_path, '/');
    size_t n = slash != NULL ? (size_t)(slash - data_path) + 1 : 0;
    return n > 0 && strncmp(path, data_path, n) == 0 && strchr(path + n, '/') == NULL;
}

static bool same_file(const struct stat *a, const char *path)
{
    struct stat b;
    return stat(path, &b) == 0 && a->st_ino == b.st_ino && a->st_dev == b.st_dev;
}

/* fd's path into path (size 4096); false when it has none. */
static bool fd_path(int fd, char *path)
{
    char link[64];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, 4095);
    path[n > 0 ? n : 0] = '\0';
    return n > 0;
}

/* The recorded file fd is (POWER_CUT_DATA, POWER_CUT_WAL), or -1: not recorded. With
 * other_path, a regular file of the store's directory that is neither: its path is
 * copied there (size 4096), else other_path is left "". */
static int file_of(int fd, char *other_path)
{
    struct stat a;
    pthread_once(&once, init);
    if (other_path != NULL) {
        other_path[0] = '\0';
    }
    if (log_fd < 0 || fstat(fd, &a) != 0 || !S_ISREG(a.st_mode)) {
        return -1;
    }
    if (same_file(&a, data_path)) {
        return POWER_CUT_DATA;
    }
    if (same_file(&a, wal_path)) {
        return POWER_CUT_WAL;
    }
    if (other_path != NULL && fd_path(fd, other_path) && !in_store_dir(other_path)) {
        other_path[0] = '\0';
    }
    return -1;
}

/* The recorded file fd writes to without O_DSYNC, or -1. A write through fd to another
 * file of the store's directory is logged as one the cut cannot undo (log_other). */
static int written_file(int fd)
{
    char other[4096];
    int f = file_of(fd, other);
    if (f < 0 && other[0] != '\0') {
        log_other_locked(other);
    }
    return f >= 0 && !(fcntl(fd, F_GETFL) & O_DSYNC) ? f : -1;
}

/* Appends one record (mu held): r, then pre (r->len bytes), then the iov's bytes
 * (r->new_len in all), in one write. Exits the process when it cannot: a write it could
 * not undo would void the test. */
static void log_record(const undo_rec *r, const char *pre, const struct iovec *iov, int cnt)
{
    char *rec = malloc(sizeof(*r) + r->len + r->new_len);
    if (rec == NULL) {
        _exit(97);
    }
    memcpy(rec, r, sizeof(*r));
    memcpy(rec + sizeof(*r), pre, r->len);
    for (size_t at = sizeof(*r) + r->len, i = 0; i < (size_t)cnt; at += iov[i++].iov_len) {
        memcpy(rec + at, iov[i].iov_base, iov[i].iov_len);
    }
    if (write_all(log_fd, rec, sizeof(*r) + r->len + r->new_len) != 0) {
        _exit(97);
    }
    free(rec);
}

/* Logs a change of file f (fd) at off, before it is made (mu held): a write of the iov's
 * bytes, or (iov NULL) a size change to off. The pre-image is [off, off + n) of what the
 * file holds, n the bytes written, or for a size change the bytes a shrink cuts off. */
static void log_change(int fd, int f, uint64_t off, const struct iovec *iov, int cnt)
{
    struct stat st;
    if (fstat(fd, &st) != 0) {
        _exit(97);
    }
    uint64_t size = (uint64_t)st.st_size, n = 0;
    for (int i = 0; i < cnt; i++) {
        n += iov[i].iov_len;
    }
    n = iov != NULL ? n : size > off ? size - off : 0;
    uint64_t have = off >= size ? 0 : (off + n > size ? size - off : n);
    undo_rec r = {iov != NULL ? POWER_CUT_WRITE : POWER_CUT_SIZE,
                  (uint64_t)f,
                  off,
                  have,
                  iov != NULL ? n : 0,
                  size};
    char *pre = malloc(have + 1);
    if (pre == NULL || (have > 0 && pread(fd, pre, have, (off_t)off) != (ssize_t)have)) {
        _exit(97);
    }
    log_record(&r, pre, iov, cnt);
    free(pre);
}

/* Where write() and writev() on fd write: the end of the file for O_APPEND. */
static uint64_t write_pos(int fd)
{
    struct stat st;
    if ((fcntl(fd, F_GETFL) & O_APPEND) && fstat(fd, &st) == 0) {
        return (uint64_t)st.st_size;
    }
    return (uint64_t)lseek(fd, 0, SEEK_CUR);
}

/* The write syscall nr (SYS_write, SYS_writev: at fd's position; SYS_pwrite64: at off, one
 * buffer) of the iov, recorded when fd is a recorded file: the record and the write under
 * mu, so that the log's order is the writes'. */
static ssize_t recorded_write(long nr, int fd, const struct iovec *iov, int cnt, off_t off)
{
    int f = written_file(fd);
    if (f >= 0) {
        pthread_mutex_lock(&mu);
        log_change(fd, f, nr == SYS_pwrite64 ? (uint64_t)off : write_pos(fd), iov, cnt);
    }
    ssize_t rc = nr == SYS_writev  ? syscall(nr, fd, iov, cnt)
                 : nr == SYS_write ? syscall(nr, fd, iov[0].iov_base, iov[0].iov_len)
                                   : syscall(nr, fd, iov[0].iov_base, iov[0].iov_len, off);
    if (f >= 0) {
        pthread_mutex_unlock(&mu);
    }
    return rc;
}

/* liblmdb binds "pwrite"; a program built with _FILE_OFFSET_BITS=64 names it pwrite64. */
ssize_t pwrite_recorded(int fd, const void *buf, size_t n, off_t off) __asm__("pwrite");
ssize_t pwrite_recorded(int fd, const void *buf, size_t n, off_t off)
{
    if (off < 0) {
        errno = EINVAL;
        return -1;
    }
    struct iovec v = {(void *)buf, n};
    return recorded_write(SYS_pwrite64, fd, &v, 1, off);
}

ssize_t pwrite64_recorded(int fd, const void *buf, size_t n, off_t off) __asm__("pwrite64");
ssize_t pwrite64_recorded(int fd, const void *buf, size_t n, off_t off)
{
    return pwrite_recorded(fd, buf, n, off);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    return recorded_write(SYS_writev, fd, iov, cnt, 0);
}

ssize_t write(int fd, const void *buf, size_t n)
{
    struct iovec v = {(void *)buf, n};
    return recorded_write(SYS_write, fd, &v, 1, 0);
}

/* A size change of a recorded file (ftruncate, a growing fallocate), recorded. */
static void record_size(int fd, int f, uint64_t size)
{
    pthread_mutex_lock(&mu);
    log_change(fd, f, size, NULL, 0);
    pthread_mutex_unlock(&mu);
}

int ftruncate_recorded(int fd, off_t len) __asm__("ftruncate");
int ftruncate_recorded(int fd, off_t len)
{
    int f = len >= 0 ? file_of(fd, NULL) : -1;
    if (f >= 0) {
        record_size(fd, f, (uint64_t)len);
    }
    return (int)syscall(SYS_ftruncate, fd, len);
}

int ftruncate64_recorded(int fd, off_t len) __asm__("ftruncate64");
int ftruncate64_recorded(int fd, off_t len)
{
    return ftruncate_recorded(fd, len);
}

/* Mode 0 grows the file to off + len, KEEP_SIZE changes nothing a read sees; any other
 * mode (punching holes, zeroing, collapsing) is logged as a change the cut cannot undo. */
int fallocate_recorded(int fd, int mode, off_t off, off_t len) __asm__("fallocate");
int fallocate_recorded(int fd, int mode, off_t off, off_t len)
{
    char path[4096];
    struct stat st;
    int f = file_of(fd, NULL);
    if (f >= 0 && mode != 0 && mode != FALLOC_FL_KEEP_SIZE) {
        log_other_locked(fd_path(fd, path) ? path : "?");
    } else if (f >= 0 && mode == 0 && off >= 0 && len > 0 && fstat(fd, &st) == 0 &&
               off + len > st.st_size) {
        record_size(fd, f, (uint64_t)(off + len));
    }
    return (int)syscall(SYS_fallocate, fd, mode, off, len);
}

int fallocate64_recorded(int fd, int mode, off_t off, off_t len) __asm__("fallocate64");
int fallocate64_recorded(int fd, int mode, off_t off, off_t len)
{
    return fallocate_recorded(fd, mode, off, len);
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

/* A sync of a recorded file marks that file's writes logged before it began as on disk,
 * or, when it fails (its step of the plan, data.mdb only), as lost. */
static int synced(int fd, long nr)
{
    int f = file_of(fd, NULL);
    if (f < 0) {
        return (int)syscall(nr, fd);
    }
    void (*hook)(void) = atomic_load(&power_cut_before_sync);
    if (hook != NULL && f == POWER_CUT_DATA) {
        hook();
    }
    pthread_mutex_lock(&mu);
    off_t before = lseek(log_fd, 0, SEEK_END);
    bool fail = f == POWER_CUT_DATA && *plan == 'f';
    plan += f == POWER_CUT_DATA && *plan != '\0';
    pthread_mutex_unlock(&mu);
    int rc = fail ? -1 : (int)syscall(nr, fd);
    if (rc == 0 || fail) {
        undo_rec r = {
            fail ? POWER_CUT_FAILED : POWER_CUT_SYNC, (uint64_t)f, (uint64_t)before, 0, 0, 0};
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

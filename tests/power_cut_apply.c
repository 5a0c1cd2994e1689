/* The power cut of power_cut.h: the recorded unsynced writes undone, newest first. */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "power_cut.h"

/* The log's bytes (malloc'd) and size; NULL when it cannot be read. */
static char *slurp(const char *path, size_t *size)
{
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return NULL;
    }
    char *p = malloc((size_t)st.st_size + 1);
    ssize_t got = p != NULL ? pread(fd, p, (size_t)st.st_size, 0) : -1;
    close(fd);
    if (got != st.st_size) {
        free(p);
        return NULL;
    }
    *size = (size_t)st.st_size;
    return p;
}

/* The offsets of the log's write records, in order (malloc'd; NULL when out of memory),
 * their number into *n, and into *durable the log offset before which a successful sync
 * made every write durable. */
static size_t *parse(const char *p, size_t size, size_t *n, size_t *durable)
{
    size_t at = 0;
    size_t *recs = malloc(sizeof(size_t) * (size / sizeof(undo_rec) + 1));
    undo_rec r;
    *n = *durable = 0;
    for (; recs != NULL && at + sizeof(r) <= size; at += sizeof(r) + r.len) {
        memcpy(&r, p + at, sizeof(r));
        if (at + sizeof(r) + r.len > size) {
            break; /* being written (a live server's log), or cut with its data write */
        }
        if (r.type == POWER_CUT_SYNC) {
            *durable = r.off > *durable ? r.off : *durable;
        } else {
            recs[(*n)++] = at;
        }
    }
    return recs;
}

long power_cut_pending(const char *log)
{
    size_t size, n, durable;
    char *p = slurp(log, &size);
    size_t *recs = p != NULL ? parse(p, size, &n, &durable) : NULL;
    long pending = recs != NULL ? 0 : -1;
    for (size_t i = n; recs != NULL && i-- > 0 && recs[i] >= durable;) {
        pending++;
    }
    free(recs);
    free(p);
    return pending;
}

long power_cut_apply(const char *log, const char *data)
{
    size_t size, n, durable;
    char *p = slurp(log, &size);
    if (p == NULL) {
        return -1;
    }
    size_t *recs = parse(p, size, &n, &durable);
    undo_rec r;
    int fd = recs != NULL ? open(data, O_WRONLY) : -1;
    long undone = 0;
    uint64_t size_then = UINT64_MAX;
    for (size_t i = n; fd >= 0 && i-- > 0 && recs[i] >= durable; undone++) {
        memcpy(&r, p + recs[i], sizeof(r));
        if (r.len > 0 &&
            pwrite(fd, p + recs[i] + sizeof(r), r.len, (off_t)r.off) != (ssize_t)r.len) {
            undone = -1;
            break;
        }
        size_then = r.old_size;
    }
    if (fd >= 0 && undone > 0 && size_then != UINT64_MAX && ftruncate(fd, (off_t)size_then) != 0) {
        undone = -1;
    }
    if (fd < 0 || close(fd) != 0) {
        undone = -1;
    }
    free(recs);
    free(p);
    return undone;
}

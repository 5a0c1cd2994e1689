/* The power cut of power_cut.h: the recorded writes not on disk undone, newest first. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
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

enum { PENDING, DURABLE, LOST };

/* One write record of the log: where it is in the log, and whether it is on disk. */
typedef struct wrec {
    size_t at;
    int state;
} wrec;

#define PAGE 4096u

/* w and v touch a page in common (the pre-images' ranges, at least one byte each). */
static bool same_page(const char *p, const wrec *w, const wrec *v)
{
    undo_rec a, b;
    memcpy(&a, p + w->at, sizeof(a));
    memcpy(&b, p + v->at, sizeof(b));
    uint64_t a0 = a.off / PAGE, a1 = (a.off + (a.len ? a.len : 1) - 1) / PAGE;
    uint64_t b0 = b.off / PAGE, b1 = (b.off + (b.len ? b.len : 1) - 1) / PAGE;
    return a0 <= b1 && b0 <= a1;
}

/* A sync (failed or not) that began when the log had `before` bytes: the writes pending
 * then are on disk, or lost; one on disk now saves the older lost writes to its pages. */
static void mark(const char *p, wrec *w, size_t n, uint64_t before, bool ok)
{
    for (size_t i = 0; i < n; i++) {
        if (w[i].state != PENDING || w[i].at >= before) {
            continue;
        }
        w[i].state = ok ? DURABLE : LOST;
        for (size_t j = 0; ok && j < i; j++) {
            if (w[j].state == LOST && same_page(p, &w[j], &w[i])) {
                w[j].state = DURABLE;
            }
        }
    }
}

/* The log's write records, in order (malloc'd; NULL when out of memory), their number
 * into *n, each with its state after the log's syncs; *others: the writes to other files. */
static wrec *parse(const char *p, size_t size, size_t *n, size_t *others)
{
    *others = 0;
    size_t at = 0;
    wrec *w = malloc(sizeof(wrec) * (size / sizeof(undo_rec) + 1));
    undo_rec r;
    *n = 0;
    for (; w != NULL && at + sizeof(r) <= size; at += sizeof(r) + r.len) {
        memcpy(&r, p + at, sizeof(r));
        if (at + sizeof(r) + r.len > size) {
            break; /* being written (a live server's log), or cut with its data write */
        }
        if (r.type == POWER_CUT_WRITE) {
            w[(*n)++] = (wrec){at, PENDING};
        } else if (r.type == POWER_CUT_OTHER) {
            (*others)++;
        } else {
            mark(p, w, *n, r.off, r.type == POWER_CUT_SYNC);
        }
    }
    return w;
}

long power_cut_pending(const char *log)
{
    size_t size, n, others;
    char *p = slurp(log, &size);
    wrec *w = p != NULL ? parse(p, size, &n, &others) : NULL;
    long pending = w != NULL ? 0 : -1;
    for (size_t i = 0; w != NULL && i < n; i++) {
        pending += w[i].state == PENDING;
    }
    free(w);
    free(p);
    return pending;
}

long power_cut_apply(const char *log, const char *data)
{
    size_t size, n, others;
    char *p = slurp(log, &size);
    if (p == NULL) {
        return -1;
    }
    wrec *w = parse(p, size, &n, &others);
    if (w != NULL && others > 0) {
        free(w);
        free(p);
        errno = ENOTSUP;
        return -1;
    }
    undo_rec r;
    int fd = w != NULL ? open(data, O_WRONLY) : -1;
    long undone = 0;
    uint64_t size_then = UINT64_MAX;
    bool tail = true; /* every write after this one is undone too */
    for (size_t i = n; fd >= 0 && i-- > 0;) {
        memcpy(&r, p + w[i].at, sizeof(r));
        tail = tail && w[i].state != DURABLE;
        if (w[i].state == DURABLE) {
            continue;
        }
        if (r.len > 0 &&
            pwrite(fd, p + w[i].at + sizeof(r), r.len, (off_t)r.off) != (ssize_t)r.len) {
            undone = -1;
            break;
        }
        undone++;
        size_then = tail ? r.old_size : size_then;
    }
    if (fd >= 0 && undone > 0 && size_then != UINT64_MAX && ftruncate(fd, (off_t)size_then) != 0) {
        undone = -1;
    }
    if (fd < 0 || close(fd) != 0) {
        undone = -1;
    }
    free(w);
    free(p);
    return undone;
}

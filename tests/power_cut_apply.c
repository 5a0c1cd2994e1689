/* The power cut of power_cut.h: per file, the recorded writes not on disk undone, newest
 * first, then the ones the cut keeps re-applied in their order. */
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

/* One change record (write or size) of the log: where it is in the log, its file, whether
 * it is on disk, and whether the cut keeps it (pending ones only). */
typedef struct wrec {
    size_t at;
    int file;
    int state;
    bool kept;
} wrec;

#define PAGE 4096u

static undo_rec rec_at(const char *p, const wrec *w)
{
    undo_rec r;
    memcpy(&r, p + w->at, sizeof(r));
    return r;
}

/* w and v touch a page in common (the pre-images' ranges, at least one byte each). */
static bool same_page(const char *p, const wrec *w, const wrec *v)
{
    undo_rec a = rec_at(p, w), b = rec_at(p, v);
    uint64_t a0 = a.off / PAGE, a1 = (a.off + (a.len ? a.len : 1) - 1) / PAGE;
    uint64_t b0 = b.off / PAGE, b1 = (b.off + (b.len ? b.len : 1) - 1) / PAGE;
    return a0 <= b1 && b0 <= a1;
}

/* A sync of file m.file (failed or not) that began when the log had m.off bytes: that
 * file's writes pending then are on disk, or lost; one on disk now saves the older lost
 * writes to its pages. */
static void mark(const char *p, wrec *w, size_t n, const undo_rec *m)
{
    bool ok = m->type == POWER_CUT_SYNC;
    for (size_t i = 0; i < n; i++) {
        if (w[i].file != (int)m->file || w[i].state != PENDING || w[i].at >= m->off) {
            continue;
        }
        w[i].state = ok ? DURABLE : LOST;
        for (size_t j = 0; ok && j < i; j++) {
            if (w[j].file == w[i].file && w[j].state == LOST && same_page(p, &w[j], &w[i])) {
                w[j].state = DURABLE;
            }
        }
    }
}

/* The log's change records, in order (malloc'd; NULL when out of memory or a record names
 * no file the cut knows), their number into *n, each with its state after the log's
 * syncs; *others: the changes to other files. */
static wrec *parse(const char *p, size_t size, size_t *n, size_t *others)
{
    *others = 0;
    size_t at = 0;
    wrec *w = malloc(sizeof(wrec) * (size / sizeof(undo_rec) + 1));
    undo_rec r;
    *n = 0;
    for (; w != NULL && at + sizeof(r) <= size; at += sizeof(r) + r.len + r.new_len) {
        memcpy(&r, p + at, sizeof(r));
        if (r.len > size || r.new_len > size || at + sizeof(r) + r.len + r.new_len > size) {
            break; /* being written (a live server's log), or cut with its data write */
        }
        if (r.type == POWER_CUT_OTHER) {
            (*others)++;
        } else if (r.file >= POWER_CUT_FILES) {
            free(w);
            return NULL;
        } else if (r.type == POWER_CUT_WRITE || r.type == POWER_CUT_SIZE) {
            w[(*n)++] = (wrec){at, (int)r.file, PENDING, false};
        } else {
            mark(p, w, *n, &r);
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

/* Draws, in log order, which pending changes of file f the cut keeps. */
static void draw(wrec *w, size_t n, int f, power_cut_keep_fn *keep, void *arg, power_cut_stats *st)
{
    long nth = 0;
    for (size_t i = 0; keep != NULL && i < n; i++) {
        if (w[i].file == f && w[i].state == PENDING) {
            w[i].kept = keep(arg, f, nth++);
            st->kept[f] += w[i].kept;
        }
    }
}

/* Undoes, newest first, every change of file f (fd) not on disk, then restores the size
 * the file had before the oldest of those after its last change on disk: the synced
 * image. */
static int undo(const char *p, const wrec *w, size_t n, int f, int fd, power_cut_stats *st)
{
    uint64_t size_then = UINT64_MAX;
    bool tail = true; /* every change of f after this one is undone too */
    for (size_t i = n; i-- > 0;) {
        undo_rec r = rec_at(p, &w[i]);
        if (w[i].file != f) {
            continue;
        }
        tail = tail && w[i].state != DURABLE;
        if (w[i].state == DURABLE) {
            continue;
        }
        if (r.len > 0 &&
            pwrite(fd, p + w[i].at + sizeof(r), r.len, (off_t)r.off) != (ssize_t)r.len) {
            return -1;
        }
        st->undone[f] += !w[i].kept;
        size_then = tail ? r.old_size : size_then;
    }
    return size_then == UINT64_MAX || ftruncate(fd, (off_t)size_then) == 0 ? 0 : -1;
}

/* Re-applies, in their order, the changes of file f (fd) the cut keeps. */
static int redo(const char *p, const wrec *w, size_t n, int f, int fd)
{
    for (size_t i = 0; i < n; i++) {
        undo_rec r = rec_at(p, &w[i]);
        if (w[i].file != f || !w[i].kept) {
            continue;
        }
        const char *bytes = p + w[i].at + sizeof(r) + r.len;
        if (r.type == POWER_CUT_WRITE
                ? pwrite(fd, bytes, r.new_len, (off_t)r.off) != (ssize_t)r.new_len
                : ftruncate(fd, (off_t)r.off) != 0) {
            return -1;
        }
    }
    return 0;
}

/* The cut of file f at path (draw, undo, redo); nothing when the log has no change of it. */
static int cut_file(const char *p, wrec *w, size_t n, int f, const char *path,
                    power_cut_keep_fn *keep, void *arg, power_cut_stats *st)
{
    bool changed = false;
    for (size_t i = 0; i < n; i++) {
        changed = changed || w[i].file == f;
    }
    if (!changed) {
        return 0;
    }
    int fd = open(path, O_WRONLY);
    if (fd < 0) {
        return -1;
    }
    draw(w, n, f, keep, arg, st);
    int rc = undo(p, w, n, f, fd, st);
    rc = rc == 0 ? redo(p, w, n, f, fd) : rc;
    return close(fd) == 0 ? rc : -1;
}

int power_cut_apply_keeping(const char *log, const char *data, power_cut_keep_fn *keep, void *arg,
                            power_cut_stats *st)
{
    size_t size, n, others;
    memset(st, 0, sizeof(*st));
    char *p = slurp(log, &size);
    wrec *w = p != NULL ? parse(p, size, &n, &others) : NULL;
    int rc = w != NULL ? 0 : -1;
    if (rc == 0 && others > 0) {
        errno = ENOTSUP;
        rc = -1;
    }
    char wal[4096];
    power_cut_wal_path(data, wal, sizeof(wal));
    const char *paths[POWER_CUT_FILES] = {data, wal};
    for (int f = 0; rc == 0 && f < POWER_CUT_FILES; f++) {
        rc = cut_file(p, w, n, f, paths[f], keep, arg, st);
    }
    free(w);
    free(p);
    return rc;
}

long power_cut_apply(const char *log, const char *data)
{
    power_cut_stats st;
    if (power_cut_apply_keeping(log, data, NULL, NULL, &st) != 0) {
        return -1;
    }
    return st.undone[POWER_CUT_DATA] + st.undone[POWER_CUT_WAL];
}

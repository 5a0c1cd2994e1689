/* What the process has spent so far, for the cost columns of a cell: CPU time and
 * context switches from getrusage(RUSAGE_SELF) (every thread of the process, the
 * exited ones included), read/write-family syscalls from /proc/self/io and the
 * allocation count of alloc_count.c.
 *
 * Why /proc/self/io: Linux keeps no per-process count of all syscalls; the only full
 * count is perf's raw_syscalls tracepoint, which needs tracefs and perf permissions.
 * syscr + syscw count read, readv, pread(v), write, writev, pwrite(v), sendfile and
 * copy_file_range, and nothing else: not sendmsg (nng's send path), recvmsg, epoll,
 * futex or fdatasync. The column says "rwsys" for that reason.
 *
 * A sample allocates nothing (open/read/close on a stack buffer), so it does not show
 * in the allocation count; its one read(2) shows in rwsys (once a cell, not per call). */
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "bench.h"

/* The value of "name: N" in text, NAN when absent. */
static double io_field(const char *text, const char *name)
{
    const char *p = strstr(text, name);
    if (p == NULL) {
        return NAN;
    }
    char *end;
    unsigned long long v = strtoull(p + strlen(name), &end, 10);
    return end == p + strlen(name) ? NAN : (double)v;
}

/* /proc/self/<file> into buf, NUL-terminated; false when it cannot be read. */
static bool proc_self_read(const char *file, char *buf, size_t cap)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/%s", file);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return false;
    }
    ssize_t n = read(fd, buf, cap - 1);
    close(fd);
    if (n <= 0) {
        return false;
    }
    buf[n] = '\0';
    return true;
}

double proc_self_field(const char *file, const char *name)
{
    char buf[4096];
    return proc_self_read(file, buf, sizeof(buf)) ? io_field(buf, name) : NAN;
}

/* syscr + syscw of this process; NAN when /proc/self/io is missing (a kernel without
 * task I/O accounting). */
static double rw_syscalls(void)
{
    char buf[512];
    return proc_self_read("io", buf, sizeof(buf))
               ? io_field(buf, "syscr: ") + io_field(buf, "syscw: ")
               : NAN;
}

static double tv_us(struct timeval tv)
{
    return (double)tv.tv_sec * 1e6 + (double)tv.tv_usec;
}

void proc_usage_now(proc_usage *u)
{
    struct rusage ru;
    u->allocs = alloc_count();
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
        u->cpu_us = tv_us(ru.ru_utime) + tv_us(ru.ru_stime);
        u->vcsw = (double)ru.ru_nvcsw;
        u->ivcsw = (double)ru.ru_nivcsw;
        u->minflt = (double)ru.ru_minflt;
        u->majflt = (double)ru.ru_majflt;
    } else {
        u->cpu_us = u->vcsw = u->ivcsw = u->minflt = u->majflt = NAN;
    }
    u->rw_syscalls = rw_syscalls();
    u->peer_cpu_us = NAN; /* the harness asks the scenario, when it has a peer */
}

void proc_usage_diff(const proc_usage *a, const proc_usage *b, proc_usage *d)
{
    d->cpu_us = b->cpu_us - a->cpu_us;
    d->vcsw = b->vcsw - a->vcsw;
    d->ivcsw = b->ivcsw - a->ivcsw;
    d->minflt = b->minflt - a->minflt;
    d->majflt = b->majflt - a->majflt;
    d->rw_syscalls = b->rw_syscalls - a->rw_syscalls;
    d->allocs = b->allocs - a->allocs;
    d->peer_cpu_us = b->peer_cpu_us - a->peer_cpu_us;
}

/* ---- switches by thread kind (--switches) ---- */

/* The slot of kind in t, added when new; -1 when t is full. */
static int kind_slot(thread_switches *t, const char *kind)
{
    for (int i = 0; i < t->n; i++) {
        if (strcmp(t->kind[i], kind) == 0) {
            return i;
        }
    }
    if (t->n == MAX_THREAD_KINDS) {
        return -1;
    }
    snprintf(t->kind[t->n], sizeof(t->kind[0]), "%s", kind);
    t->vcsw[t->n] = t->ivcsw[t->n] = 0;
    return t->n++;
}

/* One thread's name without its trailing digits and newline, and its switches. */
static bool task_read(const char *tid, char kind[16], double *vcsw, double *ivcsw)
{
    char file[64], buf[2048];
    snprintf(file, sizeof(file), "task/%s/comm", tid);
    if (!proc_self_read(file, buf, sizeof(buf))) {
        return false;
    }
    size_t n = strcspn(buf, "\n");
    while (n > 0 && ((buf[n - 1] >= '0' && buf[n - 1] <= '9') || buf[n - 1] == ':')) {
        n--;
    }
    snprintf(kind, 16, "%.*s", (int)(n < 15 ? n : 15), buf);
    snprintf(file, sizeof(file), "task/%s/status", tid);
    if (!proc_self_read(file, buf, sizeof(buf))) {
        return false;
    }
    *vcsw = io_field(buf, "\nvoluntary_ctxt_switches:\t");
    *ivcsw = io_field(buf, "nonvoluntary_ctxt_switches:\t");
    return !isnan(*vcsw) && !isnan(*ivcsw);
}

void thread_switches_now(thread_switches *t)
{
    DIR *dir = opendir("/proc/self/task");
    struct dirent *e;
    t->n = 0;
    while (dir != NULL && (e = readdir(dir)) != NULL) {
        char kind[16];
        double v, iv;
        int i;
        if (e->d_name[0] != '.' && task_read(e->d_name, kind, &v, &iv) &&
            (i = kind_slot(t, kind)) >= 0) {
            t->vcsw[i] += v;
            t->ivcsw[i] += iv;
        }
    }
    if (dir != NULL) {
        closedir(dir);
    }
}

/* A kind missing from a (its threads started in the window) counts from 0; one missing
 * from b (its threads ended) is left out. */
void thread_switches_diff(const thread_switches *a, const thread_switches *b, thread_switches *d)
{
    *d = *b;
    for (int i = 0; i < d->n; i++) {
        for (int j = 0; j < a->n; j++) {
            if (strcmp(a->kind[j], d->kind[i]) == 0) {
                d->vcsw[i] -= a->vcsw[j];
                d->ivcsw[i] -= a->ivcsw[j];
            }
        }
    }
}

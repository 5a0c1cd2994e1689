/* Issue 35's long campaign, finding 5 (docs/chaos.md): the fault proxy ran out of
 * connection slots, and a server whose database had become unreachable did not stop
 * within 10 s of SIGTERM. Both through the real pieces: libpq through tests/pgproxy.c,
 * the idemrpc-demo binary on PostgreSQL. */
#include <criterion/criterion.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pgproxy.h"
#include "testutil.h"

static char schema[32], *conninfo;

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void setup(void)
{
    conninfo = tu_pg_schema_create(schema);
}

static void teardown(void)
{
    if (conninfo != NULL) {
        tu_pg_schema_drop(schema);
        free(conninfo);
        conninfo = NULL;
    }
}

TestSuite(pg_stop, .init = setup, .fini = teardown, .timeout = 120);

static char *via_proxy(const pgproxy *p)
{
    char *ci = NULL;
    cr_assert_gt(asprintf(&ci, "%s host=127.0.0.1 port=%d", conninfo, pgproxy_port(p)), 0);
    return ci;
}

/* The proxy held every connection's slot until it stopped: after MAX_CONNS (256)
 * connections in one run it closed each new one at once. */
Test(pg_stop, the_fault_proxy_serves_more_connections_than_it_has_slots)
{
    pgproxy *p = pgproxy_start(conninfo);
    char *ci = via_proxy(p);
    for (int i = 0; i < 300; i++) {
        PGconn *c = PQconnectdb(ci);
        cr_assert_eq(PQstatus(c), CONNECTION_OK, "connection %d: %s", i, PQerrorMessage(c));
        PGresult *r = PQexec(c, "SELECT 1");
        cr_assert_eq(PQresultStatus(r), PGRES_TUPLES_OK, "connection %d: %s", i, PQerrorMessage(c));
        PQclear(r);
        PQfinish(c);
    }
    free(ci);
    pgproxy_stop(p);
}

/* ---- a server whose database became unreachable, stopped by SIGTERM ---- */

/* The demo's address: a socket of this process's (the ASan suite may run beside this one,
 * as .ci/run runs them). Its file is removed by demo_term. */
static const char *demo_url(void)
{
    static char url[64];
    snprintf(url, sizeof(url), "ipc:///tmp/idemrpc-pg-stop-%d.ipc", (int)getpid());
    return url;
}

typedef struct demo_proc {
    pid_t pid;
    FILE *out;
} demo_proc;

/* Starts idemrpc-demo on ci, its handlers taking delay_ms; waits for its banner. */
static void demo_start(demo_proc *d, const char *ci, const char *delay_ms)
{
    const char *bin = getenv("IDEMRPC_DEMO");
    const char *argv[] = {bin, "--listen", demo_url(), "--store", ci, "--delay-ms", delay_ms, NULL};
    int fds[2];
    cr_assert_not_null(bin, "IDEMRPC_DEMO unset");
    cr_assert_eq(pipe(fds), 0);
    d->pid = fork();
    cr_assert_geq(d->pid, 0);
    if (d->pid == 0) {
        dup2(fds[1], STDOUT_FILENO);
        close(fds[0]);
        close(fds[1]);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    d->out = fdopen(fds[0], "r");
    char line[256] = {0};
    cr_assert_not_null(fgets(line, sizeof(line), d->out), "idemrpc-demo did not start");
    cr_assert(strncmp(line, "idemrpc-demo listening", 22) == 0, "banner: %s", line);
}

/* Waits up to bound_ms for d to exit after SIGTERM; returns the ms it took, or -1 (then
 * it was SIGKILLed). */
static long demo_term(demo_proc *d, long bound_ms)
{
    uint64_t t0 = now_ms();
    cr_assert_eq(kill(d->pid, SIGTERM), 0);
    int status;
    long took = -1;
    while (now_ms() - t0 < (uint64_t)bound_ms) {
        pid_t r = waitpid(d->pid, &status, WNOHANG);
        cr_assert_geq(r, 0);
        if (r == d->pid) {
            took = (long)(now_ms() - t0);
            break;
        }
        usleep(20 * 1000); /* polling a child's exit: no condition to wait on */
    }
    if (took < 0) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, &status, 0);
    }
    fclose(d->out);
    unlink(demo_url() + strlen("ipc://"));
    return took;
}

typedef struct bg_add {
    char key[32];
    pthread_t t;
} bg_add;

static void *bg_add_main(void *arg)
{
    bg_add *a = arg;
    idem_client *c = tu_client_attempts(demo_url(), 30000, 1);
    idem_request q = {
        .method = "demo.Counter/Add", .idempotency_key = a->key, .payload = "1", .payload_len = 1};
    idem_result r;
    (void)idem_client_call(c, &q, &r); /* any answer: the server is being stopped */
    idem_result_clear(&r);
    idem_client_close(c);
    return NULL;
}

/* idem_server_destroy's bound with the store unreachable (server.h): the longest running
 * handler (the demo's delay), IDEM_OUTAGE_RETRY_MS for its outcome, two reconnect bounds
 * (PostgreSQL's default reconnect_ms), and a margin for a loaded machine. */
#define HANDLER_MS 1000
#define STOP_BOUND_MS (HANDLER_MS + 10000 + 2 * 10000 + 5000)
#define RUNNING_CALLS 8

/* Eight calls are running when the database goes away (refusing connections, or
 * silent); the server's stop must not grow with their number. */
static void stop_while_unreachable(bool silent)
{
    pgproxy *p = pgproxy_start(conninfo);
    char *ci = via_proxy(p);
    demo_proc d;
    char delay[16];
    snprintf(delay, sizeof(delay), "%d", HANDLER_MS);
    demo_start(&d, ci, delay);
    bg_add calls[RUNNING_CALLS];
    for (int i = 0; i < RUNNING_CALLS; i++) {
        snprintf(calls[i].key, sizeof(calls[i].key), "stop-%d", i);
        cr_assert_eq(pthread_create(&calls[i].t, NULL, bg_add_main, &calls[i]), 0);
    }
    usleep(HANDLER_MS / 2 * 1000); /* not a synchronisation: any moment of the calls fits */
    if (silent) {
        pgproxy_cut(p, true);
    } else {
        pgproxy_stop(p);
        p = NULL;
    }
    long took = demo_term(&d, STOP_BOUND_MS);
    for (int i = 0; i < RUNNING_CALLS; i++) {
        pthread_join(calls[i].t, NULL);
    }
    if (p != NULL) {
        pgproxy_stop(p);
    }
    free(ci);
    cr_expect_geq(took, 0, "idemrpc-demo did not stop within %d ms of SIGTERM", STOP_BOUND_MS);
}

Test(pg_stop, a_server_whose_database_refuses_connections_stops_in_bounded_time)
{
    stop_while_unreachable(false);
}

Test(pg_stop, a_server_whose_database_went_silent_stops_in_bounded_time)
{
    stop_while_unreachable(true);
}

/* The PostgreSQL store on a multi-host conninfo (docs/ha.md) whose first host accepts TCP
 * and never answers (a stopped or partitioned ex-leader: tests/hung_host.c), the real
 * server second. Instance A connects through `host=127.0.0.1,127.0.0.1 port=HUNG,REAL`,
 * instance B directly; the conninfo's connect_timeout is 2 s ($IDEMRPC_TEST_PG). */
#include <criterion/criterion.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "call.h"
#include "hung_host.h"
#include "testutil.h"

/* Shorter than the connect timeout, so that a keeper that waited on the hung host would
 * let the lease lapse; as long as that allows, so that a loaded machine's scheduling
 * does not (600 ms lapsed at a load average of 20). */
#define LEASE_MS 1500
#define CONNECT_TIMEOUT_MS 2000 /* $IDEMRPC_TEST_PG's connect_timeout */

static char schema[32], *conninfo, *via_hung;
static hung_host *hung;
static tu_server srv[2];
static idem_store *stores[2];

/* The handler waits at a gate the test opens; runs counts its runs. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool open;
    atomic_int entered, runs;
} G;

static void gate_open(void)
{
    pthread_mutex_lock(&G.mu);
    G.open = true;
    pthread_cond_broadcast(&G.cv);
    pthread_mutex_unlock(&G.mu);
}

static idem_code h_gated(idem_call *call, void *arg)
{
    (void)arg;
    int run = atomic_fetch_add(&G.runs, 1) + 1;
    atomic_fetch_add(&G.entered, 1);
    pthread_mutex_lock(&G.mu);
    while (!G.open) {
        pthread_cond_wait(&G.cv, &G.mu);
    }
    pthread_mutex_unlock(&G.mu);
    char out[32];
    int n = snprintf(out, sizeof(out), "ran %d", run);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* The port of the real server, from $IDEMRPC_TEST_PG. */
static int real_port(void)
{
    int port = 5432;
    PQconninfoOption *o = PQconninfoParse(conninfo, NULL);
    for (PQconninfoOption *i = o; i != NULL && i->keyword != NULL; i++) {
        if (strcmp(i->keyword, "port") == 0 && i->val != NULL) {
            port = atoi(i->val);
        }
    }
    PQconninfoFree(o);
    return port;
}

static void setup(void)
{
    conninfo = tu_pg_schema_create(schema);
    memset(&G, 0, sizeof(G));
    pthread_mutex_init(&G.mu, NULL);
    pthread_cond_init(&G.cv, NULL);
    cr_assert_not_null(hung = hung_host_start());
    cr_assert_gt(asprintf(&via_hung, "%s application_name=%s host=127.0.0.1,127.0.0.1 port=%d,%d",
                          conninfo, schema, hung_host_port(hung), real_port()),
                 0); /* later keywords win in a conninfo */
}

static void teardown(void)
{
    if (conninfo != NULL) {
        tu_pg_schema_drop(schema);
        free(conninfo);
        conninfo = NULL;
    }
    free(via_hung);
    via_hung = NULL;
    if (hung != NULL) {
        hung_host_stop(hung);
        hung = NULL;
    }
}

TestSuite(pg_hosts, .init = setup, .fini = teardown, .timeout = 120);

/* Instance i: A (0) through the hung host first, B (1) directly. */
static void start_instance(int i)
{
    idem_pg_opts po = {.pool_size = 4, .statement_timeout_ms = 2000, .lock_timeout_ms = 300};
    cr_assert_eq(idem_store_open_postgres_ex(&stores[i], i == 0 ? via_hung : conninfo, &po),
                 IDEM_OK, "%s", idem_errmsg());
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = stores[i];
    o.contexts = 8;
    o.workers = 4;
    o.max_wait_ms = 200; /* a duplicate answers "in progress" soon */
    o.log_level = IDEM_LOG_OFF;
    tu_server_create(&srv[i], &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED, .lease_ms = LEASE_MS};
    cr_assert_eq(idem_server_register(srv[i].srv, "h.T/Slow", h_gated, NULL, &m), IDEM_OK);
    tu_server_listen(&srv[i]);
}

static void stop_instances(int n)
{
    for (int i = 0; i < n; i++) {
        tu_server_destroy(&srv[i], false);
        idem_store_close(stores[i]);
    }
}

struct bg_call {
    const char *url, *key;
    unsigned deadline_ms;
    idem_code code;
    char answer[64];
    pthread_t t;
};

/* One call with a single attempt. */
static void *bg_call_main(void *p)
{
    struct bg_call *a = p;
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.deadline_ms = a->deadline_ms;
    o.attempt_timeout_ms = a->deadline_ms;
    o.retry.max_attempts = 1;
    cr_assert_eq(idem_client_open(&c, &a->url, 1, &o), IDEM_OK);
    idem_request q = {.method = "h.T/Slow", .idempotency_key = a->key};
    idem_result r;
    a->code = idem_client_call(c, &q, &r);
    snprintf(a->answer, sizeof(a->answer), "%.*s", (int)r.payload_len,
             r.payload != NULL ? (const char *)r.payload : "");
    idem_result_clear(&r);
    idem_client_close(c);
    return NULL;
}

/* Polls (bounded at 10 s) until cond(arg) holds. */
static bool await(bool (*cond)(const void *), const void *arg)
{
    for (int i = 0; i < 1000 && !cond(arg); i++) {
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL); /* polling what other threads or the database set, bounded */
    }
    return cond(arg);
}

static bool entered(const void *n)
{
    return atomic_load(&G.entered) >= *(const int *)n;
}

/* The lease of key's record in the database (0: no record). */
static long long lease_until(const char *key)
{
    PGconn *c = PQconnectdb(conninfo);
    cr_assert_eq(PQstatus(c), CONNECTION_OK, "%s", PQerrorMessage(c));
    const char *p[] = {key};
    PGresult *r = PQexecParams(c, "SELECT lease_until_ms FROM idem_records WHERE key = $1", 1, NULL,
                               p, NULL, NULL, 0);
    cr_assert_eq(PQresultStatus(r), PGRES_TUPLES_OK, "%s", PQresultErrorMessage(r));
    long long until = PQntuples(r) == 1 ? atoll(PQgetvalue(r, 0, 0)) : 0;
    PQclear(r);
    PQfinish(c);
    return until;
}

struct renewal {
    const char *key;
    long long before;
};

static bool renewed(const void *arg)
{
    const struct renewal *w = arg;
    return lease_until(w->key) > w->before;
}

/* The case: A's handler runs past several leases, and B is asked for the same
 * key all along. A's lease keeper makes its first connection while the handler runs; if
 * that connection waited on the hung host (connect_timeout, 2 s), A's lease would lapse
 * and B would run the call a second time. */
Test(pg_hosts, a_hung_first_host_does_not_stall_the_lease_keeper)
{
    start_instance(0);
    start_instance(1);
    struct bg_call first = {.url = srv[0].url, .key = "k-hung", .deadline_ms = 20000};
    cr_assert_eq(pthread_create(&first.t, NULL, bg_call_main, &first), 0);
    cr_assert(await(entered, &(int){1}));
    uint64_t until = idem__mono_ms() + 2 * CONNECT_TIMEOUT_MS + 2 * LEASE_MS;
    while (idem__mono_ms() < until && atomic_load(&G.runs) == 1) { /* duplicates on B */
        struct bg_call dup = {.url = srv[1].url, .key = "k-hung", .deadline_ms = 300};
        bg_call_main(&dup);
        cr_expect_neq(dup.code, IDEM_OK, "B answered a call that is still running");
    }
    cr_expect_eq(atomic_load(&G.runs), 1, "the live call's lease lapsed and B ran it again");
    gate_open();
    pthread_join(first.t, NULL);
    cr_expect_eq(first.code, IDEM_OK, "%s", idem_code_name(first.code));
    cr_expect_str_eq(first.answer, "ran 1");
    stop_instances(2);
}

/* Runs a call on A until its lease has been renewed once (the keeper connected), then
 * lets it finish. */
static void run_past_a_renewal(const char *key)
{
    G.open = false;
    int n = atomic_load(&G.entered) + 1;
    struct bg_call call = {.url = srv[0].url, .key = key, .deadline_ms = 20000};
    cr_assert_eq(pthread_create(&call.t, NULL, bg_call_main, &call), 0);
    cr_assert(await(entered, &n));
    struct renewal w = {key, lease_until(key)};
    cr_expect(await(renewed, &w), "the lease of %s was never renewed", key);
    gate_open();
    pthread_join(call.t, NULL);
    cr_expect_eq(call.code, IDEM_OK, "%s: %s", key, idem_code_name(call.code));
}

/* Once a host has answered, the store's connections try it first: the keeper's, the
 * pool's after the database ended their sessions, the listener's. Only the store's
 * first connection went to the hung host. */
Test(pg_hosts, later_connections_try_the_host_that_answered_first)
{
    start_instance(0);
    int seen = hung_host_connections(hung);
    cr_assert_geq(seen, 1, "the store's first connection did not try the first host");
    run_past_a_renewal("k-before");
    tu_pg_exec(conninfo, "DO $$ BEGIN PERFORM pg_terminate_backend(pid) FROM pg_stat_activity"
                         " WHERE application_name = current_schema(); END $$");
    run_past_a_renewal("k-after"); /* the pool and the keeper connect anew */
    stop_instances(1);
    int now = hung_host_connections(hung);
    cr_expect_eq(now, seen, "%d later connections tried the hung host before the one that answered",
                 now - seen);
}

/* A host list that libpq could not pair with its ports is refused when the store opens,
 * as bad input, not as an outage to retry. */
Test(pg_hosts, a_conninfo_whose_ports_do_not_match_its_hosts_is_refused_naming_the_fault)
{
    char *bad;
    cr_assert_gt(asprintf(&bad, "%s host=127.0.0.1,127.0.0.1 port=1,2,3", conninfo), 0);
    idem_store *st = NULL;
    idem_code code = idem_store_open_postgres(&st, bad, 1);
    free(bad);
    cr_expect_eq(code, IDEM_INVALID_ARGUMENT, "%s: %s", idem_code_name(code), idem_errmsg());
    cr_expect(strstr(idem_errmsg(), "3 ports for 2 hosts") != NULL, "%s", idem_errmsg());
    cr_expect_null(st);
}

/* idemrpc-payments: serves the pay.* methods on one store.
 *
 *   idemrpc-payments --listen URL --store DIR|POSTGRES [--seed N] [--fail-rate P]
 *                    [--redeliver-rate P] [--crash-at consume|before_ack] [--crash-on N]
 *                    [--create-delay-ms N] [--lease-ms N] [--nats URL [--nats-stream NAME]]
 *
 * --store takes an LMDB directory, or a PostgreSQL database as a URL (postgres://...,
 * postgresql://...) or a libpq keyword=value string ("host=... dbname=..."): any value
 * with '=' in it. --db DIR is the LMDB-only spelling (also for a directory whose name has
 * an '='). Several instances may serve one PostgreSQL database. Prints "ready" on stdout
 * once it listens; SIGTERM or SIGINT stops it cleanly. The fault options drive the
 * tests' at-least-once harness (README.md). --nats moves the commission messages onto a
 * NATS JetStream broker (stream NAME, default PAY; commission_nats.c); without it they
 * stay in the store's own queue. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "payments.h"

/* On PostgreSQL a transactional handler holds a pool connection while it runs, and so do
 * the commission dispatcher (with --nats: the relay and the consumer) and the sweeper:
 * the pool is their sum. */
#define PG_WORKERS 8
#define PG_POOL (PG_WORKERS + 3)

typedef struct options {
    const char *listen, *store;
    bool pg; /* --store named a PostgreSQL database */
    uint64_t lease_ms;
    pay_faults faults;
    const char *nats_url, *nats_stream;
} options;

static bool bad_option(const char *k, const char *v, const char *why)
{
    fprintf(stderr, "idemrpc-payments: %s %s: %s\n", k, v, why);
    return false;
}

/* A decimal integer in 0..max. */
static bool opt_uint(const char *k, const char *v, uint64_t max, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 10);
    if (*v < '0' || *v > '9' || *end != '\0' || errno != 0 || n > max) {
        return bad_option(k, v, "not a whole number in range");
    }
    *out = n;
    return true;
}

/* A probability in [0, 1]. */
static bool opt_rate(const char *k, const char *v, double *out)
{
    char *end;
    *out = strtod(v, &end);
    if (end == v || *end != '\0' || !(*out >= 0.0 && *out <= 1.0)) {
        return bad_option(k, v, "not a number from 0 to 1");
    }
    return true;
}

static bool is_postgres_url(const char *v)
{
    return strncmp(v, "postgres://", 11) == 0 || strncmp(v, "postgresql://", 13) == 0;
}

/* --store and --db: exactly one of them, never empty. */
static bool opt_store(options *o, const char *k, const char *v)
{
    if (o->store != NULL) {
        return bad_option(k, v, "the store is already given: use one --store (or --db)");
    }
    if (*v == '\0') {
        return bad_option(k, "\"\"", "empty store");
    }
    bool db = strcmp(k, "--db") == 0;
    if (db && is_postgres_url(v)) {
        return bad_option(k, v, "--db takes an LMDB directory; use --store for PostgreSQL");
    }
    o->pg = !db && (is_postgres_url(v) || strchr(v, '=') != NULL);
    o->store = v;
    return true;
}

static bool parse_option(options *o, const char *k, const char *v)
{
    uint64_t n;
    if (strcmp(k, "--listen") == 0) {
        o->listen = v;
    } else if (strcmp(k, "--store") == 0 || strcmp(k, "--db") == 0) {
        return opt_store(o, k, v);
    } else if (strcmp(k, "--seed") == 0) {
        return opt_uint(k, v, UINT64_MAX, &o->faults.seed);
    } else if (strcmp(k, "--fail-rate") == 0) {
        return opt_rate(k, v, &o->faults.fail_rate);
    } else if (strcmp(k, "--redeliver-rate") == 0) {
        return opt_rate(k, v, &o->faults.redeliver_rate);
    } else if (strcmp(k, "--crash-at") == 0) {
        if (strcmp(v, "consume") != 0 && strcmp(v, "before_ack") != 0) {
            return bad_option(k, v, "not consume or before_ack");
        }
        o->faults.crash_at = v;
    } else if (strcmp(k, "--crash-on") == 0) {
        if (!opt_uint(k, v, UINT32_MAX, &n)) {
            return false;
        }
        o->faults.crash_on = (unsigned)n;
    } else if (strcmp(k, "--create-delay-ms") == 0) {
        if (!opt_uint(k, v, 60000, &n)) {
            return false;
        }
        o->faults.create_delay_ms = (unsigned)n;
    } else if (strcmp(k, "--lease-ms") == 0) {
        return opt_uint(k, v, UINT32_MAX, &o->lease_ms);
    } else if (strcmp(k, "--nats") == 0) {
        o->nats_url = v;
    } else if (strcmp(k, "--nats-stream") == 0) {
        if (*v == '\0' || strlen(v) >= PAY_MAX_FIELD || strpbrk(v, ". *>") != NULL) {
            return bad_option(k, v, "a stream name: 1..63 bytes without '.', ' ', '*', '>'");
        }
        o->nats_stream = v;
    } else {
        return bad_option(k, v, "unknown option");
    }
    return true;
}

static bool parse_options(int argc, char **argv, options *o)
{
    memset(o, 0, sizeof(*o));
    o->faults.crash_on = 1;
    if (argc % 2 == 0) {
        fprintf(stderr, "idemrpc-payments: %s needs a value\n", argv[argc - 1]);
        return false;
    }
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!parse_option(o, argv[i], argv[i + 1])) {
            return false;
        }
    }
    if (o->listen == NULL || o->store == NULL) {
        fprintf(stderr, "idemrpc-payments: --listen and --store (or --db) are required\n");
        return false;
    }
    return true;
}

typedef struct method {
    const char *name;
    idem_handler_fn fn;
    idem_method_opts opts;
} method;

static idem_code register_methods(idem_server *srv, pay_service *svc)
{
    const unsigned tx = IDEM_METHOD_TRANSACTIONAL;
    const method methods[] = {
        {"pay.Order/Create", pay_order_create, {.flags = tx | IDEM_METHOD_TOKEN_REQUIRED}},
        {"pay.Order/Cancel", pay_order_cancel, {.flags = tx}},
        {"pay.Order/Refund",
         pay_order_refund,
         {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED}},
        {"pay.Callback/Notify", pay_callback_notify, {.flags = tx, .extractor = pay_notify_key}},
        {"pay.Merchant/Settle", pay_merchant_settle, {.flags = tx}},
        /* its own fenced txn under the lock: claim mode, not transactional */
        {"pay.Merchant/SettleDay",
         pay_merchant_settle_day,
         {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED}},
        /* reads: idempotent by nature, nothing to cache */
        {"pay.Order/Get", pay_order_get, {0}},
        {"pay.Order/Count", pay_order_count, {0}},
        {"pay.Account/Balance", pay_account_balance, {0}},
        {"pay.Commission/Drain", pay_commission_drain, {0}},
    };
    for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++) {
        idem_code code =
            idem_server_register(srv, methods[i].name, methods[i].fn, svc, &methods[i].opts);
        if (code != IDEM_OK) {
            return code;
        }
    }
    return IDEM_OK;
}

/* LMDB: creates the business databases up front, so that the read methods never write.
 * PostgreSQL: creates the service's own tables (the key-value data needs nothing). */
static idem_code prepare_store(idem_txn *t, void *arg)
{
    (void)arg;
    if (idem_txn_pg_conn(t) != NULL) {
        return pay_sql_create_tables(t);
    }
    static const char *const dbs[] = {PAY_DB_ORDERS, PAY_DB_SEQ,    PAY_DB_BALANCES,
                                      PAY_DB_OUTBOX, "order_state", IDEM_CONSUME_DB,
                                      IDEM_OUTBOX_DB};
    const void *v;
    size_t n;
    for (size_t i = 0; i < sizeof(dbs) / sizeof(dbs[0]); i++) {
        idem_code code = idem_txn_get(t, dbs[i], "-", 1, &v, &n);
        if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
            return code;
        }
    }
    return IDEM_OK;
}

static int service_init(pay_service *svc, const options *o)
{
    pthread_condattr_t ca;
    memset(svc, 0, sizeof(*svc));
    svc->faults = o->faults;
    if (pthread_mutex_init(&svc->mu, NULL) != 0 || pthread_condattr_init(&ca) != 0 ||
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&svc->cv, &ca) != 0) {
        return -1;
    }
    pthread_condattr_destroy(&ca);
    if ((svc->nats_url = o->nats_url) != NULL) {
        const char *stream = o->nats_stream != NULL ? o->nats_stream : "PAY";
        snprintf(svc->nats_stream, sizeof(svc->nats_stream), "%s", stream);
        snprintf(svc->nats_subject, sizeof(svc->nats_subject), "%s.commission", stream);
        snprintf(svc->nats_dead, sizeof(svc->nats_dead), "%s.dead", stream);
    }
    idem_pg_opts pg = {.pool_size = PG_POOL};
    svc->pg = o->pg;
    idem_code code = o->pg ? idem_store_open_postgres_ex(&svc->store, o->store, &pg)
                           : idem_store_open_lmdb(&svc->store, o->store, 0, 0);
    if (code != IDEM_OK) {
        return -1;
    }
    return idem_store_run_txn(svc->store, prepare_store, NULL) == IDEM_OK ? 0 : -1;
}

static int serve(pay_service *svc, const options *o)
{
    idem_server_opts so;
    idem_server *srv;
    sigset_t stop;
    int sig;
    idem_server_opts_init(&so);
    so.store = svc->store;
    so.lease_ms = o->lease_ms;
    so.workers = o->pg ? PG_WORKERS : 0;
    if (idem_server_create(&srv, &so) != IDEM_OK) {
        return -1;
    }
    if (register_methods(srv, svc) != IDEM_OK || idem_server_listen(srv, o->listen) != IDEM_OK ||
        pay_commission_start(svc) != IDEM_OK) {
        idem_server_destroy(srv);
        return -1;
    }
    printf("ready\n");
    fflush(stdout);
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    sigwait(&stop, &sig);
    pay_commission_stop(svc);
    idem_server_destroy(srv);
    return 0;
}

int main(int argc, char **argv)
{
    options o;
    pay_service svc;
    sigset_t stop;
    if (!parse_options(argc, argv, &o)) {
        fprintf(stderr, "usage: idemrpc-payments --listen URL --store DIR|postgres://...|CONNINFO "
                        "[--seed N] [--fail-rate P] [--redeliver-rate P] "
                        "[--crash-at consume|before_ack] [--crash-on N] [--create-delay-ms N] "
                        "[--lease-ms N] [--nats URL [--nats-stream NAME]]\n");
        return 2;
    }
    /* Block the stop signals before any thread starts, so that only sigwait sees them. */
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    int rc = service_init(&svc, &o);
    if (rc == 0) {
        rc = serve(&svc, &o);
    }
    if (rc != 0) {
        fprintf(stderr, "idemrpc-payments: %s\n", pay_errmsg());
    }
    idem_store_close(svc.store);
    pthread_cond_destroy(&svc.cv);
    pthread_mutex_destroy(&svc.mu);
    return rc == 0 ? 0 : 1;
}

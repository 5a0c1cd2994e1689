/* idemrpc-payments: serves the pay.* methods on one LMDB store.
 *
 *   idemrpc-payments --listen URL --db DIR [--seed N] [--fail-rate P]
 *                    [--redeliver-rate P] [--crash-at consume|before_ack] [--crash-on N]
 *                    [--create-delay-ms N] [--lease-ms N]
 *
 * Prints "ready" on stdout once it listens; SIGTERM or SIGINT stops it cleanly. The
 * fault options drive the tests' at-least-once harness (README.md). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "payments.h"

typedef struct options {
    const char *listen, *db;
    uint64_t lease_ms;
    pay_faults faults;
} options;

static bool parse_options(int argc, char **argv, options *o)
{
    memset(o, 0, sizeof(*o));
    o->faults.crash_on = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (strcmp(k, "--listen") == 0) {
            o->listen = v;
        } else if (strcmp(k, "--db") == 0) {
            o->db = v;
        } else if (strcmp(k, "--seed") == 0) {
            o->faults.seed = strtoull(v, NULL, 10);
        } else if (strcmp(k, "--fail-rate") == 0) {
            o->faults.fail_rate = strtod(v, NULL);
        } else if (strcmp(k, "--redeliver-rate") == 0) {
            o->faults.redeliver_rate = strtod(v, NULL);
        } else if (strcmp(k, "--crash-at") == 0) {
            o->faults.crash_at = v;
        } else if (strcmp(k, "--crash-on") == 0) {
            o->faults.crash_on = (unsigned)strtoul(v, NULL, 10);
        } else if (strcmp(k, "--create-delay-ms") == 0) {
            o->faults.create_delay_ms = (unsigned)strtoul(v, NULL, 10);
        } else if (strcmp(k, "--lease-ms") == 0) {
            o->lease_ms = strtoull(v, NULL, 10);
        } else {
            return false;
        }
    }
    return o->listen != NULL && o->db != NULL && (argc % 2) == 1;
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

/* Creates the business databases up front, so that the read methods never write. */
static idem_code touch_dbs(idem_txn *t, void *arg)
{
    (void)arg;
    static const char *const dbs[] = {PAY_DB_ORDERS, PAY_DB_SEQ,    PAY_DB_BALANCES,
                                      PAY_DB_OUTBOX, "order_state", IDEM_CONSUME_DB};
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
    if (idem_store_open_lmdb(&svc->store, o->db, 0, 0) != IDEM_OK) {
        return -1;
    }
    return idem_store_run_txn(svc->store, touch_dbs, NULL) == IDEM_OK ? 0 : -1;
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
        fprintf(stderr, "usage: idemrpc-payments --listen URL --db DIR [--seed N] "
                        "[--fail-rate P] [--redeliver-rate P] [--crash-at consume|before_ack] "
                        "[--crash-on N] [--create-delay-ms N] [--lease-ms N]\n");
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
        fprintf(stderr, "idemrpc-payments: %s\n", idem_errmsg());
    }
    idem_store_close(svc.store);
    pthread_cond_destroy(&svc.cv);
    pthread_mutex_destroy(&svc.mu);
    return rc == 0 ? 0 : 1;
}

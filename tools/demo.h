/* idemrpc-demo's state and methods (demo_methods.c), shared with its main
 * (idemrpc-demo.c: the command line, the stores, the server). */
#ifndef IDEMRPC_DEMO_H
#define IDEMRPC_DEMO_H

#include <pthread.h>

#include <idemrpc/idemrpc.h>

typedef struct demo {
    pthread_mutex_t mu;
    long long total;
    unsigned long orders;
    long delay_ms; /* --delay-ms: makes Add slow, to show duplicates waiting */
    long flaky;    /* --flaky: this many executions answer UNAVAILABLE first */
} demo;

/* Registers demo.Counter/Add, demo.Counter/Get, demo.Order/Submit and demo.Pay/Notify
 * on srv, with d as their state. */
idem_code demo_register(idem_server *srv, demo *d);

/* --nats URL (demo_nats.c): a consumer and the outbox relay on the server's store and
 * /metrics; false (after saying why) when the broker refuses. Stop them before
 * idem_server_destroy, which closes the store they use. */
typedef struct demo_nats {
    struct idem_nats_consumer *c;
    struct idem_nats_relay *r;
    unsigned c_id, r_id; /* their metrics sources (0: none) */
} demo_nats;
bool demo_nats_start(demo_nats *n, idem_server *srv, const char *url);
void demo_nats_stop(demo_nats *n, idem_server *srv);

#endif

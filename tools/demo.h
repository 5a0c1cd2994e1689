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

#endif

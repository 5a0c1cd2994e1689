/* The re-driver (redriver.c): finishes calls of IDEM_METHOD_STEPS methods whose owner
 * died, without waiting for a client retry. Off unless idem_server_opts says. */
#ifndef IDEMRPC_REDRIVER_H
#define IDEMRPC_REDRIVER_H

#include "dispatch.h"

typedef struct idem_redriver idem_redriver;

typedef struct idem_redriver_cfg {
    idem_dispatch *dispatch; /* runs the calls, on the re-driver's own thread */
    idem_store *store;
    idem_runtime *rt;
    const idem_method *(*find_method)(void *arg, const char *name);
    void *find_arg;
    uint64_t interval_ms; /* between passes */
    size_t batch;         /* journaled calls looked at per pass */
    uint64_t run_ms;      /* the deadline a re-run call gets, unless its method says */
    unsigned max_runs;    /* re-runs per call */
} idem_redriver_cfg;

idem_code idem__redriver_start(idem_redriver **out, const idem_redriver_cfg *cfg);
/* One whole pass now (idem__periodic_run_now). */
void idem__redriver_run_now(idem_redriver *r);
/* Wakes the thread, waits for a call it is running, joins and frees; NULL is a no-op.
 * Stop the dispatcher first: that ends a re-run's wait as a duplicate. */
void idem__redriver_stop(idem_redriver *r);

#endif

/* The runtime: what every call may use, owned by the server and handed to each call
 * (idem_call.rt). This is the one interface through which the interceptors, the toolkit,
 * the dispatcher and the client reach the server's shared services: the clock
 * (idem__rt_now_ms), counters and logs (observe.c), and the in-flight table of the
 * dispatch layer (inflight.h: parked duplicates and the lease keeper). The server fills
 * it at create (server.c); nothing below the server calls up into it. */
#ifndef IDEMRPC_RUNTIME_H
#define IDEMRPC_RUNTIME_H

#include <stdbool.h>
#include <stdint.h>

typedef struct idem_call idem_call;
typedef struct idem_observer idem_observer;

/* The wall clock the library's lease and expiry arithmetic uses (ms since the epoch);
 * tests inject a skewed one. */
typedef struct idem_clock {
    uint64_t (*now_ms)(void *arg);
    void *arg;
} idem_clock;

typedef struct idem_inflight idem_inflight; /* dispatch/inflight.h */

/* What every call may use, owned by the server: the clock, counters and logs, and the
 * in-flight table. Each built-in interceptor has a configuration of its own (call.h). */
typedef struct idem_runtime {
    idem_clock clock;
    idem_observer *obs;
    idem_inflight *inflight; /* keyed waiters and the lease keeper (inflight.c) */
    /* Every interceptor before result_cache is a built-in that only tail-calls, so a
     * waiting duplicate can leave the chain and resume at result_cache later. */
    bool can_park;
    /* The server runs a re-driver: journaled calls are listed for it (steps.c). */
    bool redrive;
    /* Hands back a call suspended with IDEM__SUSPEND_RECORD once its commit has ended
     * (idem__call_recorded): the dispatcher queues it for a worker. NULL: no call is
     * suspended so; its outcome is committed on the worker's thread. */
    void (*resume)(void *arg, idem_call *call);
    void *resume_arg;
} idem_runtime;

/* The runtime's wall clock: rt->clock, ms since the epoch. */
uint64_t idem__rt_now_ms(const idem_runtime *rt);
/* The default clock (idem__now_ms); arg is unused. */
uint64_t idem__system_clock(void *arg);

#endif

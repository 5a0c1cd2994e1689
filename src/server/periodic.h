/* A thread that runs one function every interval until stopped (periodic.c): the
 * sweeper's and the re-driver's. */
#ifndef IDEMRPC_PERIODIC_H
#define IDEMRPC_PERIODIC_H

#include "call.h"

typedef struct idem_periodic idem_periodic;

typedef void (*idem_periodic_fn)(void *arg, idem_periodic *p);

/* Calls fn(arg, p) every interval_ms (first after one interval) on a thread of its own;
 * what names the thread in the error. */
idem_code idem__periodic_start(idem_periodic **out, uint64_t interval_ms, idem_periodic_fn fn,
                               void *arg, const char *what);
/* For fn: true once stop was asked (end a long pass early). */
bool idem__periodic_stopping(idem_periodic *p);
/* Runs fn now on the thread (not after the interval) and waits until a whole run that
 * started after this call has ended; returns at once when stopping. For tests. */
void idem__periodic_run_now(idem_periodic *p);
/* Wakes the thread, waits for a running fn, joins and frees; NULL is a no-op. */
void idem__periodic_stop(idem_periodic *p);

#endif

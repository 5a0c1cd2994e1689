/* The sweeper (sweeper.c): a thread deleting expired records in bounded batches. */
#ifndef IDEMRPC_SWEEPER_H
#define IDEMRPC_SWEEPER_H

#include "call.h"

typedef struct idem_sweeper idem_sweeper;

/* Sweeps store every interval_ms, batch records per write txn, until stopped. */
idem_code idem__sweeper_start(idem_sweeper **out, idem_store *store, uint64_t interval_ms,
                              size_t batch, idem_observer *obs);
/* Wakes and joins the thread, then frees it; NULL is a no-op. */
void idem__sweeper_stop(idem_sweeper *s);

#endif

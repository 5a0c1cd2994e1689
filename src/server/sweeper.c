/* The sweeper: deletes expired records and tokens in bounded batches, so that a store's
 * size follows rate × TTL. One thread per server (periodic.c); stopping wakes it. */
#include <stdio.h>
#include <stdlib.h>

#include "periodic.h"
#include "sweeper.h"

struct idem_sweeper {
    idem_store *store;
    size_t batch;
    idem_observer *obs;
    idem_periodic *thread;
};

/* One sweep: batches until a batch comes back short (nothing more is due). */
static void sweep_due(void *arg, idem_periodic *p)
{
    idem_sweeper *s = arg;
    size_t deleted;
    do {
        if (idem_store_sweep(s->store, idem__now_ms(), s->batch, &deleted) != IDEM_OK) {
            char msg[IDEM_LOGQ_CAP], detail[IDEM_LOGQ_CAP];
            snprintf(detail, sizeof(detail), "sweep failed: %s", idem_errmsg());
            idem__log(s->obs, IDEM_LOG_ERROR, "msg=%s",
                      idem__logfmt_quote(msg, sizeof(msg), detail));
            return;
        }
    } while (deleted == s->batch && !idem__periodic_stopping(p));
}

idem_code idem__sweeper_start(idem_sweeper **out, idem_store *store, uint64_t interval_ms,
                              size_t batch, idem_observer *obs)
{
    idem_sweeper *s = calloc(1, sizeof(*s));
    *out = NULL;
    if (s == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    *s = (idem_sweeper){.store = store, .batch = batch, .obs = obs};
    idem_code code = idem__periodic_start(&s->thread, interval_ms, sweep_due, s, "sweeper");
    if (code != IDEM_OK) {
        free(s);
        return code;
    }
    *out = s;
    return IDEM_OK;
}

void idem__sweeper_stop(idem_sweeper *s)
{
    if (s != NULL) {
        idem__periodic_stop(s->thread);
        free(s);
    }
}

/* The sweeper: deletes expired records and tokens in bounded batches, so that a store's
 * size follows rate × TTL, then reads the store's size and outbox for GET /metrics. One
 * thread per server (periodic.c); stopping wakes it. */
#include <stdio.h>
#include <stdlib.h>

#include "periodic.h"
#include "sweeper.h"

struct idem_sweeper {
    idem_store *store;
    size_t batch;
    idem_observer *obs;
    idem_periodic *thread;
    uint64_t outbox_head, outbox_head_since_ms; /* the oldest message and when first seen */
};

/* One ERROR line: what failed, then the store's error detail. */
static void log_failure(idem_sweeper *s, const char *what)
{
    char msg[IDEM_LOGQ_CAP], detail[IDEM_LOGQ_CAP];
    snprintf(detail, sizeof(detail), "%s failed: %s", what, idem_errmsg());
    idem__log(s->obs, IDEM_LOG_ERROR, "msg=%s", idem__logfmt_quote(msg, sizeof(msg), detail));
}

/* How long the outbox's oldest message has been its oldest, as the sweeps saw it (its
 * put time is not stored): 0 for an empty outbox. */
static idem_code outbox_age(idem_sweeper *s, uint64_t now, idem__store_gauges *g)
{
    idem_outbox_msg m;
    size_t n = 0;
    idem_code code = idem_outbox_pending(s->store, &g->outbox_pending);
    if (code == IDEM_OK && g->outbox_pending > 0) {
        code = idem_outbox_peek(s->store, &m, 1, &n);
    }
    if (code != IDEM_OK || n == 0) {
        s->outbox_head_since_ms = 0;
        return code;
    }
    if (s->outbox_head_since_ms == 0 || m.seq != s->outbox_head) {
        s->outbox_head = m.seq;
        s->outbox_head_since_ms = now;
    }
    g->outbox_oldest_age_ms = now - s->outbox_head_since_ms;
    idem_outbox_msgs_free(&m, 1);
    return IDEM_OK;
}

/* The store's size and outbox into the observer's gauges (GET /metrics). */
static void read_gauges(idem_sweeper *s)
{
    idem_store_stats st;
    idem__store_gauges g = {0};
    idem_code code = idem_store_stats_get(s->store, &st);
    if (code == IDEM_OK) {
        g = (idem__store_gauges){.in_progress = st.in_progress,
                                 .completed = st.completed,
                                 .tombstones = st.tombstones,
                                 .map_size = st.map_size,
                                 .map_used = st.map_used};
        code = outbox_age(s, idem__mono_ms(), &g);
    }
    if (code != IDEM_OK) {
        log_failure(s, "reading the store's size and outbox");
        idem__observe_store_failure(s->obs);
        return;
    }
    idem__observe_store(s->obs, &g);
}

/* One sweep: batches until a batch comes back short (nothing more is due); then the
 * gauges. */
static void sweep_due(void *arg, idem_periodic *p)
{
    idem_sweeper *s = arg;
    size_t deleted;
    do {
        if (idem_store_sweep(s->store, idem__now_ms(), s->batch, &deleted) != IDEM_OK) {
            log_failure(s, "sweep");
            break;
        }
    } while (deleted == s->batch && !idem__periodic_stopping(p));
    read_gauges(s);
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

/* A consumer's and a relay's counts on a server's GET /metrics (nats.h,
 * idem_server_add_nats_consumer / _relay): a metrics source each (server.h), which reads
 * the counts under their own lock (idem_nats_consumer_stats, idem_nats_relay_stats). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#include "idemrpc/nats.h"

typedef struct nats_source {
    idem_nats_consumer *c; /* one of the two */
    idem_nats_relay *r;
    char name[IDEM_MAX_CONSUMER_GROUP + 1];
} nats_source;

typedef struct series {
    const char *name, *help;
    bool counter;
} series;

static const series consumer_series[] = {
    {"idem_nats_deliveries_total", "Deliveries the consumer fetched (redeliveries included).",
     true},
    {"idem_nats_committed_total", "Messages whose handler ran and whose transaction committed.",
     true},
    {"idem_nats_duplicates_total", "Deliveries acked without running: consumed before.", true},
    {"idem_nats_acks_total", "Acks the broker confirmed.", true},
    {"idem_nats_ack_failures_total",
     "Acks the broker did not confirm (redelivered as a "
     "duplicate).",
     true},
    {"idem_nats_naks_total", "Transient failures, naked for a redelivery.", true},
    {"idem_nats_dead_letters_total",
     "Messages published to the dead-letter subject and "
     "terminated.",
     true},
    {"idem_nats_dead_letter_failures_total",
     "Dead-letter publishes that failed (the message "
     "was naked).",
     true},
    {"idem_nats_dead_letters_refused_total",
     "Dead letters the broker refused for good: "
     "terminated without one.",
     true},
};

static const series relay_series[] = {
    {"idem_relay_published_total", "Outbox messages the broker acked (stored).", true},
    {"idem_relay_duplicates_total", "Publishes the broker's duplicate window dropped.", true},
    {"idem_relay_removed_total", "Messages removed from the outbox after their ack.", true},
    {"idem_relay_failures_total", "Publishes or removals that failed (the message stays).", true},
    {"idem_relay_parked_total", "Messages the broker refused for good, parked.", true},
    {"idem_relay_kept", "Acked messages kept while the broker may still lose them.", false},
    {"idem_relay_kept_age_seconds", "How long ago the oldest kept message was acked.", false},
    {"idem_relay_losses_total", "Times the broker came back without a kept message.", true},
    {"idem_relay_restored_total", "Kept messages put back into the outbox after a loss.", true},
    {"idem_relay_connected", "1 while the relay is connected to the broker, else 0.", false},
};

static size_t fill(const nats_source *ns, const series *s, const double *v, size_t n,
                   idem_metric *out, size_t max)
{
    size_t i = 0;
    for (; i < n && i < max; i++) {
        out[i] = (idem_metric){s[i].name, s[i].help, s[i].counter, ns->c ? "consumer" : "relay",
                               ns->name,  v[i]};
    }
    return i;
}

static size_t consumer_metrics(void *arg, idem_metric *out, size_t max)
{
    const nats_source *ns = arg;
    idem_nats_stats st;
    idem_nats_consumer_stats(ns->c, &st);
    const double v[] = {st.fetched,       st.committed,     st.duplicates,
                        st.acked,         st.ack_failures,  st.naked,
                        st.dead_lettered, st.dead_failures, st.dead_refused};
    _Static_assert(IDEM_ARRAY_LEN(v) == IDEM_ARRAY_LEN(consumer_series), "a value per series");
    return fill(ns, consumer_series, v, IDEM_ARRAY_LEN(v), out, max);
}

static size_t relay_metrics(void *arg, idem_metric *out, size_t max)
{
    const nats_source *ns = arg;
    idem_nats_relay_counts rc;
    idem_nats_relay_stats(ns->r, &rc);
    const double v[] = {rc.published,
                        rc.duplicates,
                        rc.removed,
                        rc.failures,
                        rc.parked,
                        rc.kept,
                        (double)rc.kept_age_ms / 1000.0,
                        rc.losses,
                        rc.restored,
                        rc.connected};
    _Static_assert(IDEM_ARRAY_LEN(v) == IDEM_ARRAY_LEN(relay_series), "a value per series");
    return fill(ns, relay_series, v, IDEM_ARRAY_LEN(v), out, max);
}

static idem_code add_source(idem_server *srv, nats_source *ns, const char *name, idem_metrics_fn fn,
                            unsigned *id)
{
    size_t len = name != NULL ? strnlen(name, IDEM_MAX_CONSUMER_GROUP + 1) : 0;
    if (srv == NULL || (ns->c == NULL && ns->r == NULL) || len == 0 ||
        len > IDEM_MAX_CONSUMER_GROUP) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "metrics of a consumer or relay need a server, "
                         "the consumer or relay, and a name of 1..%d "
                         "bytes",
                         IDEM_MAX_CONSUMER_GROUP);
    }
    nats_source *copy = malloc(sizeof(*copy));
    if (copy == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    *copy = *ns;
    memcpy(copy->name, name, len);
    copy->name[len] = '\0';
    idem_code code = idem_server_add_metrics(srv, fn, copy, free, id);
    if (code != IDEM_OK) {
        free(copy);
    }
    return code;
}

idem_code idem_server_add_nats_consumer(idem_server *srv, idem_nats_consumer *c, const char *name,
                                        unsigned *id)
{
    nats_source ns = {.c = c};
    return add_source(srv, &ns, name, consumer_metrics, id);
}

idem_code idem_server_add_nats_relay(idem_server *srv, idem_nats_relay *r, const char *name,
                                     unsigned *id)
{
    nats_source ns = {.r = r};
    return add_source(srv, &ns, name, relay_metrics, id);
}

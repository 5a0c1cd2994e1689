/* The outbox relay (nats.h): outbox → JetStream → removal. Invariant: a message leaves
 * the outbox only after the broker acked its publish (stored, or dropped as a duplicate
 * of one it stored), so a crash anywhere publishes it again, never loses it; or parked
 * (kept in the store) when the broker refuses it for good (too large; or a subject no
 * stream takes, which JetStream itself said NOWHERE_ROUNDS rounds in a row), so that it
 * never holds back the messages behind it. The broker's max_payload is recorded in the
 * store for idem_outbox_put, which then refuses what could never be published. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_internal.h"

#define DEFAULT_BATCH 64
#define DEFAULT_IDLE_MS 100
#define DEFAULT_PUBLISH_WAIT_MS 5000
#define NOWHERE_ROUNDS 5 /* rounds JetStream says no stream takes a subject: refused for good */

struct idem_nats_relay {
    idem_store *st;
    idem_nats_relay_opts o;
    char *url;
    natsConnection *nc;
    jsCtx *js;
    idem_outbox_msg *msgs; /* batch slots */
    uint64_t *seqs;        /* acked this round */
    uint64_t *parked;      /* refused for good this round */
    size_t n_parked;
    int64_t limit;        /* the max_payload recorded in the store (0: none yet) */
    uint64_t nowhere_seq; /* the message that no stream took, */
    unsigned nowhere;     /* in that many rounds in a row */
    idem__nats_loop loop; /* its mu guards stats */
    idem_nats_relay_counts stats;
};

static void add(idem_nats_relay *r, uint64_t *counter, uint64_t n)
{
    idem__nats_add(&r->loop, counter, n);
}

static idem_code publish_one(idem_nats_relay *r, const idem_outbox_msg *m, bool *duplicate,
                             natsStatus *status)
{
    natsMsg *nm = NULL;
    natsStatus s = natsMsg_Create(&nm, m->subject, NULL, m->data, (int)m->len);
    if (s == NATS_OK) {
        s = natsMsgHeader_Set(nm, IDEM_NATS_MSG_ID_HEADER, m->msg_id);
    }
    if (s == NATS_OK) {
        s = natsMsgHeader_Set(nm, IDEM_NATS_KEY_HEADER, m->msg_id);
    }
    *status = s;
    idem_code code = s == NATS_OK
                         ? idem__nats_publish(r->js, nm, "nats relay: publish", duplicate, status)
                         : idem__nats_code(s, 0, "nats relay: message");
    natsMsg_Destroy(nm);
    return code;
}

/* A message the broker refuses for good (OUT_OF_RANGE: over its max_payload or the
 * stream's max_msg_size): logged, parked after this round (and counted then). */
static void refused(idem_nats_relay *r, const idem_outbox_msg *m)
{
    r->parked[r->n_parked++] = m->seq;
    idem__nats_log(r->o.log_fn, r->o.log_arg, IDEM_LOG_ERROR,
                   "nats relay: parking seq=%llu msg_id=%s subject=%s (%zu bytes): %s",
                   (unsigned long long)m->seq, m->msg_id, m->subject, m->len, idem_errmsg());
}

/* A publish nothing answered: its subject is taken by no stream, or JetStream is away (a
 * broker restarting, JetStream not up yet) and says nothing. Only JetStream answering
 * that no stream takes it counts, and only NOWHERE_ROUNDS rounds in a row for the same
 * message make it a refusal for good (then idem_errmsg() says why). */
static bool taken_by_no_stream(idem_nats_relay *r, const idem_outbox_msg *m)
{
    int64_t max_msg_size;
    idem_errkeep k;
    idem__err_keep(&k);
    idem_code code = idem__nats_stream_of(r->js, m->subject, &max_msg_size);
    if (code != IDEM_NOT_FOUND || r->nowhere_seq != m->seq) {
        r->nowhere_seq = m->seq;
        r->nowhere = 0;
    }
    if (code != IDEM_NOT_FOUND || ++r->nowhere < NOWHERE_ROUNDS) {
        idem__err_put(&k, IDEM_OK); /* the publish's failure */
        return false;
    }
    r->nowhere = 0;
    idem__err(IDEM_OUT_OF_RANGE,
              "no stream takes subject %s (JetStream said so %d rounds in a row)", m->subject,
              NOWHERE_ROUNDS);
    return true;
}

/* Publishes msgs[0..n) in order until one fails, passing over those the broker refuses
 * for good; *acked = how many the broker acked. */
static idem_code publish_batch(idem_nats_relay *r, size_t n, size_t *acked)
{
    idem_code code = IDEM_OK;
    bool duplicate;
    natsStatus s;
    *acked = 0;
    for (size_t i = 0; i < n; i++) {
        const idem_outbox_msg *m = &r->msgs[i];
        code = publish_one(r, m, &duplicate, &s);
        if (code == IDEM_OUT_OF_RANGE || (s == NATS_NO_RESPONDERS && taken_by_no_stream(r, m))) {
            refused(r, m);
            code = IDEM_OK;
            continue;
        }
        if (code != IDEM_OK) {
            add(r, &r->stats.failures, 1);
            break;
        }
        add(r, duplicate ? &r->stats.duplicates : &r->stats.published, 1);
        r->seqs[(*acked)++] = m->seq;
        if (r->o.on_published != NULL) {
            r->o.on_published(m, duplicate, r->o.event_arg);
        }
    }
    return code;
}

/* Records the broker's max_payload in the store when it is new (open, a reconnect to a
 * broker configured otherwise). */
static idem_code limit_sync(idem_nats_relay *r)
{
    int64_t max_payload = natsConnection_GetMaxPayload(r->nc);
    if (max_payload <= 0 || max_payload == r->limit) {
        return IDEM_OK;
    }
    idem_code code = idem_outbox_set_broker_limit(r->st, (uint64_t)max_payload);
    if (code == IDEM_OK) {
        r->limit = max_payload;
    }
    return code;
}

idem_code idem_nats_relay_run_once(idem_nats_relay *r, unsigned *relayed)
{
    size_t n = 0, acked = 0;
    if (relayed != NULL) {
        *relayed = 0;
    }
    if (r == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats relay: NULL");
    }
    r->n_parked = 0;
    idem_code code = limit_sync(r);
    if (code == IDEM_OK) {
        code = idem_outbox_peek(r->st, r->msgs, r->o.batch, &n);
    }
    if (code == IDEM_OK && n > 0) {
        code = publish_batch(r, n, &acked);
    }
    idem_errkeep k;
    idem__err_keep(&k);
    idem_code removed = idem_outbox_remove(r->st, r->seqs, acked); /* only acked ones */
    if (removed == IDEM_OK && /* else they stay: refused again next round */
        (removed = idem_outbox_park(r->st, r->parked, r->n_parked)) == IDEM_OK) {
        add(r, &r->stats.parked, r->n_parked);
    }
    idem_outbox_msgs_free(r->msgs, n);
    if (removed != IDEM_OK) { /* they stay: published again next round, deduped */
        add(r, &r->stats.failures, 1);
        return removed;
    }
    add(r, &r->stats.removed, acked);
    if (relayed != NULL) {
        *relayed = (unsigned)acked;
    }
    return idem__err_put(&k, code);
}

/* ---- life cycle ---- */

void idem_nats_relay_opts_init(idem_nats_relay_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->batch = DEFAULT_BATCH;
    o->idle_ms = DEFAULT_IDLE_MS;
    o->publish_wait_ms = DEFAULT_PUBLISH_WAIT_MS;
}

idem_code idem_nats_relay_open(idem_nats_relay **out, idem_store *st, const idem_nats_relay_opts *o)
{
    idem_nats_relay *r;
    *out = NULL;
    if (st == NULL || o == NULL || o->url == NULL || o->batch < 1 ||
        o->batch > IDEM_OUTBOX_MAX_BATCH || o->idle_ms < 1 || o->publish_wait_ms < 1) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "nats relay: a store, a url, batch 1..%d, idle_ms and publish_wait_ms > 0",
                         IDEM_OUTBOX_MAX_BATCH);
    }
    if ((r = calloc(1, sizeof(*r))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "nats relay: out of memory");
    }
    r->st = st;
    r->o = *o;
    idem__nats_loop_init(&r->loop);
    r->url = strdup(o->url);
    r->msgs = calloc(o->batch, sizeof(*r->msgs));
    r->seqs = calloc(o->batch, sizeof(*r->seqs));
    r->parked = calloc(o->batch, sizeof(*r->parked));
    idem_code code = r->url == NULL || r->msgs == NULL || r->seqs == NULL || r->parked == NULL
                         ? idem__err(IDEM_RESOURCE_EXHAUSTED, "nats relay: out of memory")
                         : idem__nats_connect(r->url, o->publish_wait_ms, &r->nc, &r->js);
    if (code == IDEM_OK) { /* the store may be away: put assumes the default, rounds retry */
        (void)limit_sync(r);
    }
    if (code != IDEM_OK) {
        idem_errkeep k;
        idem__err_keep(&k);
        idem_nats_relay_close(r);
        return idem__err_put(&k, code);
    }
    r->o.url = r->url;
    *out = r;
    return IDEM_OK;
}

static void *relay_main(void *arg)
{
    idem_nats_relay *r = arg;
    uint64_t wait_ms = 0;
    bool failing = false;
    while (!idem__nats_loop_pause(&r->loop, wait_ms)) {
        unsigned n = 0;
        idem_code code = idem_nats_relay_run_once(r, &n);
        if (code != IDEM_OK && !failing) { /* once per outage */
            idem__nats_log(r->o.log_fn, r->o.log_arg, IDEM_LOG_ERROR,
                           "nats relay failed: %s; retrying", idem_errmsg());
        } else if (code == IDEM_OK && failing) {
            idem__nats_log(r->o.log_fn, r->o.log_arg, IDEM_LOG_ERROR, "nats relay back");
        }
        if (n > 0 && r->o.log_fn != NULL) { /* INFO only where the program asked for it */
            idem__nats_log(r->o.log_fn, r->o.log_arg, IDEM_LOG_INFO, "nats relay published=%u", n);
        }
        failing = code != IDEM_OK;
        /* More waiting: go on at once. Empty or failing: look again after idle_ms. */
        wait_ms = code == IDEM_OK && n == r->o.batch ? 0 : r->o.idle_ms;
    }
    return NULL;
}

idem_code idem_nats_relay_start(idem_nats_relay *r)
{
    if (r == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats relay: NULL");
    }
    return idem__nats_loop_start(&r->loop, relay_main, r, "nats relay");
}

void idem_nats_relay_stats(idem_nats_relay *r, idem_nats_relay_counts *out)
{
    pthread_mutex_lock(&r->loop.mu);
    *out = r->stats;
    pthread_mutex_unlock(&r->loop.mu);
}

void idem_nats_relay_close(idem_nats_relay *r)
{
    if (r == NULL) {
        return;
    }
    idem__nats_loop_fini(&r->loop); /* the thread first: it uses what follows */
    idem__nats_disconnect(r->nc, r->js);
    free(r->msgs);
    free(r->seqs);
    free(r->parked);
    free(r->url);
    free(r);
}

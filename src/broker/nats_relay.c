/* The outbox relay (nats.h): outbox → JetStream → kept → removal. Invariant: a message
 * leaves the outbox only after the broker acked its publish (stored, or dropped as a
 * duplicate of one it stored), so a crash anywhere publishes it again, never loses it; and
 * leaves the store only once the broker's sync interval has passed since that ack (kept
 * until then: a broker host that crashes loses what it acked and did not sync, and the
 * relay, finding the loss, puts every kept message back into the outbox); or parked
 * (kept in the store) when the broker refuses it for good (too large; or a subject no
 * stream takes, which JetStream itself said NOWHERE_ROUNDS rounds in a row), so that it
 * never holds back the messages behind it. The broker's max_payload is recorded in the
 * store for idem_outbox_put, which then refuses what could never be published. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_internal.h"
#include "toolkit_internal.h"

#define DEFAULT_BATCH 64
#define DEFAULT_IDLE_MS 100
#define DEFAULT_PUBLISH_WAIT_MS 5000
#define NOWHERE_ROUNDS 5 /* rounds JetStream says no stream takes a subject: refused for good */
#define DEFAULT_KEEP_MS 120000 /* nats-server's default sync_interval */
#define PROBE_WAIT_MS 1000     /* the broker's varz: a system user's only */

struct idem_nats_relay {
    idem_store *st;
    idem_nats_relay_opts o;
    char *url;
    natsConnection *nc;
    jsCtx *js;
    idem_outbox_msg *msgs; /* batch slots */
    uint64_t *seqs;        /* acked this round */
    idem_outbox_ack *acks; /* the same, with where the broker put them */
    uint64_t *parked;      /* refused for good this round */
    size_t n_parked;
    int64_t limit;            /* the max_payload recorded in the store (0: none yet) */
    uint64_t nowhere_seq;     /* the message that no stream took, */
    unsigned nowhere;         /* in that many rounds in a row */
    uint64_t keep_ms;         /* the horizon: 0 when the broker syncs every write */
    uint64_t reconnects;      /* the connection's, when the broker was last checked */
    bool checked;             /* the broker was checked for a loss since (re)connecting */
    bool lost;                /* it lost a kept message: restore them all before going on */
    bool unsure;              /* or some kept message could not be checked: the same */
    uint64_t answering_ms;    /* since when the broker answered every round (0: it did not) */
    uint64_t restores;        /* the store's restores before this round's peek */
    idem__nats_newest newest; /* per stream, the newest ack known to hold */
    idem__nats_loop loop;     /* its mu guards stats */
    idem_nats_relay_counts stats;
};

static void add(idem_nats_relay *r, uint64_t *counter, uint64_t n)
{
    idem__nats_add(&r->loop, counter, n);
}

static idem_code publish_one(idem_nats_relay *r, const idem_outbox_msg *m, bool *duplicate,
                             natsStatus *status, idem_outbox_ack *where)
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
    idem_code code = s == NATS_OK ? idem__nats_publish(r->js, nm, "nats relay: publish", duplicate,
                                                       status, where)
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

/* A publish the broker stored at or below the newest sequence it acked before in that
 * stream: it forgot that one (a stream's sequence only grows). */
static bool went_back(idem_nats_relay *r, const idem_outbox_ack *a)
{
    bool back = idem__nats_went_back(&r->newest, a);
    r->lost = r->lost || back;
    return back;
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
        idem_outbox_ack *a = &r->acks[*acked];
        code = publish_one(r, m, &duplicate, &s, a);
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
        a->seq = r->seqs[(*acked)++] = m->seq;
        if (r->o.on_published != NULL) {
            r->o.on_published(m, duplicate, r->o.event_arg);
        }
        if (!duplicate && went_back(r, a)) {
            break; /* the broker forgot: restore what it may have lost first */
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

static bool reconnects_of(idem_nats_relay *r, uint64_t *reconnects)
{
    natsStatistics *ns = NULL;
    bool ok = natsStatistics_Create(&ns) == NATS_OK &&
              natsConnection_GetStats(r->nc, ns) == NATS_OK &&
              natsStatistics_GetCounts(ns, NULL, NULL, NULL, NULL, reconnects) == NATS_OK;
    natsStatistics_Destroy(ns);
    return ok;
}

/* After each (re)connect, before any publish: how the broker syncs (the horizon), and
 * whether it lost the newest kept message of any stream. UNAVAILABLE, at once, while the
 * broker is away; so also before the first connect of an open made during an outage,
 * which is checked like a reconnect once made (reconnects are counted from then on). */
static idem_code check_broker(idem_nats_relay *r)
{
    uint64_t reconnects = 0, interval_ms;
    bool always;
    if (natsConnection_Status(r->nc) != NATS_CONN_STATUS_CONNECTED) {
        return idem__nats_code_on(r->nc, NATS_CONNECTION_DISCONNECTED, 0, "nats relay");
    }
    if (!reconnects_of(r, &reconnects)) {
        return idem__err(IDEM_INTERNAL, "nats relay: connection statistics");
    }
    if (r->checked && reconnects == r->reconnects) {
        return IDEM_OK;
    }
    r->keep_ms = r->o.keep_ms;
    if (idem__nats_sync_probe(r->nc, PROBE_WAIT_MS, &always, &interval_ms) == IDEM_OK) {
        r->keep_ms = always ? 0 : interval_ms > r->keep_ms ? interval_ms : r->keep_ms;
    }
    idem_code code = idem__nats_check_kept(r->js, r->st, &r->newest, &r->lost, &r->unsure);
    if (code == IDEM_OK) {
        r->checked = true;
        r->reconnects = reconnects;
    }
    return code;
}

/* After a loss: every kept message back into the outbox (newest first, all of them
 * before the next publish), published again in put order from the next peek on. */
static idem_code restore(idem_nats_relay *r)
{
    size_t n = 0;
    idem_code code = IDEM_OK;
    if (!r->lost) {
        return IDEM_OK;
    }
    idem__nats_log(r->o.log_fn, r->o.log_arg, IDEM_LOG_ERROR, "%s",
                   r->unsure ? "nats relay: kept messages of more streams than the store's "
                               "directory holds (or kept before it) cannot be checked one by "
                               "one; publishing every kept message again"
                             : "nats relay: the broker lost acked messages; publishing the "
                               "kept ones again");
    add(r, &r->stats.losses, r->unsure ? 0 : 1);
    do {
        code = idem_outbox_kept_restore(r->st, IDEM_OUTBOX_MAX_BATCH, &n);
        add(r, &r->stats.restored, n);
    } while (code == IDEM_OK && n > 0);
    if (code == IDEM_OK) {
        r->lost = r->unsure = false;
        r->newest.n = 0;
    }
    return code;
}

/* Kept messages acked at or before the bound may leave: the broker answered every round
 * for the horizon since then (keep_ms counts only while it runs: one stopped, or whose
 * host went down, synced nothing meanwhile; a restart is a reconnect, checked for a loss
 * before anything leaves). 0: none may. published: this round's publishes were acked. */
static uint64_t expiry_bound(idem_nats_relay *r, bool published, uint64_t now_ms)
{
    uint64_t reconnects = 0;
    bool answers =
        r->checked && reconnects_of(r, &reconnects) && reconnects == r->reconnects &&
        (published || natsConnection_FlushTimeout(r->nc, (int64_t)r->o.publish_wait_ms) == NATS_OK);
    if (!answers) {
        r->answering_ms = 0;
        return 0;
    }
    r->answering_ms = r->answering_ms != 0 ? r->answering_ms : now_ms;
    return now_ms - r->answering_ms >= r->keep_ms ? now_ms - r->keep_ms : 0;
}

/* The acked messages leave the outbox: kept, or removed when the broker syncs each write;
 * those kept longer than the horizon while the broker ran leave the store; the counts are
 * refreshed. */
static idem_code settle(idem_nats_relay *r, size_t acked, bool failed, uint64_t now_ms)
{
    idem_outbox_kept_info k;
    size_t dropped;
    uint64_t bound = 0;
    idem_code code = r->keep_ms == 0 ? idem_outbox_remove(r->st, r->seqs, acked)
                                     : idem__outbox_keep_since(r->st, r->acks, acked, now_ms,
                                                               r->restores);
    if (code == IDEM_OK) {
        code = idem_outbox_kept(r->st, &k);
    }
    if (code == IDEM_OK && k.count > 0) {
        bound = failed ? (r->answering_ms = 0) : expiry_bound(r, acked > 0, now_ms);
    }
    while (code == IDEM_OK && k.count > 0 && bound != 0 && k.oldest_ms <= bound) {
        code = idem_outbox_kept_expire(r->st, bound + 1, IDEM_OUTBOX_MAX_BATCH, &dropped);
        if (code == IDEM_OK) {
            code = idem_outbox_kept(r->st, &k);
        }
    }
    if (code == IDEM_OK) {
        pthread_mutex_lock(&r->loop.mu);
        r->stats.kept = k.count;
        r->stats.kept_age_ms = k.count > 0 && now_ms > k.oldest_ms ? now_ms - k.oldest_ms : 0;
        pthread_mutex_unlock(&r->loop.mu);
    }
    return code;
}

/* Runs of removed slots passed over per round, IDEM_OUTBOX_MAX_BATCH each at most. */
#define SKIP_PASSES 64

/* The next batch, past the removed slots a restore put in front of it (a peek looks
 * only 2·batch slots ahead). */
static idem_code peek_batch(idem_nats_relay *r, size_t *n)
{
    uint64_t pending = 0;
    bool moved = true;
    idem_code code = idem_outbox_peek(r->st, r->msgs, r->o.batch, n);
    if (code == IDEM_OK && *n == 0) {
        code = idem_outbox_pending(r->st, &pending);
    }
    for (int i = 0; code == IDEM_OK && *n == 0 && pending > 0 && moved && i < SKIP_PASSES; i++) {
        if ((code = idem__outbox_skip_removed(r->st, &moved)) == IDEM_OK && moved) {
            code = idem_outbox_peek(r->st, r->msgs, r->o.batch, n);
        }
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
    if (code == IDEM_OK && (code = check_broker(r)) == IDEM_OK) {
        code = restore(r);
    }
    if (code == IDEM_OK) { /* a restore after this one (another relay's): keep none */
        code = idem__outbox_restores(r->st, &r->restores);
    }
    if (code == IDEM_OK) {
        code = peek_batch(r, &n);
    }
    if (code == IDEM_OK && n > 0) {
        code = publish_batch(r, n, &acked);
    }
    idem_errkeep k;
    idem__err_keep(&k);
    idem_code removed = settle(r, acked, code != IDEM_OK, idem__now_ms()); /* only acked ones */
    if (removed == IDEM_OK && /* else they stay: refused again next round */
        (removed = idem_outbox_park(r->st, r->parked, r->n_parked)) == IDEM_OK) {
        add(r, &r->stats.parked, r->n_parked);
    }
    if (removed == IDEM_OK) { /* a publish found the loss: before the relay stops here */
        removed = restore(r);
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
    o->keep_ms = DEFAULT_KEEP_MS;
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
    r->o.keep_ms = o->keep_ms > 0 ? o->keep_ms : DEFAULT_KEEP_MS; /* 0: a program before it */
    idem__nats_loop_init(&r->loop);
    r->url = strdup(o->url);
    r->msgs = calloc(o->batch, sizeof(*r->msgs));
    r->seqs = calloc(o->batch, sizeof(*r->seqs));
    r->parked = calloc(o->batch, sizeof(*r->parked));
    r->acks = calloc(o->batch, sizeof(*r->acks));
    r->keep_ms = r->o.keep_ms;
    idem_code code =
        r->url == NULL || r->msgs == NULL || r->seqs == NULL || r->parked == NULL || r->acks == NULL
            ? idem__err(IDEM_RESOURCE_EXHAUSTED, "nats relay: out of memory")
            : idem__nats_connect_lazy(r->url, o->publish_wait_ms, &r->nc, &r->js);
    if (code == IDEM_OK) { /* the store or the broker may be away: the rounds retry */
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
    out->connected = natsConnection_Status(r->nc) == NATS_CONN_STATUS_CONNECTED;
}

void idem_nats_relay_close(idem_nats_relay *r)
{
    if (r == NULL) {
        return;
    }
    idem__nats_loop_fini(&r->loop); /* the thread first: it uses what follows */
    idem__nats_disconnect(r->nc, r->js);
    idem__nats_newest_fini(&r->newest);
    free(r->msgs);
    free(r->seqs);
    free(r->parked);
    free(r->acks);
    free(r->url);
    free(r);
}

/* A JetStream durable pull consumer whose messages take effect once (nats.h states the
 * rule). The life of one delivery is handle(): key → idem_consume → ack | nak | dead
 * letter. Invariant: a message is acked only after idem_consume answered ACK, i.e. its
 * effect and its marker are committed (now, or by an earlier delivery); every other
 * outcome naks it (redelivered later) or dead-letters it (published, then terminated). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_internal.h"

#include "idemrpc/toolkit.h"

#define DEFAULT_MAX_DELIVER 5
#define DEFAULT_ACK_WAIT_MS 30000
#define DEFAULT_BACKOFF_MS 100
#define DEFAULT_BACKOFF_MAX_MS 5000
#define DEFAULT_BATCH 16
#define DEFAULT_FETCH_WAIT_MS 500
#define API_WAIT_MS 5000 /* JetStream API calls, acks and dead-letter publishes */
#define REASON_MAX 384
#define N_STRS 7 /* the options' strings, copied */

struct idem_nats_consumer {
    idem_store *st;
    idem_nats_consumer_opts o; /* its strings point into strs */
    char *strs[N_STRS];
    natsConnection *nc;
    jsCtx *js;
    natsSubscription *sub;
    idem__nats_dead_bound dead_bound; /* what the dead letters' stream takes */
    idem__nats_progress progress;     /* the batch behind the message in hand */
    uint64_t ack_wait_ms;             /* the durable's own, read when binding */
    idem__nats_loop loop;             /* its mu guards stats */
    idem_nats_stats stats;
};

/* One delivery in hand. */
typedef struct delivery {
    idem_nats_consumer *c;
    natsMsg *m;
    idem_nats_msg im;
    char key[IDEM_MAX_MSG_KEY + 2];
    char reason[REASON_MAX];
    bool handler_failed; /* the handler ran and returned an error (else: the store did) */
    uint64_t failures;   /* the handler's real failures of this copy, this one included */
    /* im's headers and the handler's reason */
    idem__nats_room room;
} delivery;

static void count(idem_nats_consumer *c, uint64_t *counter)
{
    idem__nats_add(&c->loop, counter, 1);
}

static void emit(delivery *d, idem_nats_event ev, const char *reason)
{
    if (d->c->o.on_event != NULL) {
        d->c->o.on_event(ev, &d->im, reason, d->c->o.event_arg);
    }
}

static void delivery_init(delivery *d, idem_nats_consumer *c, natsMsg *m)
{
    jsMsgMetaData *meta = NULL;
    *d = (delivery){.c = c, .m = m};
    idem__nats_msg_room(&d->im, m, &d->room);
    d->im.subject = natsMsg_GetSubject(m);
    d->im.data = natsMsg_GetData(m);
    d->im.len = (size_t)natsMsg_GetDataLength(m);
    d->im.delivered = 1;
    if (natsMsg_GetMetaData(&meta, m) == NATS_OK) {
        d->im.stream_seq = meta->Sequence.Stream;
        d->im.delivered = meta->NumDelivered;
        jsMsgMetaData_Destroy(meta);
    }
}

/* The key from the payload (key_fn) or the headers; false with d->reason when none fits. */
static bool key_of(delivery *d)
{
    const idem_nats_consumer_opts *o = &d->c->o;
    const char *v = NULL;
    if (o->key_fn != NULL) {
        idem_code code = o->key_fn(d->im.data, d->im.len, d->key, sizeof(d->key), o->key_arg);
        d->key[sizeof(d->key) - 1] = '\0';
        if (code != IDEM_OK) {
            snprintf(d->reason, sizeof(d->reason), "%s: %s",
                     code == IDEM_NOT_FOUND ? "no key in the payload" : "undecodable payload",
                     idem_code_name(code));
            return false;
        }
        v = d->key;
    } else if (natsMsgHeader_Get(d->m, o->key_header, &v) != NATS_OK &&
               natsMsgHeader_Get(d->m, IDEM_NATS_MSG_ID_HEADER, &v) != NATS_OK) {
        snprintf(d->reason, sizeof(d->reason), "no key: neither %s nor %s header", o->key_header,
                 IDEM_NATS_MSG_ID_HEADER);
        return false;
    }
    size_t n = strnlen(v, IDEM_MAX_MSG_KEY + 1);
    if (n == 0 || n > IDEM_MAX_MSG_KEY) {
        snprintf(d->reason, sizeof(d->reason), n == 0 ? "no key: empty" : "key over %d bytes",
                 IDEM_MAX_MSG_KEY);
        return false;
    }
    memmove(d->key, v, n);
    d->key[n] = '\0';
    d->im.key = d->key;
    return true;
}

static idem_code run_handler(idem_txn *t, void *arg)
{
    delivery *d = arg;
    idem__err_clear(); /* the reason of a failure is then the handler's own, or none */
    idem_code code = d->c->o.handler(t, &d->im, d->c->o.handler_arg);
    d->handler_failed = code != IDEM_OK;
    if (code == IDEM_OK && d->im.delivered > 1) { /* an earlier one may have failed */
        code = idem__nats_failure_forget_in(t, d->c->o.durable, d->key);
    }
    return code;
}

static void ack(delivery *d, bool duplicate)
{
    idem_nats_consumer *c = d->c;
    jsErrCode jerr = 0;
    count(c, duplicate ? &c->stats.duplicates : &c->stats.committed);
    emit(d, duplicate ? IDEM_NATS_DUPLICATE : IDEM_NATS_COMMITTED, NULL);
    natsStatus s = natsMsg_AckSync(d->m, NULL, &jerr);
    if (s != NATS_OK) { /* the marker stands: the redelivery is a duplicate, acked then */
        count(c, &c->stats.ack_failures);
        idem__nats_log(c->o.log_fn, c->o.log_arg, IDEM_LOG_ERROR,
                       "nats consumer=%s seq=%llu ack failed: %s (redelivered as a duplicate)",
                       c->o.durable, (unsigned long long)d->im.stream_seq, natsStatus_GetText(s));
        return;
    }
    count(c, &c->stats.acked);
    emit(d, IDEM_NATS_ACKED, NULL);
}

static void nak(delivery *d)
{
    idem_nats_consumer *c = d->c;
    uint64_t delay = c->o.backoff_ms;
    for (uint64_t i = 1; i < d->im.delivered && delay < c->o.backoff_max_ms; i++) {
        delay *= 2;
    }
    delay = delay < c->o.backoff_max_ms ? delay : c->o.backoff_max_ms;
    count(c, &c->stats.naked);
    /* A lost nak costs only time: the broker redelivers after ack_wait_ms anyway. */
    natsMsg_NakWithDelay(d->m, (int64_t)delay, NULL);
    emit(d, IDEM_NATS_NAKED, d->reason);
}

static void dead_letter(delivery *d)
{
    idem_nats_consumer *c = d->c;
    idem_code code = idem__nats_dead_letter(c->js, c->nc, &c->dead_bound, c->o.dead_letter_subject,
                                            c->o.durable, &d->im, d->reason);
    if (code != IDEM_OK && code != IDEM_OUT_OF_RANGE) { /* never dropped: naked, again later */
        count(c, &c->stats.dead_failures);
        idem__nats_log(c->o.log_fn, c->o.log_arg, IDEM_LOG_ERROR,
                       "nats consumer=%s seq=%llu dead letter failed (%s): %s; naked", c->o.durable,
                       (unsigned long long)d->im.stream_seq, d->reason, idem_errmsg());
        nak(d);
        return;
    }
    bool refused = code == IDEM_OUT_OF_RANGE; /* for good: naked, it would re-run for ever */
    natsMsg_Term(d->m, NULL); /* lost: redelivered, dead-lettered again under its msg id */
    if (d->im.key != NULL && d->im.delivered > 1) { /* left: only a row, counted anew */
        idem__nats_failure_forget(c->st, c->o.durable, d->im.key);
    }
    count(c, refused ? &c->stats.dead_refused : &c->stats.dead_lettered);
    idem__nats_log(
        c->o.log_fn, c->o.log_arg, IDEM_LOG_ERROR,
        "nats consumer=%s stream=%s seq=%llu key=%s %s %s: %s%s%s", c->o.durable, c->o.stream,
        (unsigned long long)d->im.stream_seq, d->im.key != NULL ? d->im.key : "-",
        refused ? "terminated WITHOUT its dead letter, refused for good by" : "dead-lettered to",
        c->o.dead_letter_subject, d->reason, refused ? "; " : "", refused ? idem_errmsg() : "");
    emit(d, IDEM_NATS_DEAD_LETTERED, d->reason);
}

/* Why a delivery that was not acked failed, and whether that ends in the dead letter.
 * Only the message's own failures do: a store that failed (unreachable, a commit lost)
 * says nothing about the message, which is naked however often it comes back. */
static const char *failure_kind(const delivery *d, idem_consume_verdict v, idem_code code,
                                bool *dead)
{
    *dead = true;
    if (v == IDEM_CONSUME_REJECT) {
        return "rejected";
    }
    if (!d->handler_failed) {
        *dead = false;
        return "store failure";
    }
    if (!idem__nats_transient(code)) {
        return "final failure";
    }
    *dead = d->failures >= d->c->o.max_deliver;
    return *dead ? "max deliveries" : "transient failure";
}

/* A transient failure of the handler itself: counted in the message's tally. A tally the
 * store cannot count makes it a store failure (naked, not counted). */
static void count_failure(delivery *d, idem_code code)
{
    idem_errkeep k;
    if (!d->handler_failed || !idem__nats_transient(code)) {
        return;
    }
    idem__err_keep(&k);
    if (idem__nats_failure_count(d->c->st, d->c->o.durable, d->key, d->im.stream_seq,
                                 &d->failures) != IDEM_OK) {
        d->handler_failed = false;
    }
    idem__err_put(&k, code);
}

/* The whole life of one delivery. */
static void handle(idem_nats_consumer *c, natsMsg *m)
{
    delivery d;
    idem_consume_info info;
    bool dead;
    delivery_init(&d, c, m);
    if (!key_of(&d)) {
        dead_letter(&d);
        return;
    }
    idem_consume_verdict v = idem_consume_ex(c->st, c->o.group, d.key, run_handler, &d, &info);
    if (v == IDEM_CONSUME_ACK) {
        ack(&d, info.duplicate);
        return;
    }
    if (info.in_progress) { /* another delivery's handler has it: that one settles it */
        snprintf(d.reason, sizeof(d.reason), "duplicate in progress: %s", idem_errmsg());
        nak(&d);
        return;
    }
    if (info.store_failed) { /* the handler failed because the store did */
        d.handler_failed = false;
    }
    if (v != IDEM_CONSUME_REJECT) {
        count_failure(&d, info.code);
    }
    const char *why = failure_kind(&d, v, info.code, &dead), *own = idem__nats_reason_of(&d.im);
    const char *detail = d.handler_failed && own != NULL ? own : idem_errmsg();
    snprintf(d.reason, sizeof(d.reason), "%s (delivery %llu): %s%s%s", why,
             (unsigned long long)d.im.delivered, idem_code_name(info.code),
             detail[0] != '\0' ? ": " : "", detail);
    if (dead) {
        dead_letter(&d);
        return;
    }
    if (!d.handler_failed && d.im.delivered % c->o.max_deliver == 0) { /* not every time */
        idem__nats_log(c->o.log_fn, c->o.log_arg, IDEM_LOG_ERROR,
                       "nats consumer=%s seq=%llu key=%s naked: %s", c->o.durable,
                       (unsigned long long)d.im.stream_seq, d.key, d.reason);
    }
    nak(&d);
}

idem_code idem_nats_consumer_poll(idem_nats_consumer *c, unsigned *handled)
{
    natsMsgList list = {0};
    jsErrCode jerr = 0;
    if (handled != NULL) {
        *handled = 0;
    }
    if (c == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats consumer: NULL");
    }
    natsStatus s =
        idem__nats_fetch(&list, c->sub, (int)c->o.batch, (int64_t)c->o.fetch_wait_ms, &jerr);
    for (int i = 0; i < list.Count; i++) {
        idem__nats_progress_at(&c->progress, &list, i); /* the rest kept while they wait */
        count(c, &c->stats.fetched);
        handle(c, list.Msgs[i]);
    }
    idem__nats_progress_done(&c->progress);
    if (handled != NULL) {
        *handled = (unsigned)list.Count;
    }
    natsMsgList_Destroy(&list);
    if (s == NATS_OK ||
        (s == NATS_TIMEOUT && natsConnection_Status(c->nc) == NATS_CONN_STATUS_CONNECTED)) {
        return IDEM_OK;
    }
    return idem__nats_code_on(c->nc, s == NATS_TIMEOUT ? NATS_CONNECTION_DISCONNECTED : s, jerr,
                              "fetch");
}

/* ---- life cycle ---- */

void idem_nats_consumer_opts_init(idem_nats_consumer_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->max_deliver = DEFAULT_MAX_DELIVER;
    o->ack_wait_ms = DEFAULT_ACK_WAIT_MS;
    o->backoff_ms = DEFAULT_BACKOFF_MS;
    o->backoff_max_ms = DEFAULT_BACKOFF_MAX_MS;
    o->batch = DEFAULT_BATCH;
    o->fetch_wait_ms = DEFAULT_FETCH_WAIT_MS;
}

static idem_code opts_check(const idem_nats_consumer_opts *o)
{
    size_t ld = o->durable != NULL ? strnlen(o->durable, IDEM_MAX_CONSUMER_GROUP + 1) : 0;
    if (o->url == NULL || o->stream == NULL || *o->stream == '\0' || o->handler == NULL ||
        o->dead_letter_subject == NULL || *o->dead_letter_subject == '\0') {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "nats consumer: url, stream, durable, dead_letter_subject and handler "
                         "are required");
    }
    size_t lg = o->group != NULL ? strnlen(o->group, IDEM_MAX_CONSUMER_GROUP + 1) : ld;
    if (ld == 0 || ld > IDEM_MAX_CONSUMER_GROUP || strpbrk(o->durable, ". *>") != NULL || lg == 0 ||
        lg > IDEM_MAX_CONSUMER_GROUP) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "nats consumer: durable must be 1..%d bytes without '.', ' ', '*', "
                         "'>', and group (NULL: durable) 1..%d bytes",
                         IDEM_MAX_CONSUMER_GROUP, IDEM_MAX_CONSUMER_GROUP);
    }
    if (o->max_deliver < 1 || o->max_deliver > IDEM_NATS_MAX_DELIVER || o->batch < 1 ||
        o->batch > IDEM_NATS_MAX_BATCH || o->ack_wait_ms < 1 || o->fetch_wait_ms < 1 ||
        o->backoff_max_ms < o->backoff_ms) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "nats consumer: max_deliver 1..%d, batch 1..%d, ack_wait_ms and "
                         "fetch_wait_ms > 0, backoff_ms <= backoff_max_ms",
                         IDEM_NATS_MAX_DELIVER, IDEM_NATS_MAX_BATCH);
    }
    return IDEM_OK;
}

/* Copies the caller's strings, so that its options may be freed after open. */
static idem_code opts_copy(idem_nats_consumer *c, const idem_nats_consumer_opts *o)
{
    const char **fields[N_STRS] = {&c->o.url,
                                   &c->o.stream,
                                   &c->o.durable,
                                   &c->o.filter_subject,
                                   &c->o.dead_letter_subject,
                                   &c->o.key_header,
                                   &c->o.group};
    c->o = *o;
    if (c->o.key_header == NULL) {
        c->o.key_header = IDEM_NATS_KEY_HEADER;
    }
    c->o.group = o->group != NULL ? o->group : o->durable;
    for (int i = 0; i < N_STRS; i++) {
        if (*fields[i] != NULL && (c->strs[i] = strdup(*fields[i])) == NULL) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "nats consumer: out of memory");
        }
        *fields[i] = c->strs[i];
    }
    return IDEM_OK;
}

/* Creates the durable (an existing one is kept as it is), binds a pull subscription. */
static idem_code bind_durable(idem_nats_consumer *c)
{
    jsConsumerConfig cc;
    jsConsumerInfo *ci = NULL;
    jsSubOptions so;
    jsErrCode jerr = 0;
    jsConsumerConfig_Init(&cc);
    cc.Durable = c->o.durable;
    cc.AckPolicy = js_AckExplicit;
    cc.AckWait = (int64_t)c->o.ack_wait_ms * 1000000; /* ns */
    cc.MaxDeliver = -1; /* unlimited at the broker: max_deliver ends in our dead letter */
    cc.FilterSubject = c->o.filter_subject;
    natsStatus s = js_AddConsumer(&ci, c->js, c->o.stream, &cc, NULL, &jerr);
    if (s != NATS_OK &&
        (jerr == JSStreamNotFoundErr ||
         js_GetConsumerInfo(&ci, c->js, c->o.stream, c->o.durable, NULL, &jerr) != NATS_OK)) {
        return idem__nats_code(s, jerr, "nats consumer: create durable");
    }
    c->ack_wait_ms = ci->Config != NULL && ci->Config->AckWait > 0
                         ? (uint64_t)ci->Config->AckWait / 1000000
                         : c->o.ack_wait_ms; /* the durable's own */
    jsConsumerInfo_Destroy(ci);
    jsSubOptions_Init(&so);
    so.Stream = c->o.stream;
    so.Consumer = c->o.durable;
    s = js_PullSubscribe(&c->sub, c->js, c->o.filter_subject != NULL ? c->o.filter_subject : "",
                         c->o.durable, NULL, &so, &jerr);
    return s == NATS_OK ? idem__nats_progress_start(&c->progress, c->ack_wait_ms)
                        : idem__nats_code(s, jerr, "nats consumer: bind durable");
}

idem_code idem_nats_consumer_open(idem_nats_consumer **out, idem_store *st,
                                  const idem_nats_consumer_opts *o)
{
    idem_nats_consumer *c;
    *out = NULL;
    idem_code code = st == NULL || o == NULL
                         ? idem__err(IDEM_INVALID_ARGUMENT, "nats consumer: a store and options")
                         : opts_check(o);
    if (code != IDEM_OK) {
        return code;
    }
    if ((c = calloc(1, sizeof(*c))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "nats consumer: out of memory");
    }
    c->st = st;
    idem__nats_loop_init(&c->loop);
    if ((code = opts_copy(c, o)) == IDEM_OK &&
        (code = idem__nats_connect(c->o.url, API_WAIT_MS, &c->nc, &c->js)) == IDEM_OK) {
        code = bind_durable(c);
    }
    if (code != IDEM_OK) {
        idem_errkeep k;
        idem__err_keep(&k);
        idem_nats_consumer_close(c);
        return idem__err_put(&k, code);
    }
    *out = c;
    return IDEM_OK;
}

static void *consumer_main(void *arg)
{
    idem_nats_consumer *c = arg;
    uint64_t wait_ms = 0;
    while (!idem__nats_loop_pause(&c->loop, wait_ms)) {
        idem_code code = idem_nats_consumer_poll(c, NULL);
        if (code == IDEM_OK) {
            if (wait_ms != 0) {
                idem__nats_log(c->o.log_fn, c->o.log_arg, IDEM_LOG_ERROR,
                               "nats consumer=%s broker back", c->o.durable);
            }
            wait_ms = 0;
            continue;
        }
        if (wait_ms == 0) { /* once per outage */
            idem__nats_log(c->o.log_fn, c->o.log_arg, IDEM_LOG_ERROR,
                           "nats consumer=%s fetch failed: %s; retrying", c->o.durable,
                           idem_errmsg());
        }
        wait_ms = wait_ms == 0 ? 100 : (wait_ms * 2 < 1000 ? wait_ms * 2 : 1000);
    }
    return NULL;
}

idem_code idem_nats_consumer_start(idem_nats_consumer *c)
{
    if (c == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats consumer: NULL");
    }
    return idem__nats_loop_start(&c->loop, consumer_main, c, "nats consumer");
}

idem_code idem_nats_consumer_pending(idem_nats_consumer *c, uint64_t *pending)
{
    jsConsumerInfo *ci = NULL;
    jsErrCode jerr = 0;
    *pending = 0;
    natsStatus s = js_GetConsumerInfo(&ci, c->js, c->o.stream, c->o.durable, NULL, &jerr);
    if (s != NATS_OK) {
        return idem__nats_code(s, jerr, "nats consumer: info");
    }
    *pending = ci->NumPending + (uint64_t)ci->NumAckPending;
    jsConsumerInfo_Destroy(ci);
    return IDEM_OK;
}

idem_code idem_nats_consumer_purge_markers(idem_nats_consumer *c, uint64_t horizon_ms, size_t max,
                                           size_t *purged)
{
    if (c == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats consumer: NULL");
    }
    idem__nats_purge p = {c->js, c->st, c->o.stream, c->o.group, c->ack_wait_ms};
    return idem__nats_purge_markers(&p, horizon_ms, max, purged);
}

void idem_nats_consumer_stats(idem_nats_consumer *c, idem_nats_stats *out)
{
    pthread_mutex_lock(&c->loop.mu);
    *out = c->stats;
    pthread_mutex_unlock(&c->loop.mu);
}

void idem_nats_consumer_close(idem_nats_consumer *c)
{
    if (c == NULL) {
        return;
    }
    idem__nats_loop_fini(&c->loop); /* the thread first: it uses what follows */
    idem__nats_progress_stop(&c->progress);
    natsSubscription_Destroy(c->sub); /* not Unsubscribe: the durable stays */
    idem__nats_disconnect(c->nc, c->js);
    for (int i = 0; i < N_STRS; i++) {
        free(c->strs[i]);
    }
    free(c);
}

/* Shared by the NATS binding's files: the connection, status mapping, logging. */
#ifndef IDEMRPC_NATS_INTERNAL_H
#define IDEMRPC_NATS_INTERNAL_H

#include <nats/nats.h>

#include "internal.h"
#include "toolkit_internal.h"

#include "idemrpc/nats.h"

/* Connects to url (reconnecting forever, every 100 ms, afterwards) and opens its
 * JetStream context; publish_wait_ms bounds each publish and JetStream API call. */
idem_code idem__nats_connect(const char *url, unsigned publish_wait_ms, natsConnection **nc,
                             jsCtx **js);
/* The same, but a broker that cannot be reached now is no failure: *nc keeps trying in
 * the background (not connected until natsConnection_Status says so). */
idem_code idem__nats_connect_lazy(const char *url, unsigned publish_wait_ms, natsConnection **nc,
                                  jsCtx **js);

/* natsSubscription_Fetch, around a heap overflow of libnats before 3.9 (nats-io/nats.c#749,
 * nats_conn.c): while messages are already queued in sub, it fetches 1. */
natsStatus idem__nats_fetch(natsMsgList *list, natsSubscription *sub, int batch, int64_t wait_ms,
                            jsErrCode *jerr);
void idem__nats_disconnect(natsConnection *nc, jsCtx *js);

/* An idem_code for a libnats failure, with idem_errmsg() naming what and libnats' text:
 * UNAVAILABLE for a broker that is away or timed out, NOT_FOUND for a missing stream or
 * consumer, OUT_OF_RANGE for a message larger than the broker or the stream takes (a
 * refusal for good), else INTERNAL. */
idem_code idem__nats_code(natsStatus s, jsErrCode jerr, const char *what);
/* idem__nats_code, its message naming nc's state when it is not connected ("fetch (broker
 * connection reconnecting: the broker is unreachable): ..."). */
idem_code idem__nats_code_on(natsConnection *nc, natsStatus s, jsErrCode jerr, const char *what);

/* One logfmt line through fn (NULL: stderr). */
void idem__nats_log(idem_log_fn fn, void *arg, idem_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Publishes m to JetStream within the context's wait; *duplicate when the broker's dedupe
 * window dropped it (its Nats-Msg-Id was seen); *status (may be NULL): libnats' own, e.g.
 * NATS_NO_RESPONDERS when nothing took the subject; *where (may be NULL): the stream and
 * sequence the ack named (for a duplicate: the copy the broker has). */
idem_code idem__nats_publish(jsCtx *js, natsMsg *m, const char *what, bool *duplicate,
                             natsStatus *status, idem_outbox_ack *where);

/* Asks JetStream which stream captures subject: IDEM_OK with *max_msg_size, that stream's
 * bound on a message, headers in (<= 0: none); IDEM_NOT_FOUND when JetStream answered
 * that no stream does; else UNAVAILABLE (no answer, e.g. JetStream away or restarting,
 * or an error), which says nothing about the subject. */
idem_code idem__nats_stream_of(jsCtx *js, const char *subject, int64_t *max_msg_size);

/* The thread of a consumer or a relay (nats_loop.c). mu also guards its owner's
 * counters; cv wakes a pause at the stop (monotonic clock). */
typedef struct idem__nats_loop {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stopping, started;
    pthread_t thread;
} idem__nats_loop;

void idem__nats_loop_init(idem__nats_loop *l);
idem_code idem__nats_loop_start(idem__nats_loop *l, void *(*fn)(void *), void *arg,
                                const char *what);
/* Waits ms unless stopping; true when stopping. */
bool idem__nats_loop_pause(idem__nats_loop *l, uint64_t ms);
/* Stops and joins the thread if it was started, then destroys the loop. */
void idem__nats_loop_fini(idem__nats_loop *l);
/* *counter += n under l->mu. */
void idem__nats_add(idem__nats_loop *l, uint64_t *counter, uint64_t n);

/* The fetched batch a consumer's thread is handling, kept in progress behind the message
 * in hand by a thread of its own (nats_progress.c). Zeroed: not started (the calls below
 * then do nothing). */
typedef struct idem__nats_progress {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool started, stopping;
    uint64_t period_ms;  /* a third of the durable's ack wait */
    natsMsg **msgs;      /* the batch (NULL: none), msgs[at] in hand, */
    int at, count;       /* msgs(at, count) waiting behind it */
    uint64_t kept_ms;    /* mono: the ack waits of the waiting ones last started */
    uint64_t in_hand_ms; /* mono: msgs[at] taken in hand */
} idem__nats_progress;

idem_code idem__nats_progress_start(idem__nats_progress *p, uint64_t ack_wait_ms);
/* list->Msgs[at] is in hand now (list fetched just now when it is new); done: none. */
void idem__nats_progress_at(idem__nats_progress *p, natsMsgList *list, int at);
void idem__nats_progress_done(idem__nats_progress *p);
void idem__nats_progress_stop(idem__nats_progress *p);

/* How the broker syncs its file store (nats_keep.c), from the server's JetStream config
 * in its varz ($SYS.REQ.SERVER.PING.VARZ, answered to a system account's user): *always
 * when it syncs every write (sync_always), else *interval_ms its sync_interval. IDEM_OK
 * when it said; NOT_FOUND when it did not (no answer within wait_ms, not a system user,
 * or a server that reports no sync setting, such as nats-server 2.9). */
idem_code idem__nats_sync_probe(natsConnection *nc, unsigned wait_ms, bool *always,
                                uint64_t *interval_ms);

/* The newest publish the relay knows to hold, per stream: grows as the relay publishes
 * to more streams, up to IDEM__NATS_STREAMS_MAX (then the stream acked longest ago gives
 * way; a loss in it is found at the next reconnect only). idem__nats_newest_fini frees. */
#define IDEM__NATS_STREAMS_MAX 4096
typedef struct idem__nats_newest {
    size_t n, cap;
    idem_outbox_ack *s;
} idem__nats_newest;
void idem__nats_newest_fini(idem__nats_newest *nw);

/* After a (re)connect (nats_keep.c): whether the broker lost a kept message, looking at
 * the newest kept message of every stream (the kept log's newest and its stream
 * directory). A message is lost when its stream is gone, its sequence holds another
 * message (another Nats-Msg-Id), or the stream's last sequence is below it; one its
 * stream no longer has below its last sequence (retention removed it) is not. *unsure
 * (and *lost): some kept message is in no entry of the directory (it overflowed, or the
 * log was kept by a release before it), so every kept message goes again. *nw: the
 * newest of each stream that held. UNAVAILABLE when the broker did not answer. */
idem_code idem__nats_check_kept(jsCtx *js, idem_store *st, idem__nats_newest *nw, bool *lost,
                                bool *unsure);
/* A publish acked at a: true when it went back in its stream (at or below the newest
 * acked there before: the broker forgot that one), else a is its stream's newest now. */
bool idem__nats_went_back(idem__nats_newest *nw, const idem_outbox_ack *a);

/* What the stream that captures a consumer's dead letters takes: its max_msg_size
 * (<= 0: no bound), once read (known). Zeroed: not read yet. */
typedef struct idem__nats_dead_bound {
    int64_t max_msg_size;
    bool known;
} idem__nats_dead_bound;

/* Publishes the payload of im to subject with the reason and where it came from
 * (IDEM_NATS_DEAD_* headers) and Nats-Msg-Id "dead.<stream seq>.<durable>", so that a
 * dead letter published again (its Term lost, a crash) is dropped inside the broker's
 * dedupe window; only the first bytes of the payload that fit beside the headers, then
 * with IDEM_NATS_DEAD_TRUNCATED. What fits: nc's max_payload, or the max_msg_size of the
 * stream that captures subject when smaller (read into *b at the first dead letter, and
 * again when that stream refused one as too large, then published again). IDEM_OK once
 * the broker acked the publish; OUT_OF_RANGE when it refuses it for good (even at the
 * bound read just now: its headers alone do not fit); else the failure. */
idem_code idem__nats_dead_letter(jsCtx *js, natsConnection *nc, idem__nats_dead_bound *b,
                                 const char *subject, const char *durable, const idem_nats_msg *im,
                                 const char *reason);

/* Where a delivery's idem_nats_msg points: its headers and its handler's reason. */
struct idem__nats_reason {
    char text[IDEM_NATS_MAX_REASON + 1]; /* escaped; "" when none */
};
typedef struct idem__nats_room {
    idem_nats_header headers[IDEM_NATS_MAX_HEADERS];
    struct idem__nats_reason reason;
} idem__nats_room;

/* Points im's headers at m's (their strings stay m's) and its reason slot at room's,
 * emptied (nats_msg.c). */
void idem__nats_msg_room(idem_nats_msg *im, natsMsg *m, idem__nats_room *room);
/* The handler's reason for im, or NULL when it gave none. */
const char *idem__nats_reason_of(const idem_nats_msg *im);
/* in[0..len) into out (cap bytes, NUL-terminated): with all, every byte that is not
 * printable ASCII and '\' as \xHH; else only CR and LF (what a header value cannot
 * hold). What does not fit is cut at a whole escape, ending "...". */
void idem__nats_escape(char *out, size_t cap, const char *in, size_t len, bool all);

/* The failure tally of (durable, key) in the store (nats_failures.c), per stream copy:
 * _count adds this delivery's real handler failure to copy stream_seq's in a txn of its
 * own and gives that copy's total; _forget_in deletes every copy's in t (the txn that
 * commits the effect), _forget in a txn of its own. */
idem_code idem__nats_failure_count(idem_store *st, const char *durable, const char *key,
                                   uint64_t stream_seq, uint64_t *failures);
idem_code idem__nats_failure_forget_in(idem_txn *t, const char *durable, const char *key);
idem_code idem__nats_failure_forget(idem_store *st, const char *durable, const char *key);

/* What a consumer's marker purge needs of it (nats_retention.c): the stream's max_age is
 * read from the broker at each call, so that a stream changed since keeps its markers. */
typedef struct idem__nats_purge {
    jsCtx *js;
    idem_store *st;
    const char *stream, *group;
    uint64_t ack_wait_ms; /* the durable's */
} idem__nats_purge;

idem_code idem__nats_purge_markers(const idem__nats_purge *p, uint64_t horizon_ms, size_t max,
                                   size_t *purged);

/* The codes a redelivery may cure (DESIGN: the ones that release a claim). */
bool idem__nats_transient(idem_code code);

#endif

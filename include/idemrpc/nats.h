/* idemrpc on NATS JetStream: a durable pull consumer whose messages take effect once
 * through idem_consume (toolkit.h), and the relay that publishes the transactional outbox
 * (toolkit.h, idem_outbox_put) to JetStream.
 *
 * Optional at build time (meson -Dnats=enabled|disabled|auto, libnats 3.4): in a build
 * without it every function here answers IDEM_UNIMPLEMENTED, so a program offering the
 * broker as an option links against either build. This header does not include
 * <nats/nats.h>: programs need libnats only when they use it themselves.
 *
 * The consumer's rule, per message (README "Consuming from a broker"):
 *   key      from the payload (key_fn, the business number) when set, else the header
 *            key_header ("Idem-Key"), else "Nats-Msg-Id". None, empty, over
 *            IDEM_MAX_MSG_KEY bytes, or a payload key_fn cannot decode: dead letter.
 *   effect   handler(txn, msg) inside idem_consume(store, durable, key): the effect and
 *            the consumed marker commit in one transaction, or neither does.
 *   ack      only after that commit (or when the marker shows an earlier commit: a
 *            duplicate, the handler does not run). Never for an effect that did not commit.
 *   nak      a transient failure of the handler (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL,
 *            RESOURCE_EXHAUSTED, ABORTED, CANCELLED, UNKNOWN), and any failure of the store
 *            (unreachable, a commit that failed or whose outcome is unknown): redelivered
 *            after backoff_ms · 2^(delivery-1), at most backoff_max_ms. A store failure
 *            says nothing about the message: it never leads to the dead letter, nor
 *            counts against max_deliver.
 *   dead     after max_deliver transient failures of the handler (counted in the store,
 *            "idem.nats.failures", per durable, key and stream copy: not the broker's
 *            deliveries, which include those the store failed, nor the failures of
 *            another copy of the same message id), or at once for a final one (bad
 *            input, a handler's other codes, idem_consume's REJECT): the message is
 *            published to dead_letter_subject with its reason (headers below), and only
 *            after that publish is acked is it terminated (Term: JetStream never
 *            redelivers it). A payload too large to fit beside the dead letter's headers
 *            (in max_payload, or in the max_msg_size of the stream that captures
 *            dead_letter_subject when smaller, read at the first dead letter and again
 *            when that stream refuses one) is cut to what fits, with
 *            IDEM_NATS_DEAD_TRUNCATED. A dead-letter publish that fails naks the message
 *            instead: nothing is dropped. One that stream refuses for good even without
 *            payload (its max_msg_size below the headers) would re-run the handler on every
 *            delivery for ever: the message is terminated without it, logged at ERROR with
 *            its stream and sequence (the stream keeps it per its retention), dead_refused.
 * Several consumers (threads or processes) may share one durable: JetStream hands each
 * message to one of them at a time, and idem_consume settles a redelivery that overlaps. */
#ifndef IDEMRPC_NATS_H
#define IDEMRPC_NATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "server.h"
#include "status.h"
#include "store.h"
#include "toolkit.h"
#include "txn.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_NATS_KEY_HEADER "Idem-Key"
#define IDEM_NATS_MSG_ID_HEADER "Nats-Msg-Id"
/* Headers of a dead letter (its payload is the original message's, or its first bytes). */
#define IDEM_NATS_DEAD_REASON "Idem-Dead-Reason"       /* why, e.g. "no key", "max deliveries" */
#define IDEM_NATS_DEAD_SUBJECT "Idem-Dead-Subject"     /* the original subject */
#define IDEM_NATS_DEAD_SEQ "Idem-Dead-Stream-Seq"      /* its sequence in the stream */
#define IDEM_NATS_DEAD_DELIVERED "Idem-Dead-Delivered" /* deliveries, this one included */
/* Present when the payload did not fit beside these headers (in the broker's max_payload
 * or the dead letters' stream's max_msg_size): the original payload's size in bytes; the
 * dead letter carries its first bytes that fit. */
#define IDEM_NATS_DEAD_TRUNCATED "Idem-Truncated"
#define IDEM_NATS_MAX_BATCH 256
#define IDEM_NATS_MAX_DELIVER 1000

#define IDEM_NATS_MAX_HEADERS 32 /* headers an idem_nats_msg shows (headers_cut: more) */
#define IDEM_NATS_MAX_REASON 256 /* bytes of a handler's reason (idem_nats_fail), escaped */

/* One header of a message: one value of one name (a name with two values: two entries). */
typedef struct idem_nats_header {
    const char *name;
    const char *value;
} idem_nats_header;

/* A message as the handler sees it; valid during the call only. */
typedef struct idem_nats_msg {
    const char *subject;
    const void *data;
    size_t len;
    const char *key;     /* the idempotency key (NULL before it is known) */
    uint64_t stream_seq; /* the message's sequence in its stream */
    uint64_t delivered;  /* 1 on the first delivery */
    /* Its headers, read-only, in no particular order: the first IDEM_NATS_MAX_HEADERS
       (headers_cut when it has more, or libnats could not read them all);
       idem_nats_msg_header finds one by name. */
    const idem_nats_header *headers;
    size_t n_headers;
    bool headers_cut;
    struct idem__nats_reason *reason_slot; /* the library's: where idem_nats_fail writes */
} idem_nats_msg;

/* The value of header name (exact, case-sensitive, as libnats compares; the first of
 * several), or NULL when m has none among its headers. */
IDEM_API const char *idem_nats_msg_header(const idem_nats_msg *m, const char *name);

/* For a handler that fails m: records why, printf-style, and returns code, so that
 *     return idem_nats_fail(m, IDEM_INVALID_ARGUMENT, "amount %ld below zero", amount);
 * puts the text into the dead letter's IDEM_NATS_DEAD_REASON after the code
 * ("final failure (delivery 1): INVALID_ARGUMENT: amount -5 below zero"), into the
 * consumer's log line and its on_event reason. The text is escaped (every byte that is not
 * printable ASCII, and '\', written \xHH) and cut to IDEM_NATS_MAX_REASON bytes (ending
 * "..."). The last call of the handler's run counts; a handler that returns IDEM_OK has no
 * reason. On a message the consumer did not make (reason_slot NULL) it only returns code. */
IDEM_API idem_code idem_nats_fail(const idem_nats_msg *m, idem_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The business key from the payload: writes 1..cap-1 bytes and a NUL into key. Returns
 * IDEM_OK, IDEM_NOT_FOUND (the payload names no key) or IDEM_INVALID_ARGUMENT (it cannot
 * be decoded); both are dead-lettered with that reason. cap is IDEM_MAX_MSG_KEY + 2: a key
 * of IDEM_MAX_MSG_KEY + 1 bytes is over the bound, dead-lettered, never cut. */
typedef idem_code (*idem_nats_key_fn)(const void *data, size_t len, char *key, size_t cap,
                                      void *arg);

/* The effect of one message, in idem_consume's write txn: IDEM_OK commits it with the
 * marker; a transient code rolls back and naks; any other code rolls back and
 * dead-letters (the message itself is wrong: no redelivery fixes it). */
typedef idem_code (*idem_nats_handler)(idem_txn *t, const idem_nats_msg *m, void *arg);

typedef enum idem_nats_event {
    IDEM_NATS_COMMITTED = 1, /* effect and marker committed; the ack comes next */
    IDEM_NATS_DUPLICATE,     /* consumed before (marker found); the ack comes next */
    IDEM_NATS_ACKED,         /* the broker confirmed the ack */
    IDEM_NATS_NAKED,         /* transient failure: redelivered after a delay */
    IDEM_NATS_DEAD_LETTERED, /* published to the dead-letter subject and terminated (or
                                terminated, its dead letter refused for good: dead_refused) */
} idem_nats_event;

/* Observes each step (reason: NULL, or why it was naked or dead-lettered). Runs on the
 * consumer's thread; keep it short. Tests crash the process here. */
typedef void (*idem_nats_event_fn)(idem_nats_event ev, const idem_nats_msg *m, const char *reason,
                                   void *arg);

typedef struct idem_nats_consumer_opts {
    const char *url;                 /* required: "nats://127.0.0.1:4222" (commas: a list) */
    const char *stream;              /* required: an existing stream */
    const char *durable;             /* required: the durable pull consumer, created when
                                        absent (1..64 bytes, no '.'); the group when none */
    const char *filter_subject;      /* the stream's subjects this durable takes; NULL: all */
    const char *dead_letter_subject; /* required: captured by a stream, not by this durable */
    const char *key_header;          /* NULL: IDEM_NATS_KEY_HEADER, then Nats-Msg-Id */
    idem_nats_key_fn key_fn;         /* set: the key comes from the payload only */
    void *key_arg;
    idem_nats_handler handler; /* required */
    void *handler_arg;
    unsigned max_deliver; /* default 5 (1..IDEM_NATS_MAX_DELIVER): transient failures of the
                             handler on one stream copy before its dead letter (a store
                             failure is none) */
    unsigned ack_wait_ms; /* default 30000: an unacked delivery is redelivered after this
                             (set when this call creates the durable) */
    unsigned backoff_ms;  /* default 100: nak delay after a first failure, doubled per delivery */
    unsigned backoff_max_ms;     /* default 5000 */
    unsigned batch;              /* default 16 (1..IDEM_NATS_MAX_BATCH): messages per fetch */
    unsigned fetch_wait_ms;      /* default 500: a fetch waits this long for a first message */
    idem_nats_event_fn on_event; /* may be NULL */
    void *event_arg;
    idem_log_fn log_fn; /* dead letters and broker errors; NULL: stderr */
    void *log_arg;
    /* idem_consume's group (1..64 bytes): whose markers say "consumed". NULL: durable.
       Keep it when renaming the durable: the new durable is delivered every message still
       in the stream, and those the group consumed are acked as duplicates, not re-applied. */
    const char *group;
} idem_nats_consumer_opts;

typedef struct idem_nats_stats {
    uint64_t fetched;       /* deliveries received (redeliveries included) */
    uint64_t committed;     /* handler ran and its txn committed */
    uint64_t duplicates;    /* acked without running: consumed before */
    uint64_t acked;         /* acks the broker confirmed */
    uint64_t ack_failures;  /* acks not confirmed: the redelivery will be a duplicate */
    uint64_t naked;         /* transient failures, redelivered */
    uint64_t dead_lettered; /* published to the dead-letter subject and terminated */
    uint64_t dead_failures; /* dead-letter publishes that failed (the message was naked) */
    uint64_t dead_refused;  /* dead letters the broker refuses for good even without their
                               payload: the message was terminated without one (ERROR log) */
} idem_nats_stats;

typedef struct idem_nats_consumer idem_nats_consumer;

/* Zeroes o and sets the defaults above. */
IDEM_API void idem_nats_consumer_opts_init(idem_nats_consumer_opts *o);

/* Connects (reconnecting forever afterwards), creates the durable if absent (explicit
 * acks, unlimited broker-side deliveries: max_deliver is enforced here, with a dead
 * letter) and binds to it. st must outlive the consumer. UNAVAILABLE when the broker
 * cannot be reached, NOT_FOUND when the stream does not exist, INVALID_ARGUMENT for
 * options out of bounds. */
IDEM_API idem_code idem_nats_consumer_open(idem_nats_consumer **out, idem_store *st,
                                           const idem_nats_consumer_opts *o);

/* One fetch on the caller's thread (one thread at a time per consumer: open one consumer
 * per thread): handles up to batch messages (*handled may be NULL), one after the other;
 * those behind the one in hand are kept in progress (InProgress, every third of the ack
 * wait, from a thread of the consumer's own) while they wait, 5 minutes at most.
 * IDEM_OK also when none came within fetch_wait_ms; UNAVAILABLE when the broker is
 * unreachable (call again: the connection reconnects by itself). */
IDEM_API idem_code idem_nats_consumer_poll(idem_nats_consumer *c, unsigned *handled);

/* Polls on a thread of its own until idem_nats_consumer_close; a broker that is away is
 * retried every 100 ms to 1 s, logged once per outage. */
IDEM_API idem_code idem_nats_consumer_start(idem_nats_consumer *c);

IDEM_API void idem_nats_consumer_stats(idem_nats_consumer *c, idem_nats_stats *out);

/* Asks the broker how many messages of the durable are not acked yet: not delivered, or
 * delivered and waiting for their ack (a nak'd one too). 0: everything published so far
 * was acked or dead-lettered. UNAVAILABLE while the broker is away. */
IDEM_API idem_code idem_nats_consumer_pending(idem_nats_consumer *c, uint64_t *pending);

/* Deletes, in one write txn, markers of the consumer's group that no delivery can need
 * any more: consumed before now - (the stream's max_age + horizon_ms). A message is
 * deleted by the broker max_age after its publish, and consumed after it; horizon_ms
 * covers the rest: a delivery fetched just before its message aged out and handled
 * later, a copy published again by an outbox relay that was down (or restored after a
 * broker lost it), and the clocks of this host and the broker's apart. 0:
 * IDEM_NATS_PURGE_HORIZON_MS; less than the durable's ack wait: INVALID_ARGUMENT. Looks at
 * up to max (1..IDEM_CONSUME_MAX_PURGE) slots (idem_consume_purge_group); call it on a
 * timer until *purged (may be NULL) is 0. FAILED_PRECONDITION when the stream has no
 * max_age (it may deliver a message at any time: no marker can go), UNAVAILABLE while
 * the broker is away. A group consumes one stream: the group's first purge records this
 * stream, and a purge from a consumer of another is FAILED_PRECONDITION (the shorter
 * retention would take markers the longer needs); idem_consume_purge_group forgets it. */
#define IDEM_NATS_PURGE_HORIZON_MS (24ull * 3600 * 1000)
IDEM_API idem_code idem_nats_consumer_purge_markers(idem_nats_consumer *c, uint64_t horizon_ms,
                                                    size_t max, size_t *purged);

/* Stops the thread (after the message in hand), then disconnects. The durable stays on
 * the broker; a delivery not acked yet is redelivered after ack_wait_ms. */
IDEM_API void idem_nats_consumer_close(idem_nats_consumer *c);

/* Creates stream (file storage, the broker's default 2-minute duplicate window) taking
 * subjects[0..n) if no stream of that name exists; an existing one is kept as it is. */
IDEM_API idem_code idem_nats_ensure_stream(const char *url, const char *stream,
                                           const char *const *subjects, size_t n);

typedef enum idem_nats_retention {
    IDEM_NATS_RETAIN_LIMITS = 0, /* kept until max_age, max_msgs or max_bytes removes it */
    IDEM_NATS_RETAIN_WORK_QUEUE, /* removed once acked (one consumer per subject), or by a
                                    limit before */
} idem_nats_retention;

/* How long a stream keeps its messages, and its duplicate window. 0: no limit (the
 * window: the broker's default, 2 minutes). */
typedef struct idem_nats_stream_opts {
    idem_nats_retention retention;
    uint64_t max_age_ms;          /* markers are purged after it (purge_markers) */
    uint64_t max_msgs;            /* the oldest are removed beyond it */
    uint64_t max_bytes;           /* likewise */
    uint64_t duplicate_window_ms; /* at most max_age_ms when that is set */
} idem_nats_stream_opts;

/* Zeroes o: limits retention, no limits, the broker's duplicate window. */
IDEM_API void idem_nats_stream_opts_init(idem_nats_stream_opts *o);

/* As idem_nats_ensure_stream (o NULL: exactly it), and with o an existing stream is
 * brought to o's limits and window (its subjects and storage are kept).
 * FAILED_PRECONDITION when it exists with another retention (JetStream cannot change
 * it), INVALID_ARGUMENT for a window over max_age or a retention out of range. */
IDEM_API idem_code idem_nats_ensure_stream_ex(const char *url, const char *stream,
                                              const char *const *subjects, size_t n,
                                              const idem_nats_stream_opts *o);

/* ---- the outbox relay ----
 * Publishes the store's transactional outbox (toolkit.h, idem_outbox_put) to JetStream,
 * oldest first, each with Nats-Msg-Id and Idem-Key set to its msg_id, and removes a
 * message only after the broker acked its publish. A crash between the ack and the
 * removal publishes it again: inside the stream's duplicate window (nats-server's
 * default: 2 minutes) the broker drops it (a "duplicate" ack, then removed); after it,
 * the consumer's idem_consume marker makes the second copy an ack without effect.
 * The relay records the broker's max_payload in the store (idem_outbox_set_broker_limit)
 * at open and whenever a reconnect finds another one, so idem_outbox_put refuses data that
 * could never be published. A message the broker refuses for good all the same (its
 * max_payload shrank, or the stream's max_msg_size is smaller), or on a subject no stream
 * takes (JetStream, answering, said so for 5 rounds in a row; a publish nobody answered
 * while JetStream is away or restarting never counts), is parked (idem_outbox_park: kept
 * in the store, out of the outbox), logged at ERROR with its seq and msg_id and counted
 * (parked): the messages behind it are relayed. Create the streams before the relay.
 * Off by default: nothing is relayed until a program starts a relay in its server
 * process. Several relays on one shared store may publish a message twice: the same two
 * guards cover it.
 * A broker may lose what it acked (JetStream acks before its disk has it, and syncs every
 * 2 minutes by default): an acked message is therefore kept in the store (idem_outbox_keep)
 * for the broker's sync interval (keep_ms, or what the broker reports in its varz when the
 * relay's user may ask; removed at once when it reports sync_always). At open and after
 * each reconnect the relay asks the broker for the newest kept message of each stream
 * (its sequence; up to 64 streams); when one is gone, or another message holds its
 * sequence, or a publish is acked at a sequence at or below the newest acked in its
 * stream, every kept message is put back into the outbox
 * (idem_outbox_kept_restore) and published again, before anything newer: the duplicate
 * window drops those the broker still has, the consumers' markers any other repeat. */

typedef struct idem_nats_relay_opts {
    const char *url;          /* required */
    unsigned batch;           /* default 64 (1..IDEM_OUTBOX_MAX_BATCH): messages per round */
    unsigned idle_ms;         /* default 100: an empty outbox is looked at this often */
    unsigned publish_wait_ms; /* default 5000: one publish waits this long for its ack */
    /* Called after a publish was acked, before its removal (tests crash here). */
    void (*on_published)(const idem_outbox_msg *m, bool duplicate, void *arg);
    void *event_arg;
    idem_log_fn log_fn; /* failures once per outage, and one line per round at INFO */
    void *log_arg;
    /* default (and 0) 120000, nats-server's default sync_interval: how long an acked
       message stays kept when the broker does not say how it syncs (nats-server 2.9 never
       does); a broker that reports a longer sync_interval: that long; sync_always: not
       kept at all. */
    unsigned keep_ms;
} idem_nats_relay_opts;

typedef struct idem_nats_relay_counts {
    uint64_t published;   /* publishes the broker acked (stored) */
    uint64_t duplicates;  /* publishes the broker's dedupe window dropped */
    uint64_t removed;     /* messages removed from the outbox after their ack */
    uint64_t failures;    /* publishes or removals that failed (the message stays) */
    uint64_t parked;      /* messages the broker refused for good, parked (idem_outbox_park) */
    uint64_t kept;        /* acked messages kept now, the broker may still lose them */
    uint64_t kept_age_ms; /* how long ago the oldest of them was acked */
    uint64_t losses;      /* times the broker came back without a kept message */
    uint64_t restored;    /* kept messages put back into the outbox after a loss */
    uint64_t connected;   /* 1 while connected to the broker, 0 while it is away */
} idem_nats_relay_counts;

typedef struct idem_nats_relay idem_nats_relay;

IDEM_API void idem_nats_relay_opts_init(idem_nats_relay_opts *o);
/* Connects to the broker, or keeps trying in the background when it cannot be reached
 * (never UNAVAILABLE: a program embedding the relay starts during a broker outage, and
 * its outbox keeps filling meanwhile), reconnecting forever afterwards. INVALID_ARGUMENT
 * for options out of bounds. */
IDEM_API idem_code idem_nats_relay_open(idem_nats_relay **out, idem_store *st,
                                        const idem_nats_relay_opts *o);
/* One round on the caller's thread: publishes up to batch messages in order, stopping at
 * the first failure (order kept; a message refused for good is parked and passed over),
 * then removes the acked ones. *relayed (may be NULL):
 * messages acked this round. IDEM_OK also for an empty outbox; UNAVAILABLE at once while
 * the broker is away (call again: the connection comes back by itself, and is checked
 * for a loss before the first publish). */
IDEM_API idem_code idem_nats_relay_run_once(idem_nats_relay *r, unsigned *relayed);
/* Rounds on a thread of its own until idem_nats_relay_close. */
IDEM_API idem_code idem_nats_relay_start(idem_nats_relay *r);
IDEM_API void idem_nats_relay_stats(idem_nats_relay *r, idem_nats_relay_counts *out);
IDEM_API void idem_nats_relay_close(idem_nats_relay *r);

/* ---- dead letters, for a person (idemctl dead) ----
 * The dead letters a consumer published into a stream (the stream that captures its
 * dead_letter_subject): listed with their reasons, replayed to their original subject, or
 * purged. Only messages that carry IDEM_NATS_DEAD_REASON count: any other message of the
 * stream is passed over by the list and refused (FAILED_PRECONDITION) by replay and purge.
 * One connection, each call bounded by the broker's answer (5 s). */
typedef struct idem_nats_dead_letters idem_nats_dead_letters;

/* Connects to url and checks that stream exists: UNAVAILABLE when the broker cannot be
 * reached, NOT_FOUND when it has no such stream. */
IDEM_API idem_code idem_nats_dead_open(idem_nats_dead_letters **out, const char *url,
                                       const char *stream);

/* Calls fn with each dead letter from stream sequence from (0: the first) on, oldest
 * first, until max were shown, fn returned false or the stream's last message was read.
 * The message (valid during the call): subject the dead letter's, stream_seq its sequence
 * in this stream, key its IDEM_NATS_KEY_HEADER, delivered its IDEM_NATS_DEAD_DELIVERED, the
 * reason and the rest in its headers. *next (may be NULL): the sequence to go on from, 0
 * when the stream holds nothing after the last one read. */
IDEM_API idem_code idem_nats_dead_list(idem_nats_dead_letters *d, uint64_t from, size_t max,
                                       bool (*fn)(const idem_nats_msg *dead, void *arg), void *arg,
                                       uint64_t *next);

/* Publishes the payload of dead letter seq again to its original subject
 * (IDEM_NATS_DEAD_SUBJECT) with IDEM_NATS_KEY_HEADER and Nats-Msg-Id set to its key, so
 * that the consumer finds the original's key whether it keys by payload, key header or
 * message id (the original's other headers are not kept), and, once the broker acked
 * that publish, removes the dead letter. Every durable on that subject receives the copy:
 * where the message took effect, its marker makes the copy a duplicate, provided it keys
 * messages as the dead-lettering consumer does. FAILED_PRECONDITION for a dead letter whose
 * payload was cut (IDEM_NATS_DEAD_TRUNCATED: the copy would be another message) or that
 * names no subject; ALREADY_EXISTS when the broker dropped the copy as a duplicate of a
 * message with that id inside its duplicate window (the dead letter is kept: replay it
 * after the window); NOT_FOUND when the stream has no message seq, or no stream takes
 * the subject; an error after the publish says that it was published (a replay again
 * is then a duplicate the consumer's marker absorbs). */
IDEM_API idem_code idem_nats_dead_replay(idem_nats_dead_letters *d, uint64_t seq);

/* Removes dead letter seq from the stream. NOT_FOUND when the stream has no message seq. */
IDEM_API idem_code idem_nats_dead_purge(idem_nats_dead_letters *d, uint64_t seq);

/* Disconnects and frees d (NULL: nothing). */
IDEM_API void idem_nats_dead_close(idem_nats_dead_letters *d);

/* ---- metrics ----
 * The counts of a consumer (idem_nats_stats) or a relay (idem_nats_relay_counts) on
 * srv's GET /metrics from now on (server.h, idem_server_add_metrics), labelled
 * consumer="name" (relay="name"): name is 1..IDEM_MAX_CONSUMER_GROUP bytes, copied (the
 * durable's name is a good one). c (r) must stay open until
 * idem_server_remove_metrics(srv, *id) or idem_server_destroy(srv): remove it before
 * closing it (and close it before destroying a server whose own store it uses).
 * docs/operations.md lists the series. */
IDEM_API idem_code idem_server_add_nats_consumer(idem_server *srv, idem_nats_consumer *c,
                                                 const char *name, unsigned *id);
IDEM_API idem_code idem_server_add_nats_relay(idem_server *srv, idem_nats_relay *r,
                                              const char *name, unsigned *id);

#ifdef __cplusplus
}
#endif
#endif

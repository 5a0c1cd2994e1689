/* Business toolkit: the patterns that make a business effect happen once, built on the
 * store's transactions (txn.h).
 *
 *   store txn      a business write transaction outside an RPC call
 *   state machine  one-way states; advance(from → to) is a compare-and-set in a txn
 *   versioned      records with a version: update-if-version (optimistic lock), and a
 *                  bounded retry helper for version conflicts
 *   consume        at-least-once messages consumed once per (group, key) (防重表)
 *   outbox         messages written in the business txn, relayed to a broker (nats.h)
 *
 * Every function works on both stores with the same code (txn.h says how each keeps
 * its transactions). Functions taking an idem_store and writing (idem_store_run_txn,
 * idem_consume, idem_consume_purge) open their own write txn: called from inside a
 * transactional handler or another idem_store_run_txn they answer IDEM_FAILED_PRECONDITION
 * (LMDB: the thread already holds the one writer; PostgreSQL: the inner transaction could
 * wait for the outer's row locks forever). Inside a txn use the idem_txn variants.
 * docs/recipes.md maps each pattern to its use and says when not to use it. */
#ifndef IDEMRPC_TOOLKIT_H
#define IDEMRPC_TOOLKIT_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"
#include "store.h"
#include "txn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- store txn ---- */

/* Business work inside a write txn. Returning IDEM_OK commits, anything else aborts. */
typedef idem_code (*idem_txn_fn)(idem_txn *t, void *arg);

/* Runs fn in a new write txn: commits when fn returns IDEM_OK, else aborts (none of fn's
 * writes remain) and returns fn's code. A failed commit (IDEM_RESOURCE_EXHAUSTED when the
 * store is full) also leaves nothing written. */
IDEM_API idem_code idem_store_run_txn(idem_store *st, idem_txn_fn fn, void *arg);

/* ---- state machine ---- */

#define IDEM_SM_MAX_STATES 32
#define IDEM_SM_MAX_TRANSITIONS 64
#define IDEM_SM_MAX_STATE 31   /* bytes of a state name */
#define IDEM_SM_MAX_ENTITY 255 /* bytes of an entity id */

typedef struct idem_sm_transition {
    const char *from;
    const char *to;
} idem_sm_transition;

/* A declaration, usually a static const. Entities' states live in the business database
 * `db` (entity id → state name, no NUL), so idem_store_app_get() reads them too. */
typedef struct idem_state_machine {
    const char *db;
    const char *const *states;
    size_t n_states;
    const idem_sm_transition *transitions; /* the only allowed moves */
    size_t n_transitions;
} idem_state_machine;

typedef enum idem_sm_outcome {
    IDEM_SM_ADVANCED = 1, /* the state was `from` and is now `to`: do the transition's effect */
    IDEM_SM_DUPLICATE,    /* the state already was `to`: nothing written, do nothing */
} idem_sm_outcome;

/* IDEM_OK, or IDEM_INVALID_ARGUMENT naming the fault: no db, 0 or more than 32 states, a
 * name empty or longer than 31 bytes, a repeated state, a transition naming an undeclared
 * state, a self-loop or a repeated transition, more than 64 transitions, transitions that
 * form a cycle (open → closed → open: a retried move arriving after the way back would
 * find its `from` again and take effect twice; a state that recurs is a new entity id per
 * round, e.g. "door-7/2"). Every function below validates the machine first, so a bad
 * declaration never writes. */
IDEM_API idem_code idem_sm_validate(const idem_state_machine *m);

/* True when from → to is declared. */
IDEM_API bool idem_sm_allowed(const idem_state_machine *m, const char *from, const char *to);

/* Creates entity in `state` (a declared state). IDEM_ALREADY_EXISTS when the entity
 * exists in any state; nothing is written then. */
IDEM_API idem_code idem_sm_create(idem_txn *t, const idem_state_machine *m, const char *entity,
                                  const char *state);

/* Copies entity's state into buf (cap > IDEM_SM_MAX_STATE). IDEM_NOT_FOUND when absent. */
IDEM_API idem_code idem_sm_get(idem_txn *t, const idem_state_machine *m, const char *entity,
                               char *buf, size_t cap);
/* The same outside a txn (a read txn of its own). */
IDEM_API idem_code idem_store_sm_get(idem_store *st, const idem_state_machine *m,
                                     const char *entity, char *buf, size_t cap);

/* Compare-and-set of entity's state inside t, checked in this order:
 *   from → to not declared          IDEM_FAILED_PRECONDITION ("illegal transition")
 *   entity absent                   IDEM_NOT_FOUND
 *   state == to                     IDEM_OK, *outcome = IDEM_SM_DUPLICATE
 *   state == from                   IDEM_OK, *outcome = IDEM_SM_ADVANCED, state := to
 *   any other state                 IDEM_FAILED_PRECONDITION (idem_errmsg() names it)
 * Only IDEM_SM_ADVANCED writes. outcome may be NULL. Undeclared names and bad entity ids
 * are IDEM_INVALID_ARGUMENT. */
IDEM_API idem_code idem_sm_advance(idem_txn *t, const idem_state_machine *m, const char *entity,
                                   const char *from, const char *to, idem_sm_outcome *outcome);

/* ---- versioned records (optimistic lock) ---- */

#define IDEM_VERSIONED_MAX_VALUE 65536 /* bytes of a versioned value */

/* A versioned record is stored as be32 magic ‖ be64 version ‖ value in a business
 * database. Versions start at 1 and grow by 1 per put; 0 means "absent". Deleting one
 * with idem_txn_del() restarts it at 1 (ABA): keep versioned records instead. */

/* Reads key's value and version in t. *val points into the map until t ends. Absent:
 * IDEM_NOT_FOUND with *version = 0. A value that is not a versioned record: IDEM_DATA_LOSS. */
IDEM_API idem_code idem_versioned_get(idem_txn *t, const char *db, const void *key, size_t klen,
                                      const void **val, size_t *vlen, uint64_t *version);

/* Writes val as version expected + 1 if key's version is `expected` (0: key absent).
 * Any other version: IDEM_ABORTED ("version conflict"), nothing written. new_version may
 * be NULL. */
IDEM_API idem_code idem_versioned_put(idem_txn *t, const char *db, const void *key, size_t klen,
                                      uint64_t expected, const void *val, size_t vlen,
                                      uint64_t *new_version);

/* Snapshot read outside a txn; *val is malloc'd (free it), NULL when absent. */
IDEM_API idem_code idem_store_versioned_get(idem_store *st, const char *db, const void *key,
                                            size_t klen, void **val, size_t *vlen,
                                            uint64_t *version);

/* One attempt of an optimistic update: read a snapshot, decide, write if the version is
 * unchanged. attempt counts from 1. IDEM_ABORTED means "conflict, run me again". */
typedef idem_code (*idem_attempt_fn)(void *arg, uint32_t attempt);

#define IDEM_CONFLICT_MAX_ATTEMPTS 100

typedef struct idem_conflict_policy {
    uint32_t max_attempts; /* 0 = 5; capped at IDEM_CONFLICT_MAX_ATTEMPTS */
    uint32_t base_ms;      /* backoff before the 2nd attempt, doubling; 0 = 2 */
    uint32_t max_ms;       /* backoff cap; 0 = 100 */
    /* Called once, on the retrying thread, when every attempt conflicted: compensate,
     * alert. fn_arg is the arg given to idem_retry_on_conflict. May be NULL. */
    void (*on_exhausted)(void *fn_arg, uint32_t attempts, void *hook_arg);
    void *hook_arg;
} idem_conflict_policy;

/* Runs fn until it returns anything but IDEM_ABORTED, at most max_attempts times, with a
 * ±50 % jittered backoff between attempts (a loop, never past max_attempts). Returns fn's
 * last code; when all attempts conflicted, calls on_exhausted and returns IDEM_ABORTED
 * ("version conflict: gave up after N attempts"). p may be NULL (defaults). */
IDEM_API idem_code idem_retry_on_conflict(const idem_conflict_policy *p, idem_attempt_fn fn,
                                          void *arg);

/* ---- message-consume dedupe (防重表) ---- */

/* The reserved business database of consumed markers (stored as "app.idem.consumed").
 * Business database names starting with "idem." belong to the toolkit: do not use them. */
#define IDEM_CONSUME_DB "idem.consumed"
#define IDEM_MAX_CONSUMER_GROUP 64 /* bytes */
#define IDEM_MAX_MSG_KEY 255       /* bytes */
#define IDEM_CONSUME_MAX_PURGE 10000

typedef enum idem_consume_verdict {
    IDEM_CONSUME_RETRY = 0, /* nothing recorded, fn's writes rolled back: redeliver */
    IDEM_CONSUME_ACK = 1,   /* consumed now or before: ack the message */
    /* The call itself is wrong and redelivering cannot help: a group or key out of
     * bounds, no store or fn, a store without transactions, or a call from inside a
     * transaction. fn did not run, nothing was recorded; info.code says which.
     * Dead-letter the message (and fix the caller). */
    IDEM_CONSUME_REJECT = 2,
} idem_consume_verdict;

typedef struct idem_consume_info {
    bool duplicate;          /* ACK for a message consumed before: fn did not run */
    idem_code code;          /* IDEM_OK on ACK; else fn's code or the store's error */
    uint64_t consumed_at_ms; /* ACK: when the (first) consumption committed, unix ms */
    /* RETRY: fn failed while the store's connection under its txn broke (a database
     * restart or failover): the store failed, not the message. */
    bool store_failed;
    /* RETRY (code IDEM_ABORTED): another transaction is consuming (group, msg_key) right
     * now, in its fn (PostgreSQL: it held the marker's row past lock_timeout_ms): a
     * duplicate in progress, to retry later; nothing failed. */
    bool in_progress;
} idem_consume_info;

/* For an at-least-once consumer: runs fn(txn, arg) once per (group, msg_key). The marker
 * and fn's writes commit in one write txn, so a crash leaves both or neither. fn
 * returning IDEM_OK acks; any other code (or a store error) is a retry with nothing
 * recorded. To drop a poison message for good, write your dead-letter entry and return
 * IDEM_OK. group is 1..64 bytes, msg_key 1..255 (else REJECT with INVALID_ARGUMENT): a
 * REJECT is answered for what no redelivery can fix in the call itself; fn's own codes
 * and store errors stay RETRY (fn decides what is final). Markers are kept until
 * idem_consume_purge() removes them. info may be NULL. */
IDEM_API idem_consume_verdict idem_consume(idem_store *st, const char *group, const char *msg_key,
                                           idem_txn_fn fn, void *arg);
IDEM_API idem_consume_verdict idem_consume_ex(idem_store *st, const char *group,
                                              const char *msg_key, idem_txn_fn fn, void *arg,
                                              idem_consume_info *info);

/* Inside a txn (e.g. a transactional handler receiving messages by RPC): records
 * (group, msg_key) as consumed by t. IDEM_OK when new; IDEM_ALREADY_EXISTS when consumed
 * before (nothing written). */
IDEM_API idem_code idem_consume_mark(idem_txn *t, const char *group, const char *msg_key);

/* IDEM_OK with *consumed_at_ms (may be NULL) when (group, msg_key) was consumed, else
 * IDEM_NOT_FOUND. */
IDEM_API idem_code idem_consume_lookup(idem_store *st, const char *group, const char *msg_key,
                                       uint64_t *consumed_at_ms);

/* Deletes, in one write txn, up to max (≤ IDEM_CONSUME_MAX_PURGE) markers consumed before
 * before_ms, oldest first (consumption order). Purge only markers older than the longest
 * redelivery your broker can make: a message redelivered after its marker is gone is
 * consumed again. purged may be NULL. */
IDEM_API idem_code idem_consume_purge(idem_store *st, uint64_t before_ms, size_t max,
                                      size_t *purged);

/* As idem_consume_purge, for group's markers only (a group whose broker keeps messages
 * longer or shorter than another's): deletes, in one write txn, those consumed before
 * before_ms, oldest first, looking at up to max (1..IDEM_CONSUME_MAX_PURGE) slots of the
 * consumption log; other groups' slots count against max and are passed over once (the
 * group keeps where its purge stopped). purged may be NULL. A group out of bounds or max
 * out of range: INVALID_ARGUMENT. For a NATS consumer, idem_nats_consumer_purge_markers
 * derives before_ms from the stream's retention, and records which stream's: it refuses
 * another stream's until this function (your own cutoff) has forgotten it, e.g. when
 * the group moved to another stream. */
IDEM_API idem_code idem_consume_purge_group(idem_store *st, const char *group, uint64_t before_ms,
                                            size_t max, size_t *purged);

/* What idem_consume_group_markers saw of a group's markers. */
typedef struct idem_consume_markers {
    uint64_t count;     /* markers counted, at most max */
    uint64_t oldest_ms; /* the earliest consumption among them (unix ms); 0 when none */
    bool more;          /* the walk stopped at max: the group has more */
} idem_consume_markers;

/* For operators (idemctl): counts the markers of group, up to max (>= 1), and finds the
 * oldest. One read per marker, not a snapshot: markers written or purged meanwhile may be
 * counted or not. A group out of bounds or max 0: INVALID_ARGUMENT. */
IDEM_API idem_code idem_consume_group_markers(idem_store *st, const char *group, size_t max,
                                              idem_consume_markers *out);

/* ---- transactional outbox ---- */

/* The reserved business database of outbox messages (stored as "app.idem.outbox"). */
#define IDEM_OUTBOX_DB "idem.outbox"
#define IDEM_OUTBOX_MAX_SUBJECT 255        /* bytes */
#define IDEM_OUTBOX_MAX_MSG_ID 255         /* bytes: = IDEM_MAX_MSG_KEY, the consumer's key */
#define IDEM_OUTBOX_MAX_DATA (1024 * 1024) /* bytes, a cap (nats-server's default max payload) */
#define IDEM_OUTBOX_MAX_BATCH 1024
/* The bytes of the headers the relay (nats.h) adds to a message whose msg_id has id_len
 * bytes, as NATS counts them against the broker's max_payload: "NATS/1.0\r\n",
 * "Nats-Msg-Id: <msg_id>\r\n", "Idem-Key: <msg_id>\r\n", "\r\n". */
#define IDEM_OUTBOX_RELAY_HEADERS(id_len) (39 + 2 * (size_t)(id_len))

/* Inside t: queues data for subject. The message exists if and only if t commits (no
 * message for a change that rolled back, no change without its message). data must fit
 * the broker with the relay's headers: at most the broker limit a relay recorded
 * (idem_outbox_set_broker_limit; before any: IDEM_OUTBOX_MAX_DATA, nats-server's default
 * max_payload) less IDEM_OUTBOX_RELAY_HEADERS(strlen(msg_id)), and never over
 * IDEM_OUTBOX_MAX_DATA; more is INVALID_ARGUMENT, nothing written. msg_id must be
 * derived from the business change (e.g. "order-42:platform-fee"), never random: the
 * relay publishes it as the broker's dedupe id (Nats-Msg-Id) and the consumer's key
 * (Idem-Key), which is what makes a second publish after a crash harmless. Messages are
 * relayed in put order. Every put writes the outbox's one bounds row: on PostgreSQL it
 * stays locked until t ends, so txns that put run one after the other from their put
 * on (put last); on LMDB there is one writer anyway. */
IDEM_API idem_code idem_outbox_put(idem_txn *t, const char *subject, const char *msg_id,
                                   const void *data, size_t len);

typedef struct idem_outbox_msg {
    uint64_t seq; /* its place in the outbox, for idem_outbox_remove */
    char subject[IDEM_OUTBOX_MAX_SUBJECT + 1];
    char msg_id[IDEM_OUTBOX_MAX_MSG_ID + 1];
    void *data; /* malloc'd (NUL after len): idem_outbox_msgs_free */
    size_t len;
} idem_outbox_msg;

/* Outside a txn: up to max (≤ IDEM_OUTBOX_MAX_BATCH) of the oldest messages into out[],
 * *n of them. Free them with idem_outbox_msgs_free. */
IDEM_API idem_code idem_outbox_peek(idem_store *st, idem_outbox_msg *out, size_t max, size_t *n);
IDEM_API void idem_outbox_msgs_free(idem_outbox_msg *msgs, size_t n);
/* Removes the messages seqs[0..n) (n ≤ IDEM_OUTBOX_MAX_BATCH) in one write txn: call it only
 * after the broker acked their publish. A message removed before is no error. */
IDEM_API idem_code idem_outbox_remove(idem_store *st, const uint64_t *seqs, size_t n);
/* Messages put and not yet removed (an upper bound while removals are out of order). */
IDEM_API idem_code idem_outbox_pending(idem_store *st, uint64_t *pending);

/* Records the largest message the broker takes, headers and data together (NATS: the
 * connection's max_payload), for idem_outbox_put's check; the relay records it each time
 * it finds a new one (at open, after a reconnect). Writes only when it changed. A broker
 * limit of 0 or over 2^31: INVALID_ARGUMENT. */
IDEM_API idem_code idem_outbox_set_broker_limit(idem_store *st, uint64_t max_payload);
/* The limit put applies: the recorded one, else IDEM_OUTBOX_MAX_DATA. */
IDEM_API idem_code idem_outbox_broker_limit(idem_store *st, uint64_t *max_payload);

/* Moves the messages seqs[0..n) out of the outbox in one write txn, like
 * idem_outbox_remove, but keeps each one's stored bytes (the layout outbox.c states) in
 * IDEM_OUTBOX_DB under key 'p' ‖ be64 seq (idem_store_app_get reads it): for a message the
 * broker refuses for good (larger than it takes), which must not hold back the ones behind
 * it. The relay parks them, counts and logs them (nats.h). */
IDEM_API idem_code idem_outbox_park(idem_store *st, const uint64_t *seqs, size_t n);

/* ---- kept messages: acked by a broker that may still lose them ----
 * A broker may ack a publish before it is on its disk (JetStream's file store syncs on a
 * timer): a host crash then loses what it acked. The relay (nats.h) therefore moves an
 * acked message out of the outbox into the kept log (in IDEM_OUTBOX_DB too), with where
 * the broker put it, and drops it there once the broker's sync interval has passed; when
 * the broker comes back without it, it puts every kept message back into the outbox. */
#define IDEM_OUTBOX_MAX_STREAM 255 /* bytes of a stream name */

typedef struct idem_outbox_ack {
    uint64_t seq;        /* the outbox message (idem_outbox_msg.seq) */
    uint64_t stream_seq; /* its sequence in the broker's stream */
    char stream[IDEM_OUTBOX_MAX_STREAM + 1];
} idem_outbox_ack;

typedef struct idem_outbox_kept_info {
    uint64_t count;         /* kept messages */
    uint64_t oldest_ms;     /* when the oldest was acked (0: none kept) */
    idem_outbox_ack newest; /* the one acked last (when count > 0) */
    char newest_msg_id[IDEM_OUTBOX_MAX_MSG_ID + 1];
} idem_outbox_kept_info;

/* In one write txn: moves the acked messages acks[0..n) (n <= IDEM_OUTBOX_MAX_BATCH) out
 * of the outbox (as idem_outbox_remove does) into the kept log, in that order, noting
 * now_ms as their ack time. A message removed before (another relay) is passed over. */
IDEM_API idem_code idem_outbox_keep(idem_store *st, const idem_outbox_ack *acks, size_t n,
                                    uint64_t now_ms);
/* Outside a txn: how many are kept, the oldest's ack time, the newest (read again when
 * another relay changed the log meanwhile; ABORTED after 4 such reads in a row). */
IDEM_API idem_code idem_outbox_kept(idem_store *st, idem_outbox_kept_info *out);
/* In one write txn: drops up to max (<= IDEM_OUTBOX_MAX_BATCH) of the oldest kept
 * messages acked before before_ms (the broker has synced them); *dropped may be NULL. */
IDEM_API idem_code idem_outbox_kept_expire(idem_store *st, uint64_t before_ms, size_t max,
                                           size_t *dropped);
/* In one write txn: puts up to max (<= IDEM_OUTBOX_MAX_BATCH) of the newest kept messages
 * back into the outbox at their own seq (relayed again in put order, before the messages
 * put after them). Newest first: until the last one is back, the newest still kept is
 * one the broker lost, so a relay that crashes half way finds the loss again. */
IDEM_API idem_code idem_outbox_kept_restore(idem_store *st, size_t max, size_t *restored);

#ifdef __cplusplus
}
#endif
#endif

/* Calling other services from inside a handler: one effect per hop.
 *
 * A handler that calls another service must send the SAME key downstream on every
 * retry of its own call, or each upstream retry becomes a second downstream effect (a
 * second charge). idem_call_downstream() derives that key from the call itself:
 *
 *   key = "d-" hex(SHA-256(len-prefixed caller, method, effective key, step
 *                          [, "undo" inside an undo] [‖ be64 generation when > 0]))
 *
 * so every attempt, every re-run after a crash or a lease takeover, on any instance,
 * sends the same downstream key for the same step. The generation (journaled steps
 * only) is the request's: kept with its fingerprint by its first run that derives a key
 * or records a step, and drawn afresh (the claim's fence, which only grows store-wide)
 * for the key's next request, after a release for a final failure, or once the call's
 * record expired: a key's later requests never derive an earlier one's downstream keys
 * (see compensation below). Without IDEM_METHOD_STEPS the generation is always 0: a
 * request after the record expired derives the keys of the one before. The downstream
 * caller is this service (the client's own caller and signing identity), never the
 * upstream caller.
 * The call also inherits the upstream caller's whole-call deadline
 * (idem_call_overall_deadline_ms: over all of its attempts, not the one attempt that
 * reached us; an attempt that times out is retried and waits for this run) minus a
 * margin, so that the answer
 * still gets back in time), the request id, and W3C trace context (metadata
 * traceparent / tracestate, passed on unchanged: the downstream's parent is the
 * upstream's caller's span, as a proxy would leave it), so one logical request can be
 * followed across services
 * in the logfmt lines (request_id=..., trace_id=...).
 *
 * For downstreams that are not idemrpc services (an HTTP payment API with its own
 * Idempotency-Key header), idem_call_derive_key() gives the same key to send there. */
#ifndef IDEMRPC_DOWNSTREAM_H
#define IDEMRPC_DOWNSTREAM_H

#include "chain.h"
#include "client.h"
#include "status.h"
#include "store.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_MAX_STEP 64        /* bytes of a step name: [A-Za-z0-9._-] */
#define IDEM_DERIVED_KEY_LEN 66 /* "d-" + 64 hex digits */
#define IDEM_HOP_MARGIN_MS 50   /* kept back from the upstream deadline (at most 10 % of it) */

/* The downstream key of `step` of this call into out. IDEM_FAILED_PRECONDITION when the
 * call has no idempotency key (nothing stable to derive from: make the method
 * KEY_REQUIRED); IDEM_INVALID_ARGUMENT for a step name that is empty, too long or has
 * other characters. In a journaled call on a server without a re-driver, the first key
 * of a run whose generation is new keeps the generation first (one commit): IDEM_ABORTED
 * when the run lost its claim, a store's code (UNAVAILABLE) when that failed; no key
 * then. */
IDEM_API idem_code idem_call_derive_key(const idem_call *call, const char *step,
                                        char out[IDEM_DERIVED_KEY_LEN + 1]);

/* idem_client_call() as step `step` of call: req's idempotency_key is the derived key
 * (req must not set one, in the field or in metadata, nor a caller: INVALID_ARGUMENT),
 * its deadline the smaller of req's (or the client's) and the time the upstream call
 * has left minus the margin (DEADLINE_EXCEEDED without sending when nothing is left),
 * its request id the upstream's unless req sets one, and the upstream's traceparent /
 * tracestate metadata are added unless req sets them. The client retries as usual,
 * always with that key. */
IDEM_API idem_code idem_call_downstream(idem_call *call, idem_client *client, const char *step,
                                        const idem_request *req, idem_result *out);

/* ---- journaled steps ----
 *
 * A handler with several external effects (reserve stock, then charge) must not repeat
 * the first when it runs again after a crash, a transient failure or a lease takeover.
 * idem_call_step(call, "reserve", fn, arg, &out) runs fn once per call and step: its
 * output is recorded durably, bound to the call's claim, before idem_call_step returns;
 * when the call runs again (same caller, method, key and request), a recorded step
 * returns its output without running fn (out->replayed). Steps plus derived keys make a
 * multi-effect handler exactly once end to end, as long as each downstream honours its
 * key: fn itself may still run twice if the process dies after fn's effect and before
 * its record, so give fn's effect the step's derived key (idem_call_downstream with the
 * same step name does). The record rides out a store that is full or briefly unreachable
 * (RESOURCE_EXHAUSTED, UNAVAILABLE) for up to 10 s, as the outcome's completion does;
 * a record still refused after that is returned, and the next run runs fn again.
 *
 * Only an owner may run a step: idem_call_step checks that the call's record is still
 * IN_PROGRESS under this run's claim, with its lease running, and that the run's own
 * count of its lease (from the moment its claim or last renewal was asked for, which a
 * late answer cannot lengthen) has not run out, before fn runs; and again (the claim) in
 * the transaction that records the output. A run that lost its claim (its lease
 * expired and another run took over, or completed the call) gets IDEM_ABORTED: it does not run fn,
 * cannot overwrite what the new owner recorded nor leave a journal behind; if it finds the step
 * already recorded it gets that output. (A claim lost while fn runs is seen only by the record:
 * fn's effect then stands, the at-least-once edge above. The handler itself does not start once
 * that count has run out: the call is answered IDEM_ABORTED "claim lost", nothing written.) The
 * journal lives in the store (business database "idem.steps", LMDB or PostgreSQL) and is deleted
 * when the call's outcome is recorded; a released call keeps it for its retry. With the server's
 * re-driver (idem_server_opts.redrive_interval_ms) the call's request is kept with it, so that a
 * call whose owner died is finished without a client retry. For claim-mode handlers
 * (IDEM_METHOD_CACHED and friends); a transactional handler's writes already commit together
 * (FAILED_PRECONDITION). Call steps in the same order on every run. At most IDEM_MAX_STEPS steps
 * per call, IDEM_MAX_STEP_OUTPUT bytes each. */

#define IDEM_MAX_STEPS 32
#define IDEM_MAX_STEP_OUTPUT 65536

typedef struct idem_step_result {
    void *data; /* malloc'd output (free with idem_step_result_clear); may be NULL if len 0 */
    size_t len;
    bool replayed; /* recorded by an earlier run: fn did not run now */
} idem_step_result;

/* The step's work: sets out->data (malloc'd, handed over) and out->len. Any code but
 * IDEM_OK records nothing (the next run runs fn again) and is returned as is. */
typedef idem_code (*idem_step_fn)(idem_call *call, void *arg, idem_step_result *out);

IDEM_API idem_code idem_call_step(idem_call *call, const char *step, idem_step_fn fn, void *arg,
                                  idem_step_result *out);
IDEM_API void idem_step_result_clear(idem_step_result *r);

/* ---- compensation (sagas) ----
 *
 * A step whose effect can be taken back names its undo. When the call then ends in a
 * final failure (the handler's own final code, a step's final error, INVALID_ARGUMENT
 * whether the method stores it or not), the undos of the steps this run completed or
 * replayed run in reverse order before the answer is recorded. Each undo is journaled like
 * a step: it runs once per call even across crashes, and a run that finds it recorded
 * skips it. Inside an undo, idem_call_downstream() and idem_call_derive_key() with the
 * undone step's name give the undo's own derived key (not the step's), so a downstream
 * dedupes the undo too.
 *
 * Once compensation has started, the call's outcome is that failure: a later run (a
 * client retry, or the re-driver after a crash) replays the recorded steps, runs no new
 * step (idem_call_step returns the failure without running fn), and finishes the undos.
 *
 * The key afterwards (README "Sagas"):
 *   every completed step undone → the call is RELEASED, the caller gets the failure with
 *       metadata idem-compensated=all, and the next request with this key (the corrected
 *       one, or the same) runs afresh: its derived keys are new (a generation of the key
 *       is mixed in), so no downstream says "key reused" and none replays an old effect;
 *   a completed step without an undo (or whose undo failed finally) → the failure is
 *       STORED and replayed to the same request (metadata idem-compensated=partial when
 *       some undos ran); another request needs another key;
 *   an undo failed transiently → the call is released with its journal (the caller gets
 *       UNAVAILABLE): a retry, or the re-driver, finishes the compensation.
 * A release after a final failure with no step completed also gives the key's next run
 * a new generation. Undos run while the call still holds its claim (max_run_ms bounds the
 * handler and its compensation together); duplicates wait as for a running call.
 *
 * An undo runs after the handler has returned (and maybe in a later run, after a crash).
 * It gets what it needs about this call from done, the step's output as recorded (the
 * same bytes on every run: put in it what the undo needs, e.g. the reservation's id),
 * and from call (its request, key, caller). arg is the step's undo_arg: a context that
 * outlives the call, as a handler's arg does (the server's client, its configuration),
 * never the handler's stack, whose frame is gone when the undo runs; idem_call_step_with
 * refuses an undo_arg that points into it (FAILED_PRECONDITION, before fn runs). */
typedef idem_code (*idem_undo_fn)(idem_call *call, const char *step, const idem_step_result *done,
                                  void *arg);

typedef struct idem_step_opts {
    idem_undo_fn undo; /* NULL: the step's effect stands whatever happens after */
    void *undo_arg;    /* passed to undo: outlives the call (see idem_undo_fn) */
    /* The step changes nothing outside (it makes an id, reads a price): nothing to
     * undo, and it does not keep a compensated call's key. */
    bool effect_free;
} idem_step_opts;

/* idem_call_step with options (opts may be NULL: idem_call_step). An undo may not itself
 * run steps (FAILED_PRECONDITION). */
IDEM_API idem_code idem_call_step_with(idem_call *call, const char *step, idem_step_fn fn,
                                       void *arg, const idem_step_opts *opts,
                                       idem_step_result *out);

/* ---- the journals, for operators (idemctl) ----
 *
 * What the store holds of a journaled call: the steps its runs recorded, whether the
 * re-driver lists it (a call that may still be running or was abandoned) and how far a
 * compensation got. Read-only, one read per entry: not a snapshot. */

typedef enum idem_journal_state {
    IDEM_JOURNAL_STEPS,        /* steps recorded, no compensation started */
    IDEM_JOURNAL_COMPENSATING, /* a final failure started the undos; some have not run */
    IDEM_JOURNAL_COMPENSATED,  /* every recorded step's undo ran; the outcome is not yet
                                  recorded (the journal goes with it) */
} idem_journal_state;

#define IDEM_JOURNAL_CURSOR 33        /* bytes of an idem_journal_next cursor */
#define IDEM_JOURNAL_MAX_MESSAGE 1024 /* bytes of failure_msg: a call's message */

typedef struct idem_journal_info {
    char caller[IDEM_MAX_CALLER + 1], method[IDEM_MAX_METHOD + 1], key[IDEM_MAX_KEY + 1];
    uint8_t fingerprint[IDEM_FINGERPRINT_LEN]; /* the request's */
    bool listed;     /* the re-driver holds it: a run is live, or it will run it again */
    unsigned runs;   /* re-runs the re-driver counted (listed only) */
    uint64_t fence;  /* the owner (fence) of the last run that recorded a step; 0: none */
    unsigned steps;  /* steps recorded, every run's */
    unsigned undone; /* of them, undos that ran */
    idem_journal_state state;
    idem_code failure; /* the failure a compensation answers; IDEM_OK: none started */
    char failure_msg[IDEM_JOURNAL_MAX_MESSAGE + 1];
} idem_journal_info;

/* The next journal the re-driver holds after cursor (all zero: the first), advancing it;
 * IDEM_NOT_FOUND after the last one; IDEM_DATA_LOSS for an entry that cannot be read,
 * IDEM_UNIMPLEMENTED for a newer version's (the cursor moves past either: call again for
 * the rest); another code: the store's (the cursor stays). */
IDEM_API idem_code idem_journal_next(idem_store *st, uint8_t cursor[IDEM_JOURNAL_CURSOR],
                                     idem_journal_info *out);
/* The journal of the request with that record key and fingerprint (a record's, see
 * idem_record.fingerprint); IDEM_NOT_FOUND when it has none. */
IDEM_API idem_code idem_journal_get(idem_store *st, const idem_key_ref *key,
                                    const uint8_t fingerprint[IDEM_FINGERPRINT_LEN],
                                    idem_journal_info *out);
/* The state's name: "steps", "compensating", "compensated". */
IDEM_API const char *idem_journal_state_name(idem_journal_state s);

#ifdef __cplusplus
}
#endif
#endif

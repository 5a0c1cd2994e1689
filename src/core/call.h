/* The internals of an idem_call and of the runtime the built-in interceptors share.
 * The server fills a call from a decoded Request; interceptors and handlers see it only
 * through the accessors in chain.h. */
#ifndef IDEMRPC_CALL_H
#define IDEMRPC_CALL_H

#include <pthread.h>
#include <stdatomic.h>

#include "arena.h"
#include "idemrpc.pb-c.h"
#include "internal.h"
#include "runtime.h"

#define IDEM_MAX_METADATA 64 /* entries per request or response */
/* Response entries kept for the library (request-id, idem-key, idem-first-at,
 * retry-after-ms): handlers may set IDEM_MAX_METADATA - IDEM_RESERVED_METADATA. */
#define IDEM_RESERVED_METADATA 4
#define IDEM_MAX_METADATA_NAME 128 /* bytes */
#define IDEM_MAX_METADATA_VALUE 4096
#define IDEM_MAX_REQUEST_ID 128
#define IDEM_MAX_MESSAGE 1024
#define IDEM_TOKEN_ISSUE_METHOD "idem.Token/Issue"

/* A registered method. */
typedef struct idem_method {
    char *name;
    idem_handler_fn fn;
    void *arg;
    idem_method_opts opts;
} idem_method;

/* Rejection reasons (metrics label values; the HTTP front maps some to statuses). */
#define IDEM_REASON_BAD_FRAME "bad_frame"
#define IDEM_REASON_TOO_LARGE "too_large"
#define IDEM_REASON_BUSY "busy"
#define IDEM_REASON_UNIMPLEMENTED "unimplemented"
#define IDEM_REASON_KEY_REQUIRED "key_required"
#define IDEM_REASON_BAD_KEY "bad_key"
#define IDEM_REASON_KEY_REUSED "key_reused"
#define IDEM_REASON_IN_PROGRESS "in_progress"
#define IDEM_REASON_TOKEN "token"
#define IDEM_REASON_STORE "store"
#define IDEM_REASON_DEBOUNCED "debounced"
#define IDEM_REASON_DEADLINE "deadline"
#define IDEM_REASON_CLAIM_LOST "claim_lost"
#define IDEM_REASON_RESULT_GONE "result_gone" /* done before; its result expired */
#define IDEM_REASON_IDENTITY "identity"       /* unauthenticated, or not the verified caller */

/* Library rejection: idem_call_fail plus the reason. */
idem_code idem__reject(idem_call *call, const char *reason, idem_code code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Counters and the log sink of one server (observe.c). */
typedef struct idem_observer idem_observer;
void idem__log(idem_observer *obs, idem_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A logfmt quoted value: s between double quotes, with backslash, quote and control
 * characters escaped (\\ \" \n \r \t \xNN), so that a value a client chose (request
 * id, method, caller, an error detail naming them) stays one value on one line. Writes
 * at most cap bytes into out, cutting s (never an escape) when it does not fit; returns
 * out. Every client-supplied value in an idem__log line goes through it. */
#define IDEM_LOGQ_CAP 600
const char *idem__logfmt_quote(char *out, size_t cap, const char *s);
/* The key= field of the log lines: the first 8 bytes of SHA-256(key) in hex ("-" when
 * key is NULL), so a line about a key can be matched without logging the key itself. */
#define IDEM_LOG_KEY_HASH_CAP 17
void idem__log_key_hash(char out[IDEM_LOG_KEY_HASH_CAP], const char *key);
idem_observer *idem__observer_create(const idem_server_opts *opts);
void idem__observer_destroy(idem_observer *obs);
/* One log line (at INFO) and the counters for a finished call. */
void idem__observe_call(idem_observer *obs, const idem_call *call, uint64_t latency_us);
void idem__observe_in_flight(idem_observer *obs, int delta);
void idem__observe_waiting(idem_observer *obs, int delta);
void idem__observe_announcement(idem_observer *obs); /* one completion heard from the store */
/* What the re-driver did: ran a handler again, re-ran a call that did not execute
 * (replayed, refused), removed a completed call's journal, gave up on a call. */
enum idem__redrive_event {
    IDEM__REDRIVE_RAN,
    IDEM__REDRIVE_OTHER,
    IDEM__REDRIVE_REMOVED,
    IDEM__REDRIVE_GAVE_UP_COUNT,
    IDEM__REDRIVE_EVENTS
};
void idem__observe_redrive(idem_observer *obs, enum idem__redrive_event what);
/* A lease event: a running claim's lease ran out before a renewal reached the store
 * (keeper.c), or a claim took over a key whose lease had run out (result_cache). */
enum idem__lease_event { IDEM__LEASE_LAPSED, IDEM__LEASE_TAKEN_OVER, IDEM__LEASE_EVENTS };
void idem__observe_lease(idem_observer *obs, enum idem__lease_event what); /* obs may be NULL */
/* The store's size and outbox as the sweeper last read them (sweeper.c). */
typedef struct idem__store_gauges {
    uint64_t in_progress, completed, tombstones, map_size, map_used; /* idem_store_stats */
    uint64_t outbox_pending, outbox_oldest_age_ms;
} idem__store_gauges;
void idem__observe_store(idem_observer *obs, const idem__store_gauges *g);
void idem__observe_store_failure(idem_observer *obs); /* a read of them failed */
/* Prometheus text exposition of the counters; malloc'd, NUL-terminated. */
char *idem__metrics_text(idem_observer *obs);
/* The metrics sources of a server (metric_sources.c; server.h, idem_server_add_metrics):
 * the observer's, rendered after its own metrics. */
typedef struct idem__metric_sources idem__metric_sources;
idem__metric_sources *idem__metric_sources_create(void);
void idem__metric_sources_destroy(idem__metric_sources *ms); /* drops every source */
idem_code idem__metric_sources_add(idem__metric_sources *ms, idem_metrics_fn fn, void *arg,
                                   void (*drop)(void *arg), unsigned *id);
void idem__metric_sources_remove(idem__metric_sources *ms, unsigned id);
/* Every source's samples as Prometheus text (malloc'd; "" without any), NULL when out of
 * memory. */
char *idem__metric_sources_text(idem__metric_sources *ms);
/* The observer's sources. */
idem__metric_sources *idem__observer_sources(idem_observer *obs);

/* The token interceptor's and idem.Token/Issue's configuration. */
typedef struct idem_token_cfg {
    idem_store *store;
    uint64_t ttl_ms;
    bool consume_with_claim; /* result_cache is in the chain: the claim consumes tokens */
} idem_token_cfg;

/* result_cache's configuration (server defaults; methods may override). */
typedef struct idem_cache_cfg {
    idem_store *store;
    uint64_t result_ttl_ms, lease_ms, max_wait_ms, max_run_ms;
    uint64_t tombstone_ttl_ms; /* 0: none */
} idem_cache_cfg;

/* Why a chain returned without an answer. */
typedef enum idem_suspend {
    IDEM__SUSPEND_NONE = 0,
    /* fast_only call reached a step that may block: run it again on a worker. */
    IDEM__SUSPEND_DEFER,
    /* A duplicate waits for its key: park the call, resume it at resume_pos. */
    IDEM__SUSPEND_PARK,
    /* The handler's outcome is being committed (idem_call.recording), or its claim
     * applied (idem_call.claiming): the store hands the call back (idem_runtime.resume)
     * and it resumes at resume_pos. */
    IDEM__SUSPEND_RECORD,
} idem_suspend;

/* A response metadata entry: name and value in one block, which name owns (value
 * points into it). */
typedef struct idem_kv {
    char *name, *value;
} idem_kv;

struct idem_call {
    const Idem__V1__Request *req; /* borrowed: decoded request */
    const idem_method *method;    /* NULL: unknown method */
    idem_runtime *rt;
    char request_id[IDEM_MAX_REQUEST_ID + 1];
    /* Request.caller, or the verified caller (identity.c) before the chain runs. */
    char caller[IDEM_MAX_CALLER + 1];
    bool caller_verified;

    char key[IDEM_MAX_KEY + 1];
    idem_key_source key_source;
    const char *token_to_consume; /* set by token, cleared by whoever consumed it */

    idem_code code;
    char *message;
    uint8_t *payload;
    size_t payload_len;
    idem_kv *meta; /* meta_cap entries, meta_count of them set */
    size_t meta_count, meta_cap;
    bool replayed;
    bool executed; /* the method handler ran in this call */
    /* This run found its claim or its own count of its lease lost while its process lived
     * (a step or the handler's start refused, or its completion found another owner):
     * it did not die (the re-driver does not count it as a death). */
    bool claim_lost;
    /* This run left its compensation unfinished (an undo failed transiently and the key
     * was released, saga.c): it did not die either. */
    bool undos_unfinished;
    /* Run on nng's callback thread: only non-blocking steps (decode, key resolution, a
     * replay read, queueing a shared claim when fast_claim); anything else suspends with
     * IDEM__SUSPEND_DEFER. */
    bool fast_only;
    /* fast_only, and the server hands back a call suspended with IDEM__SUSPEND_RECORD
     * (its queue has room): result_cache may queue the claim of a new key here and let
     * the store hand the call on once the claim is applied (idem_call.claiming). */
    bool fast_claim;
    bool parkable; /* on a worker that can park it (the server's job_step) */
    idem_suspend suspend;
    /* PARK: where to resume, which in-flight bucket to wait on and the generation seen
     * before the store read, and when to look again (monotonic ms). */
    size_t resume_pos;
    uint32_t park_bucket;
    uint64_t park_gen, park_wake_ms;
    bool park_refused;      /* the in-flight table is full: answer "in progress" */
    uint64_t wait_until_ms; /* monotonic end of a duplicate's wait; 0 = not waiting yet */
    uint32_t poll_ms;       /* the next re-read interval while waiting */
    /* The front sends the reply as a serialized Response (the nng front), so a replay
     * may stay as the stored bytes: set before the chain runs. */
    bool wire_reply;
    /* A replay kept as stored bytes (result_cache, when wire_reply and the bytes are in
     * the canonical form idem__replay_wire_ok checks): code and replayed are set, the
     * message, payload and metadata are not loaded (idem__call_materialize_replay loads
     * them). Owned by the call; freed with the response, or, when replay_borrow.end is
     * set, lent by the store (its read held open until the reply is built): ended then. */
    uint8_t *replay_wire;
    size_t replay_wire_len;
    idem_borrow replay_borrow;
    char replay_first_at[24];                  /* the idem-first-at value of that replay */
    uint8_t fingerprint[IDEM_FINGERPRINT_LEN]; /* idem__call_fingerprint's, once computed */
    bool has_fingerprint;
    uint64_t fence;          /* owner id of the claim the handler runs under */
    idem_store *claim_store; /* where that claim is (journaled steps), NULL outside one */
    uint64_t claim_ticket;   /* its commit shared with the completion (store.h), or 0 */
    /* idem__mono_ms() before the claim's request left: its lease counts from then, never
     * from the answer (result_cache: the lease keeper's entry, keeper.c). */
    uint64_t claim_asked_ms;
    /* The lease keeper's entry of that claim while the handler runs (claim mode), else
     * NULL: the owner's own view of whether it still holds the key. */
    struct idem_keep *claim_keep;
    /* Whether fence was read back from the disk (idem_call_fence): a refused fence
     * means the claim is not durable, and the call is answered UNAVAILABLE whatever its
     * handler said (result_cache). Reset with fence. */
    enum { IDEM__FENCE_UNCHECKED, IDEM__FENCE_DURABLE, IDEM__FENCE_REFUSED } fence_state;
    /* IDEM__SUSPEND_RECORD: what result_cache needs once the commit of the handler's
     * outcome has ended (st, err), and the turns of the worker that suspended the call
     * and of the commit's end: the second to come hands the call on (idem__call_recorded). */
    struct idem__recording {
        bool active;
        idem_code code, st; /* the handler's, the commit's */
        uint64_t owner;
        struct idem_keep *keep;
        atomic_int turns;
        char err[256];
    } recording;
    /* IDEM__SUSPEND_RECORD with claiming.active: a shared claim the fast path queued
     * (result_cache.c); what the store said of it once applied, read on the worker that
     * resumes the call. The hand-over takes the turns of recording (the fast path's
     * and the store's). */
    struct idem__claiming {
        bool active;
        idem_code code;
        int outcome; /* an idem_claim_outcome */
        uint64_t owner, ticket;
        char err[256];
    } claiming;
    /* Journaled steps (toolkit/steps.c, saga.c): the generation of the derived keys,
     * read at the claim, and whether it is this claim's fence not yet kept in the store
     * (step_gen_pin: kept before the first key derived from it leaves); the step whose
     * undo runs now (its derived keys are the undo's); the steps this run completed with
     * their undos, freed by saga_free (idem__call_fini). */
    uint64_t step_gen;
    atomic_bool step_gen_pin;
    const char *undoing;
    struct idem__saga *saga;
    void (*saga_free)(idem_call *call);
    /* The frame that runs the handler and then its undos (result_cache), on that thread,
     * NULL outside: the frames below it are gone when an undo runs, so a step refuses an
     * undo_arg among them (the handler's locals). */
    const void *undo_frame;
    pthread_t undo_thread;
    /* A re-driven call: the key its first run had (result_cache refuses another). */
    const char *pinned_key;
    const char *reason; /* static: why the library itself rejected the call, or NULL */
    void *user;
    idem_txn *txn; /* transactional handler's write txn, owned by result_cache */
    /* Locks the handler took through idem_call_lock (toolkit/lock.c): what it still
     * holds when it returns is released by locks_release, which the lock sets. */
    struct idem_lock *locks;
    void (*locks_release)(idem_call *call);
};

/* The chain: interceptors in order, then the method handler. */
typedef struct idem_interceptor {
    char *name;
    idem_interceptor_fn fn;
    void *arg;
    bool fast_safe;    /* never blocks in a fast_only call (the built-ins) */
    bool builtin;      /* a built-in that returns what idem_call_next returned, untouched */
    idem_builtin kind; /* which built-in (when builtin) */
} idem_interceptor;

/* The end of one of the two turns of a call suspended with IDEM__SUSPEND_RECORD: true
 * for the second, which then owns the call (resumes it). */
bool idem__call_recorded(idem_call *call);

/* What a suspending step returns; the answer comes later (call->suspend says why). */
idem_code idem__call_suspend(idem_call *call, idem_suspend why);
/* A fast_only call that needs a worker from chain position pos on (the interceptor
 * there, or the handler when pos is the chain's length): the worker resumes it there,
 * without decoding it or running the positions before again. */
idem_code idem__call_defer(idem_call *call, size_t pos);

struct idem_chain {
    idem_interceptor *items;
    size_t n;
};

void idem__call_init(idem_call *call, const Idem__V1__Request *req, const idem_method *m,
                     idem_runtime *rt);
void idem__call_reset_response(idem_call *call);
void idem__call_fini(idem_call *call);
/* Frees n entries and the array that holds them. */
void idem__kv_free(idem_kv *kv, size_t n);
/* Response metadata for the library's own entries: may use the reserved slots. */
idem_code idem__call_set_meta(idem_call *call, const char *name, const char *value);
/* Sets the response message only (code unchanged). */
idem_code idem__call_set_message(idem_call *call, const char *msg);

/* ---- codec.c ---- */
/* Decodes and validates a request frame. On failure returns INVALID_ARGUMENT with the
 * reason in idem_errmsg() and *out = NULL. */
idem_code idem__decode_request(const void *buf, size_t len, Idem__V1__Request **out);
void idem__free_request(Idem__V1__Request *req);
/* Serialized Response of the call as a malloc'd buffer (for storage or the wire). */
idem_code idem__encode_call_response(const idem_call *call, bool for_wire, uint8_t **out,
                                     size_t *len);
/* The same into the len bytes buf_for returns (NULL: out of memory), e.g. a message's
 * body: no intermediate copy. */
idem_code idem__encode_call_response_to(const idem_call *call, bool for_wire,
                                        void *(*buf_for)(void *arg, size_t len), void *arg);
/* Loads a stored response into the call (code, message, payload, metadata). */
idem_code idem__load_call_response(idem_call *call, const void *buf, size_t len);

/* Requests (and, in the client, replies) decoded into an arena: arena.h. */
/* idem__decode_request into a (empty, initialised): on failure a is empty again. The
 * payload, when the frame carries it once, is followed by a NUL byte; writable: it
 * may point into buf itself (whose byte after the payload is then overwritten), which
 * must then outlive the request. */
idem_code idem__decode_request_arena(const void *buf, size_t len, bool writable, idem_arena *a,
                                     Idem__V1__Request **out);

/* Stored replays sent as stored bytes. A stored Response is in canonical form when it
 * is exactly what idem__encode_call_response(for_wire=false) writes for the call that
 * idem__load_call_response makes of it (fields in order, each at most once, no default
 * value written, minimal varints, no unknown field, metadata names unique, non-empty,
 * none a library name, at most IDEM_MAX_METADATA - IDEM_RESERVED_METADATA entries, all
 * within bounds, no NUL in a string): then the Response the decode + re-encode path
 * sends is these bytes followed by the per-call fields (metadata idem-first-at,
 * idem-key, request-id; replayed; request_id), which protobuf-c writes after them. */
bool idem__replay_wire_ok(const void *buf, size_t len);
/* Lets go of call->replay_wire (freed, or its borrow ended) and clears it. */
void idem__call_drop_replay_wire(idem_call *call);
/* The key echoed in metadata idem-key (none for a token), or NULL. */
const char *idem__call_answer_key(const idem_call *call);
/* The wire reply of a call holding replay_wire and no response metadata is
 * replay_wire followed by this suffix (written into out; returns its length): byte for
 * byte what the nng front sent for the materialised call. */
#define IDEM_REPLAY_SUFFIX_MAX 1024
size_t idem__replay_suffix(const idem_call *call, uint8_t out[IDEM_REPLAY_SUFFIX_MAX]);
/* Turns a replay kept as bytes into the loaded form the decode + re-encode path has
 * (stored metadata, idem-first-at, what was set since, idem-key). No-op without
 * replay_wire. */
idem_code idem__call_materialize_replay(idem_call *call);

/* Fingerprint = SHA-256(method ‖ 0 ‖ payload), or with the method's fingerprint
 * extractor SHA-256(method ‖ 0 ‖ 'F' ‖ extracted bytes): which fields make two requests
 * "the same". INVALID_ARGUMENT when the extractor overflows its buffer. */
idem_code idem__call_fingerprint(idem_call *call, uint8_t out[32]); /* computed once */
/* The default: SHA-256(method ‖ 0 ‖ payload). */
bool idem__fingerprint(const char *method, const void *payload, size_t len, uint8_t out[32]);

/* "package.Service/Method": 1..IDEM_MAX_METHOD bytes of printable ASCII without spaces,
 * exactly one '/', neither side empty. INVALID_ARGUMENT (idem_errmsg) otherwise. The
 * same rule for the wire (idem__request_check) and idem_server_register. */
idem_code idem__method_name_check(const char *method);
/* The wire's rule for a configured caller name (a secret's, a uid's, a TLS listener's):
 * 1..IDEM_MAX_CALLER bytes of UTF-8 without control characters, as a request's caller
 * must be. */
bool idem__caller_name_ok(const char *caller);

/* Validates the envelope fields of a request (bounds, UTF-8, method shape): the one
 * check both fronts use. Field names in messages name the HTTP header too. */
idem_code idem__request_check(const Idem__V1__Request *r);

#endif

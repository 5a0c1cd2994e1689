/* The internals of an idem_call and of the runtime the built-in interceptors share.
 * The server fills a call from a decoded Request; interceptors and handlers see it only
 * through the accessors in chain.h. */
#ifndef IDEMRPC_CALL_H
#define IDEMRPC_CALL_H

#include <pthread.h>

#include "idemrpc.pb-c.h"
#include "internal.h"

#define IDEM_MAX_METADATA 64 /* entries per request or response */
/* Response entries kept for the library (request-id, idem-first-at, retry-after-ms):
 * handlers may set IDEM_MAX_METADATA - IDEM_RESERVED_METADATA. */
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

/* Where duplicates in this process wait for a first call to finish. The store is the
 * truth; this only says "look again": every completion or release bumps gen and
 * broadcasts, and waiters also re-poll on a short timer so that an owner in another
 * process is seen too. */
typedef struct idem_waitset {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t gen;
    bool stopping; /* server shutdown: waiters give up at once */
} idem_waitset;

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

/* Library rejection: idem_call_fail plus the reason. */
idem_code idem__reject(idem_call *call, const char *reason, idem_code code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Counters and the log sink of one server (observe.c). */
typedef struct idem_observer idem_observer;
void idem__log(idem_observer *obs, idem_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
idem_observer *idem__observer_create(const idem_server_opts *opts);
void idem__observer_destroy(idem_observer *obs);
/* One log line (at INFO) and the counters for a finished call. */
void idem__observe_call(idem_observer *obs, const idem_call *call, uint64_t latency_us);
void idem__observe_in_flight(idem_observer *obs, int delta);
/* Prometheus text exposition of the counters; malloc'd, NUL-terminated. */
char *idem__metrics_text(idem_observer *obs);

/* Shared by the built-in interceptors; owned by the server. */
typedef struct idem_runtime {
    idem_store *store;
    uint64_t result_ttl_ms, lease_ms, token_ttl_ms, max_wait_ms;
    bool has_result_cache; /* the chain contains result_cache (token consumption) */
    idem_waitset waits;
    idem_observer *obs;
} idem_runtime;

typedef struct idem_kv {
    char *name, *value;
} idem_kv;

struct idem_call {
    const Idem__V1__Request *req; /* borrowed: decoded request */
    const idem_method *method;    /* NULL: unknown method */
    idem_runtime *rt;
    char request_id[IDEM_MAX_REQUEST_ID + 1];

    char key[IDEM_MAX_KEY + 1];
    idem_key_source key_source;
    const char *token_to_consume; /* set by token, cleared by whoever consumed it */

    idem_code code;
    char *message;
    uint8_t *payload;
    size_t payload_len;
    idem_kv *meta;
    size_t meta_count;
    bool replayed;
    bool executed; /* the method handler ran in this call */
    /* Run on nng's callback thread: only non-blocking steps (decode, key resolution, a
     * replay read); anything else answers IDEM__DEFER. */
    bool fast_only;
    const char *reason; /* static: why the library itself rejected the call, or NULL */
    void *user;
    idem_txn *txn; /* transactional handler's write txn, owned by result_cache */
};

/* The chain: interceptors in order, then the method handler. */
typedef struct idem_interceptor {
    char *name;
    idem_interceptor_fn fn;
    void *arg;
    bool fast_safe; /* never blocks in a fast_only call (the built-ins) */
} idem_interceptor;

/* Returned by the chain of a fast_only call that needs a worker thread after all. Not a
 * wire code: the server re-runs such a call on a worker. */
#define IDEM__DEFER ((idem_code)-1)

struct idem_chain {
    idem_interceptor *items;
    size_t n;
};

void idem__call_init(idem_call *call, const Idem__V1__Request *req, const idem_method *m,
                     idem_runtime *rt);
void idem__call_reset_response(idem_call *call);
void idem__call_fini(idem_call *call);
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
/* Loads a stored response into the call (code, message, payload, metadata). */
idem_code idem__load_call_response(idem_call *call, const void *buf, size_t len);

/* ---- built-in interceptors and method ---- */
idem_code idem__request_id_interceptor(idem_call *call, idem_next next, void *arg);
idem_code idem__token_interceptor(idem_call *call, idem_next next, void *arg);
idem_code idem__result_cache_interceptor(idem_call *call, idem_next next, void *arg);
idem_code idem__debounce_interceptor(idem_call *call, idem_next next, void *arg);
idem_code idem__token_issue_handler(idem_call *call, void *arg);

/* Fingerprint = SHA-256(method ‖ 0 ‖ payload). */
void idem__fingerprint(const char *method, const void *payload, size_t len, uint8_t out[32]);

void idem__waitset_init(idem_waitset *w);
void idem__waitset_fini(idem_waitset *w);
void idem__waitset_notify(idem_waitset *w);
uint64_t idem__waitset_gen(idem_waitset *w);
/* Waits until gen changes or wait_ms passes. Returns false when the server is stopping. */
bool idem__waitset_wait(idem_waitset *w, uint64_t seen_gen, uint64_t wait_ms);
void idem__waitset_stop(idem_waitset *w);

#endif

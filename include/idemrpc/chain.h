/* The interceptor chain: gRPC-style unary interceptors around a method handler.
 *
 * An interceptor either answers the call itself (short-circuit: replay, reject) or calls
 * idem_call_next() and may then inspect the response. The last "next" is the handler.
 * Interceptors know nothing of the transport: an idem_call is the decoded request plus
 * the response being built.
 *
 * Where one runs (server.h): before result_cache it sees every call, replays included;
 * after it (idem_server_use with the default chain) only real executions, inside the
 * claim and, for transactional methods, inside the write transaction. An answer given
 * there without calling idem_call_next is released, never stored and replayed. */
#ifndef IDEMRPC_CHAIN_H
#define IDEMRPC_CHAIN_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_call idem_call;
typedef struct idem_chain idem_chain;

/* Where the chain continues. A value type: pass it on unchanged. */
typedef struct idem_next {
    const idem_chain *chain;
    size_t pos;
} idem_next;

/* Returns the call's final code, which must equal idem_call_code(call). */
typedef idem_code (*idem_interceptor_fn)(idem_call *call, idem_next next, void *arg);

/* Runs the rest of the chain (eventually the handler) and returns its code. */
IDEM_API idem_code idem_call_next(idem_call *call, idem_next next);

/* Where the effective idempotency key came from. */
typedef enum idem_key_source {
    IDEM_KEY_NONE = 0,
    IDEM_KEY_FIELD,     /* Request.idempotency_key */
    IDEM_KEY_METADATA,  /* metadata "idempotency-key" */
    IDEM_KEY_EXTRACTED, /* the method's registered extractor */
    IDEM_KEY_TOKEN,     /* the one-time submit token */
    /* A key idem_client generated because its caller gave none (metadata
     * idem-key-generated): it dedupes retries of one call, but never satisfies
     * IDEM_METHOD_KEY_REQUIRED. */
    IDEM_KEY_GENERATED,
} idem_key_source;

/* ---- the request (read-only; strings are NUL-terminated and valid for the call) ---- */
IDEM_API const char *idem_call_method(const idem_call *call);
/* The caller that scopes keys and tokens: the verified one when the server verified it
 * (README "Security"), else Request.caller as sent ("" when none). */
IDEM_API const char *idem_call_caller(const idem_call *call);
/* true when idem_call_caller() comes from the transport or a signature, not the client's
 * word: an interceptor may refuse unverified callers for some methods. */
IDEM_API bool idem_call_caller_verified(const idem_call *call);
IDEM_API const char *idem_call_request_id(const idem_call *call);
IDEM_API const char *idem_call_token(const idem_call *call);
IDEM_API const void *idem_call_payload(const idem_call *call, size_t *len);
IDEM_API uint32_t idem_call_attempt(const idem_call *call);
IDEM_API uint64_t idem_call_deadline_ms(const idem_call *call); /* 0 = none */
/* The caller's deadline for the whole call, over all its attempts (unix ms, 0 = none):
 * Request.call_deadline_unix_ms (an HTTP request's grpc-timeout), never before this
 * attempt's; the attempt's when the caller sent none (an older client).
 * idem_call_downstream gives downstream calls this one, less a margin. */
IDEM_API uint64_t idem_call_overall_deadline_ms(const idem_call *call);
/* NULL when absent. */
IDEM_API const char *idem_call_metadata(const idem_call *call, const char *name);
IDEM_API size_t idem_call_metadata_count(const idem_call *call);
IDEM_API void idem_call_metadata_at(const idem_call *call, size_t i, const char **name,
                                    const char **value);
/* The resolved idempotency key (unscoped), or NULL before request_id ran / when none. */
IDEM_API const char *idem_call_key(const idem_call *call);
IDEM_API idem_key_source idem_call_key_source(const idem_call *call);
/* The fencing token of the claim this handler runs under: strictly increasing per store,
 * so a downstream system that remembers the highest fence it has seen can refuse a
 * write from an older claim ("UPDATE … WHERE fence < $fence"). 0 when the call runs
 * without a claim (uncached method, no key), and 0 when the claim could not be made
 * durable (see idem_call_durable_fence). On LMDB the claim may share its commit with
 * the completion: the first call then waits for that claim's commit (one LMDB commit,
 * asked for at once) and reads the claim back from the disk, so that a fence that
 * leaves the process is on disk and is never handed out again. On PostgreSQL a
 * transactional handler's claim is in its open transaction: the first call flushes the
 * fence's draw (one commit on a connection of the store's own, waiting for the
 * synchronous standbys; docs/ha.md says what asynchronous replication keeps of it), and
 * refuses the fence when the database restarted since the draw. */
IDEM_API uint64_t idem_call_fence(const idem_call *call);
/* idem_call_fence with the failure said: IDEM_OK and *fence (0: no claim), or
 * IDEM_UNAVAILABLE and *fence 0 when the claim did not reach the disk (its commit and
 * the redo of it failed: a disk error; the draw's flush failed or the database
 * restarted since it) or was taken meanwhile; idem_errmsg() says
 * which. The handler must then not use a fence: whatever it answers, its client gets
 * UNAVAILABLE (retry with the same key) and nothing is recorded. */
IDEM_API idem_code idem_call_durable_fence(idem_call *call, uint64_t *fence);

/* ---- the response ---- */
/* Sets the response code and payload (copied). Returns code, so a handler can end with
 * `return idem_call_reply(call, IDEM_OK, buf, n);`. */
IDEM_API idem_code idem_call_reply(idem_call *call, idem_code code, const void *payload,
                                   size_t len);
/* Sets an error code and a human-readable message (printf-style, truncated to 1 KiB);
 * clears any payload. Returns code. */
IDEM_API idem_code idem_call_fail(idem_call *call, idem_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Adds (or replaces) response metadata; both strings are copied. At most 60 entries
 * (64 minus 4 kept for the library's request-id, idem-key, idem-first-at,
 * retry-after-ms), names
 * up to 128 bytes, values up to 4 KiB. Returns IDEM_OK, IDEM_INVALID_ARGUMENT for a
 * too-long entry or IDEM_RESOURCE_EXHAUSTED beyond the count. */
IDEM_API idem_code idem_call_set_response_metadata(idem_call *call, const char *name,
                                                   const char *value);
IDEM_API idem_code idem_call_code(const idem_call *call);
IDEM_API const char *idem_call_message(const idem_call *call);
IDEM_API const void *idem_call_response_payload(const idem_call *call, size_t *len);
IDEM_API const char *idem_call_response_metadata(const idem_call *call, const char *name);
/* True when the response is a stored first result. */
IDEM_API bool idem_call_replayed(const idem_call *call);

/* Per-call user pointer for interceptors that pass state to the handler. */
IDEM_API void idem_call_set_user(idem_call *call, void *user);
IDEM_API void *idem_call_user(const idem_call *call);

#ifdef __cplusplus
}
#endif
#endif

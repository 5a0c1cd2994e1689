/* idem_client: req0 client with a Feign-style retryer.
 *
 * One logical call = one idempotency key, fixed before the first attempt as the server
 * resolves it (the idempotency_key field, else metadata "idempotency-key", else the
 * token; generated when the caller gives none) and sent unchanged on every retry with
 * `attempt` + 1.
 * A timeout is "unknown", never "failed": retrying with the same key is what makes it
 * safe, so a call with no key and no token is resent only when it provably did not
 * reach the handler (it never left, or the server turned it away as busy).
 * Thread-safe: concurrent idem_client_call()s share the socket, each on its own nng
 * context. */
#ifndef IDEMRPC_CLIENT_H
#define IDEMRPC_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_client idem_client;

#define IDEM_CLIENT_KEY_MAX 255

typedef struct idem_retry_policy {
    uint32_t max_attempts;  /* 0 = 5; 1 = no retry */
    uint32_t period_ms;     /* first backoff; 0 = 100 */
    uint32_t max_period_ms; /* cap; 0 = 1000 */
    double multiplier;      /* 0 = 1.5 */
    double jitter;          /* +- fraction of each backoff; 0 = 0.2, <0 = none */
} idem_retry_policy;

typedef struct idem_client_opts {
    uint32_t attempt_timeout_ms; /* one attempt's reply wait; 0 = 2000 */
    uint32_t deadline_ms;        /* whole call incl. retries, sent as deadline; 0 = 10000 */
    size_t max_frame;            /* reply limit; 0 = 4 MiB + 64 KiB */
    const char *caller;          /* default caller, copied; NULL = "" */
    idem_retry_policy retry;
    /* true: a call without key or token is sent without a key (the server decides:
     * a KEY_REQUIRED method refuses it) instead of with a generated one. The retryer
     * does not resend such a call after a timeout, a lost connection or an answer its
     * handler may have given: only when it never left, or after RESOURCE_EXHAUSTED
     * with retry-after-ms (the server's back-pressure, before its queue). */
    bool never_generate_key;
    /* Signs every attempt (metadata idem-signature, idem-timestamp) as its caller (the
     * request's, else the default) with this secret, copied; 16..256 bytes. NULL = unsigned.
     * README "Security". */
    const char *signing_secret;
    /* A proxy signing for the callers it names: its own name (metadata idem-signer), copied.
     * NULL = the caller signs for itself. */
    const char *signer;
    /* tls+tcp:// URLs: the CA that signed the server's certificate (required for TLS: the
     * server is always verified), this client's certificate and key (one PEM file) for
     * servers that require client certificates, and the name to check the server's
     * certificate against (NULL = the URL's host). Files are read at idem_client_open. */
    const char *tls_ca_file;
    const char *tls_cert_key_file;
    const char *tls_server_name;
} idem_client_opts;

typedef struct idem_metadata_kv {
    const char *name;
    const char *value;
} idem_metadata_kv;

/* Per-call request fields; all optional except method. Strings are not retained. */
typedef struct idem_request {
    const char *method;
    /* NULL = metadata "idempotency-key" if given (the field and it naming two different
     * keys is INVALID_ARGUMENT, nothing sent), else the token, else generated once */
    const char *idempotency_key;
    const char *token;
    const char *caller;     /* NULL = the client's default */
    const char *request_id; /* NULL = server generates */
    const idem_metadata_kv *metadata;
    size_t metadata_count;
    const void *payload;
    size_t payload_len;
    uint32_t deadline_ms; /* 0 = the client's default */
} idem_request;

/* The result of a call; owned by the caller, free with idem_result_clear(). message,
 * request_id and the metadata strings live in one block with the metadata table (free
 * none of them alone); payload is a malloc'd buffer of its own, which a caller may take
 * (then set payload to NULL before the clear). */
typedef struct idem_result {
    idem_code code;
    char *message;
    void *payload;
    size_t payload_len;
    idem_metadata_kv *metadata; /* strings owned by the result */
    size_t metadata_count;
    bool replayed;
    char *request_id;
    /* The key the server used (response metadata idem-key: e.g. the method's business
     * key), else the one every attempt carried (field or metadata); "" when a token
     * stood in for it, or none. */
    char key[IDEM_CLIENT_KEY_MAX + 1];
    uint32_t attempts;
} idem_result;

IDEM_API void idem_client_opts_init(idem_client_opts *opts);

/* Dials every URL (non-blocking: a server may start later). */
IDEM_API idem_code idem_client_open(idem_client **out, const char *const *urls, size_t n,
                                    const idem_client_opts *opts);
/* Closes the client's connections and frees it. Waits for nng at most 2 s: past that
 * (nng 1.5.2 stuck on a late reply, docs/security.md) it returns and nng keeps the
 * socket until the process exits. */
IDEM_API void idem_client_close(idem_client *c);

/* Runs one logical call with retries. Returns the final code (also in out->code): the
 * last attempt's answer, also when the call's deadline leaves no time for the next
 * backoff; a transport failure on the last attempt is IDEM_UNAVAILABLE or
 * IDEM_DEADLINE_EXCEEDED. */
IDEM_API idem_code idem_client_call(idem_client *c, const idem_request *req, idem_result *out);

/* Calls idem.Token/Issue; copies the token into buf (cap >= 32). */
IDEM_API idem_code idem_client_issue_token(idem_client *c, const char *caller, char *buf,
                                           size_t cap, uint64_t *expires_unix_ms);

IDEM_API const char *idem_result_metadata(const idem_result *r, const char *name);
IDEM_API void idem_result_clear(idem_result *r);

/* Backoff before retry number `retry` (1 = before the 2nd attempt), with jitter drawn
 * from rnd in [0,1). Exposed for tests and for callers building their own loops. */
IDEM_API uint32_t idem_backoff_ms(const idem_retry_policy *p, uint32_t retry, double rnd);

#ifdef __cplusplus
}
#endif
#endif

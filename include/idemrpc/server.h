/* idem_server: an nng rep0 server that runs every call through the interceptor chain.
 *
 * Life cycle: idem_server_opts_init → set fields → idem_server_create → register methods
 * (and interceptors) → idem_server_listen (one or more URLs) → ... → idem_server_destroy.
 * Registration must happen before the first listen; the server is then read-only except
 * for its own internal state. */
#ifndef IDEMRPC_SERVER_H
#define IDEMRPC_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "chain.h"
#include "status.h"
#include "store.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_server idem_server;

/* A Redis debounce window (interceptors/debounce.c): a double-click shield in front of
 * the result cache, never the guarantee. Redis down → calls pass (fail open), logged. */
typedef struct idem_debounce idem_debounce;
/* url: redis://HOST[:PORT]; window_ms > 0. Connects lazily. */
IDEM_API idem_code idem_debounce_create(idem_debounce **out, const char *url, uint32_t window_ms);
IDEM_API void idem_debounce_destroy(idem_debounce *d);

/* A method handler: reads the request through idem_call_*(), answers with
 * idem_call_reply()/idem_call_fail() and returns the code. Runs on an idemrpc worker
 * thread; it may block. */
typedef idem_code (*idem_handler_fn)(idem_call *call, void *arg);

/* Derives a business key from the request (e.g. out_trade_no + channel of a payment
 * callback). Writes a NUL-terminated key of at most cap-1 bytes into buf and returns
 * true, or returns false when the payload carries none. */
typedef bool (*idem_key_extractor_fn)(const idem_call *call, char *buf, size_t cap, void *arg);

/* Says which parts of the request make two requests with one key "the same" (e.g.
 * out_trade_no + amount of a payment callback, but not its timestamp or signature):
 * writes those bytes into buf (cap = IDEM_MAX_FINGERPRINT_INPUT), sets *len and returns
 * true; false rejects the call with INVALID_ARGUMENT. Without one, the whole payload
 * is the fingerprint. */
typedef bool (*idem_fingerprint_fn)(const idem_call *call, void *buf, size_t cap, size_t *len,
                                    void *arg);
#define IDEM_MAX_FINGERPRINT_INPUT 4096

/* Canonical fingerprints, opt-in per method (docs/semantics.md "Canonical
 * fingerprints"): set idem_method_opts.fingerprint to one of these and requests whose
 * bytes differ but whose meaning is the same are the same request (a retry re-encoded
 * by another client library replays; a changed value is still key reuse). A payload
 * these cannot read is refused INVALID_ARGUMENT before the store is touched.
 *
 * idem_fingerprint_protobuf: fingerprint_arg is the request message's
 * `const ProtobufCMessageDescriptor *` (protoc-c's `foo__descriptor`). The payload is
 * decoded and re-encoded by protobuf-c: fields in number order, a field sent twice
 * counts once (the last, as protobuf decodes it), packed and unpacked repeated fields
 * alike, proto3 fields at their default left out. Presence stays meaningful where the
 * schema has it (proto2 `optional`, proto3 `optional`, oneof, messages); unknown fields
 * and the order of repeated and map entries count as sent. Messages nested more than
 * 100 deep are refused (protobuf-c's decoder recurses once per level).
 *
 * idem_fingerprint_json: fingerprint_arg unused. The payload is parsed as JSON
 * (jansson; any value, not only an object) and written back with object keys sorted and
 * no whitespace; escapes such as \u00e9 count as the characters they stand for.
 * Numbers keep their kind: 1 and 1.0 differ, 1.0 and 1e0 do not. A duplicated object
 * key is refused (which one counts is not defined), so is a real number a double cannot
 * hold exactly enough to tell it from another (more than 15 significant digits, or
 * below 2.2e-308): send such amounts as integers or strings. Integers are exact up to
 * 64 bits; a larger one is refused. In a build without jansson
 * (-Djson=disabled) registering a method with it fails UNIMPLEMENTED. */
IDEM_API bool idem_fingerprint_protobuf(const idem_call *call, void *buf, size_t cap, size_t *len,
                                        void *arg);
IDEM_API bool idem_fingerprint_json(const idem_call *call, void *buf, size_t cap, size_t *len,
                                    void *arg);

enum idem_method_flags {
    /* Claim-before-run through the result cache; results replayed to duplicates. */
    IDEM_METHOD_CACHED = 1u << 0,
    /* Calls without a key chosen by the caller (field, metadata, token or the method's
     * business key) are rejected with INVALID_ARGUMENT: a key idem_client generated
     * does not count, since a caller that forgot the key would get a new one per call. */
    IDEM_METHOD_KEY_REQUIRED = 1u << 1,
    /* Calls need a one-time token from idem.Token/Issue, consumed by the first claim;
     * the token is the key unless the request names one (a business key or an explicit
     * key). Implies IDEM_METHOD_CACHED. */
    IDEM_METHOD_TOKEN_REQUIRED = 1u << 2,
    /* The handler runs inside the store's write transaction (txn.h): its business
     * writes and the result record commit atomically. Implies IDEM_METHOD_CACHED and
     * IDEM_METHOD_KEY_REQUIRED; listen fails when the chain has no result_cache. */
    IDEM_METHOD_TRANSACTIONAL = 1u << 3,
    /* With a debounce window configured (idem_server_opts.debounce): a repeat of the
     * same key within the window is answered ALREADY_EXISTS "duplicate submit" before
     * any store work. Retries (attempt > 1) pass to the result cache. */
    IDEM_METHOD_DEBOUNCE = 1u << 4,
    /* The handler journals its steps (idem_call_step, downstream.h): every recorded
     * outcome of the call also deletes its journal, whichever run made the steps.
     * Implies IDEM_METHOD_CACHED and IDEM_METHOD_KEY_REQUIRED; not with TRANSACTIONAL. */
    IDEM_METHOD_STEPS = 1u << 5,
};

typedef struct idem_method_opts {
    unsigned flags; /* idem_method_flags */
    /* Optional business key. When set and it finds a key, that key IS the call's key:
     * a different explicit key (field or metadata) is rejected with INVALID_ARGUMENT,
     * the same one is accepted, a generated one is ignored. */
    idem_key_extractor_fn extractor;
    void *extractor_arg;
    uint64_t result_ttl_ms;  /* 0 = server default (24 h) */
    uint64_t lease_ms;       /* 0 = server default (30 s): renewed every lease/3 while the
                                handler runs, so only a dead or stuck owner loses it. A
                                transactional handler on PostgreSQL holds its claim in its
                                transaction instead: its session may sit idle in it (work
                                between two statements) for at most lease_ms, after which
                                the database ends it and the retry runs */
    uint32_t transient_mask; /* codes released instead of stored; 0 = IDEM_TRANSIENT_CODES */
    /* Longest run the lease is renewed for; past it the lease lapses and a retry may
     * take over. 0 = server default (5 min). */
    uint64_t max_run_ms;
    /* false (default): a handler's INVALID_ARGUMENT is released, not stored, so the
     * caller can fix the request and retry with the same key (Stripe, IETF draft).
     * true: stored like any final answer (a retry with another payload is key reuse). */
    bool store_invalid_argument;
    idem_fingerprint_fn fingerprint; /* optional; see idem_fingerprint_fn */
    void *fingerprint_arg;
    /* The dedup horizon after the result TTL; 0 = the server's tombstone_ttl_ms. */
    uint64_t tombstone_ttl_ms;
} idem_method_opts;

typedef enum idem_log_level {
    IDEM_LOG_OFF = 0,
    IDEM_LOG_ERROR = 1, /* storage failures, the default */
    IDEM_LOG_INFO = 2,  /* plus one line per call */
} idem_log_level;

/* Receives one logfmt line (no newline). Called from worker threads, concurrently. */
typedef void (*idem_log_fn)(void *arg, idem_log_level level, const char *line);

/* Caller identity (README "Security"). A signing secret of one caller: requests whose
 * idem-signature verifies under it are from that caller. A proxy entry (a TLS-terminating
 * proxy, an API gateway) may sign for any caller it names in Request.caller; it signs as
 * itself (metadata idem-signer / header Idem-Signer). */
typedef struct idem_caller_secret {
    const char *caller; /* 1..IDEM_MAX_CALLER bytes, printable */
    const char *secret; /* IDEM_MIN_CALLER_SECRET..IDEM_MAX_CALLER_SECRET bytes */
    bool proxy;
} idem_caller_secret;
#define IDEM_MIN_CALLER_SECRET 16
#define IDEM_MAX_CALLER_SECRET 256
#define IDEM_MAX_CALLER_SECRETS 1024 /* entries in idem_server_opts.caller_secrets */

/* An ipc:// peer uid (SO_PEERCRED, from the kernel) and the caller it is. */
typedef struct idem_ipc_caller {
    uint64_t uid;
    const char *caller;
} idem_ipc_caller;
#define IDEM_MAX_IPC_CALLERS 1024

typedef struct idem_server_opts {
    size_t contexts; /* concurrent calls (nng contexts, parked duplicates included); 0 = 256 */
    size_t workers;  /* handler threads; 0 = 2 x cores */
    /* Back-pressure: a call received while this many wait for a worker is answered
     * RESOURCE_EXHAUSTED "server busy" (with retry-after-ms) at once. 0 = no limit
     * beyond contexts. */
    size_t max_queue;
    size_t max_frame; /* bytes; 0 = 4 MiB. Larger requests get RESOURCE_EXHAUSTED */
    /* LMDB directory, created if missing; ignored if store set. One open per directory
     * per process: a second server on it fails (FAILED_PRECONDITION); share opts.store. */
    const char *db_path;
    size_t map_size;        /* LMDB map size; 0 = 1 GiB */
    unsigned store_flags;   /* idem_store_flags for the store opened from db_path */
    idem_store *store;      /* optional shared store, not owned by the server */
    uint64_t result_ttl_ms; /* 0 = 24 h */
    uint64_t lease_ms;      /* 0 = 30 s */
    uint64_t token_ttl_ms;  /* 0 = 10 min */
    uint64_t max_wait_ms;   /* longest duplicate wait (the request deadline may cut it); 0 = 10 s */
    uint64_t sweep_interval_ms; /* 0 = 60 s */
    size_t sweep_batch;         /* records deleted per write txn; 0 = 1000 */
    /* true (default): the chain starts request_id → token → result_cache, and
     * interceptors added with idem_server_use() run after them, around the handler
     * (idem_server_use_first() puts one in front of them).
     * false: the chain is exactly what idem_server_use()/idem_server_use_builtin() add;
     * listen checks it (idem_server_use_builtin). */
    bool default_chain;
    /* Logs: per call "request_id method caller key (hash) outcome code latency_us";
     * tokens and payloads are never logged. Default IDEM_LOG_ERROR to stderr. */
    idem_log_level log_level;
    idem_log_fn log_fn; /* NULL = stderr */
    void *log_arg;
    /* Debounce window for IDEM_METHOD_DEBOUNCE methods, not owned; in the default chain
     * it runs after token, before result_cache. NULL = none. */
    idem_debounce *debounce;
    /* HTTP front (idem_server_listen_http): header naming the caller; NULL = "X-Caller". */
    const char *http_caller_header;
    uint64_t max_run_ms; /* default of idem_method_opts.max_run_ms; 0 = 5 min */
    /* Duplicates parked on a running first call (they hold no thread); more are answered
     * ABORTED "in progress" at once. 0 = 4096. */
    size_t max_waiters;
    /* HTTP requests queued or running at once; more get 429 with Retry-After. 0 = 1024. */
    size_t http_max_pending;
    /* ---- who is calling (README "Security"); all copied at idem_server_create ----
     * Nothing set: Request.caller / X-Caller is taken as sent (trusted network only).
     * A verified caller (a mapped ipc uid, else a valid signature) scopes keys and
     * tokens; a request naming another caller is PERMISSION_DENIED. */
    const idem_caller_secret *caller_secrets;
    size_t n_caller_secrets;
    uint64_t signature_window_ms; /* accepted clock skew, both directions; 0 = 5 min */
    const idem_ipc_caller *ipc_callers;
    size_t n_ipc_callers;
    /* Calls without a verified caller get UNAUTHENTICATED (nothing runs). */
    bool require_verified_caller;
    /* ---- the re-driver (README "Calling other services") ----
     * 0 (default): off; a call whose owner died waits for its client's retry. Else,
     * calls of IDEM_METHOD_STEPS methods that record or replay a step are listed (with
     * their packed request, payload and metadata included) until their outcome is
     * recorded or their client's run releases them, and every
     * redrive_interval_ms the server looks at up to redrive_batch of them. One whose
     * owner's lease has run out (the process died, or the handler outlived its
     * max_run_ms) is run again from its stored request: one at a time, on a thread of
     * its own, as the caller and under the key its first run had, with its method's
     * max_run_ms (else the server's) as its deadline, at most redrive_max_runs times
     * (a re-run released after a transient failure stays listed and is run again).
     * On a store shared by several instances, turn it on in all of them: calls an
     * instance without it serves are not listed.
     * Recorded steps replay, the rest run, and the outcome is stored for the client's
     * retry. It also deletes step journals that outlived their call's outcome. Re-runs
     * that ran the handler are logged at the error level; all are counted
     * (idem_redrives_total). */
    uint64_t redrive_interval_ms;
    size_t redrive_batch; /* listed calls looked at per pass; 0 = 16 */
    /* Re-runs of one call that died or were released (one that lost its claim or its
     * own lease while its process lived, within max_run_ms, is not counted); 0 = 3, at
     * most 254. Then a call with recorded steps is compensated (its failure: INTERNAL,
     * at most as many runs again to finish that), one without waits for a client. */
    unsigned redrive_max_runs;
    /* ---- HTTP front bounds (README "Security") ----
     * A request must arrive whole within http_request_timeout_ms of its first byte, else
     * 408 and the connection closes (0 = 10 s); a keep-alive connection with no request
     * begun closes after http_idle_timeout_ms (0 = 60 s); a response not taken by the
     * client within http_request_timeout_ms closes the connection. At most
     * http_max_conns connections at once (0 = 1024): more are closed when accepted.
     * A refused request's connection reads what the client still sends for at most 1 s
     * (100 ms of quiet, 64 KiB), then closes. A request not answered within max_run_ms
     * (the longest of the server's and its methods') gets 504 DEADLINE_EXCEEDED and its connection
     * closes (the handler runs on). */
    uint64_t http_request_timeout_ms;
    uint64_t http_idle_timeout_ms;
    size_t http_max_conns;
    /* Bytes the request and answer buffers of all HTTP connections together may hold
     * beyond 4 KiB each (0 = 64 x max_frame, 256 MiB by default). A request whose head or
     * body needs more, or any new request while less than 4 KiB of it is free, is
     * answered 503 UNAVAILABLE with Retry-After: 1 before it runs and its connection
     * closes. An answer that does not fit is not held: 503 with Retry-After: 1 (507
     * RESOURCE_EXHAUSTED when it is larger than the bound) and close; the call ran, a
     * retry with its idempotency key replays the answer. The rest are served. */
    size_t http_max_buffered;
    /* A dedup horizon longer than the result's (docs/semantics.md "Tombstones"): for
     * this long after a COMPLETED result expired, a late duplicate (same key, same
     * fingerprint) is answered ALREADY_EXISTS with metadata idem-result-gone (HTTP: 410
     * Gone) and never runs again; another request under the key is "key reused". The
     * sweep keeps a small tombstone instead of the record meanwhile. 0 (default) = off:
     * an expired result is as no record, as before 0.4. Per method: tombstone_ttl_ms. */
    uint64_t tombstone_ttl_ms;
    /* ---- gRPC front bounds (idem_server_listen_grpc; docs/deploying.md "gRPC") ----
     * Each 0 takes the default in parentheses. Streams per connection, also counting
     * those whose call still runs after the client reset them (100); bytes of one
     * request's header list, SETTINGS_MAX_HEADER_LIST_SIZE (16 KiB; four times that
     * ends the connection); the flow-control window of a stream and of the connection
     * (65535); a request must arrive whole within grpc_request_timeout_ms of its first
     * HEADERS and an answer be taken within it (10 s); a connection with no stream
     * closes after grpc_idle_timeout_ms (60 s); connections (1024); calls queued or
     * running (1024, then RESOURCE_EXHAUSTED); metadata, message and answer bytes of all
     * streams together (64 x max_frame). A message is at most max_frame bytes. A call not
     * answered within max_run_ms is answered DEADLINE_EXCEEDED (the handler runs on). */
    uint32_t grpc_max_streams;
    uint32_t grpc_max_header_list;
    uint32_t grpc_window;
    uint64_t grpc_request_timeout_ms;
    uint64_t grpc_idle_timeout_ms;
    size_t grpc_max_conns;
    size_t grpc_max_pending;
    size_t grpc_max_buffered;
} idem_server_opts;

typedef enum idem_builtin {
    IDEM_BUILTIN_REQUEST_ID,
    IDEM_BUILTIN_TOKEN,
    IDEM_BUILTIN_RESULT_CACHE,
    IDEM_BUILTIN_DEBOUNCE, /* needs idem_server_opts.debounce */
} idem_builtin;

IDEM_API void idem_server_opts_init(idem_server_opts *opts);

/* Functions returning idem_code below return IDEM_OK or an error whose detail is in
 * idem_errmsg() (status.h). */
IDEM_API idem_code idem_server_create(idem_server **out, const idem_server_opts *opts);

/* Name is "package.Service/Method" (copied), checked with the wire's rule: printable
 * ASCII without spaces, exactly one '/', neither side empty. opts may be NULL (plain,
 * uncached). INVALID_ARGUMENT for a bad name, a NULL fn or unknown bits in opts->flags. */
IDEM_API idem_code idem_server_register(idem_server *srv, const char *method, idem_handler_fn fn,
                                        void *arg, const idem_method_opts *opts);

/* Appends an interceptor; name is for logs (copied). With the default chain it runs
 * after result_cache, i.e. only on real executions, inside the claim (after the key is
 * claimed, while the lease is renewed) and, for IDEM_METHOD_TRANSACTIONAL methods,
 * inside the store's write transaction. An answer it gives without calling
 * idem_call_next (the handler did not run: e.g. an auth check answering
 * UNAUTHENTICATED or PERMISSION_DENIED) is never stored: the claim is released and a
 * token it consumed restored, so a corrected retry with the same key runs. */
IDEM_API idem_code idem_server_use(idem_server *srv, const char *name, idem_interceptor_fn fn,
                                   void *arg);
/* Inserts an interceptor at the front of the chain, before the built-ins (after those
 * added earlier with idem_server_use_first), without rebuilding the default chain: it
 * sees every call, replays and rejections included, with no key resolved yet. Like any
 * interceptor before result_cache it stops waiting duplicates from parking (each holds
 * a worker while it waits). Before the first listen. */
IDEM_API idem_code idem_server_use_first(idem_server *srv, const char *name, idem_interceptor_fn fn,
                                         void *arg);
/* Appends a built-in. A custom chain may leave built-ins out, but listen refuses
 * (FAILED_PRECONDITION) one that breaks a promise: built-ins out of the order
 * request_id → token → debounce → result_cache, or one twice; a KEY_REQUIRED method
 * without request_id, a TOKEN_REQUIRED one without token, a CACHED or TRANSACTIONAL one
 * without result_cache. */
IDEM_API idem_code idem_server_use_builtin(idem_server *srv, idem_builtin which);

/* Starts serving on url (tcp://, ipc://, inproc://). May be called more than once. */
IDEM_API idem_code idem_server_listen(idem_server *srv, const char *url);

/* Serves the same chain over HTTP/1.1 on url ("http://127.0.0.1:8080"): POST
 * /{package.Service}/{Method}, body = payload, Idempotency-Key header = key; GET
 * /metrics in the Prometheus text format. See README "HTTP". */
IDEM_API idem_code idem_server_listen_http(idem_server *srv, const char *url);

/* A listener that requires client certificates: a client must present a certificate
 * signed by client_ca_file, and every such client is `caller` (one client CA per
 * listener = one caller; a request that names another caller is PERMISSION_DENIED).
 * Debian's nng 1.5.2 says whether a peer's certificate verified, not whose it is: to
 * tell callers apart, give each its own CA and listener. Files are PEM; cert_key_file
 * holds the server's certificate chain and its private key. */
typedef struct idem_tls_listener {
    const char *cert_key_file;
    const char *client_ca_file;
    const char *caller;
} idem_tls_listener;
/* tls+tcp://HOST:PORT with required client certificates. May be called more than once
 * (one listener per caller). */
IDEM_API idem_code idem_server_listen_tls(idem_server *srv, const char *url,
                                          const idem_tls_listener *tls);
/* The HTTP front over TLS with required client certificates (https://HOST:PORT):
 * instead of idem_server_listen_http, not besides it. */
IDEM_API idem_code idem_server_listen_https(idem_server *srv, const char *url,
                                            const idem_tls_listener *tls);
/* Serves the same chain over gRPC (HTTP/2 without TLS, "h2c") on url
 * ("tcp://127.0.0.1:50051"): unary calls to /{package.Service}/{Method}, the message is
 * the payload (raw bytes), metadata idempotency-key = key; grpc.health.v1.Health/Check
 * answers SERVING. Once per server. UNIMPLEMENTED when built without libnghttp2
 * (-Dgrpc). See docs/deploying.md "gRPC". */
IDEM_API idem_code idem_server_listen_grpc(idem_server *srv, const char *url);
/* The gRPC front over TLS (instead of idem_server_listen_grpc, not besides it) on url
 * (tcp://HOST:PORT): ALPN h2, TLS 1.2 or later, a client certificate signed by
 * tls->client_ca_file required, every such client being tls->caller. */
IDEM_API idem_code idem_server_listen_grpc_tls(idem_server *srv, const char *url,
                                               const idem_tls_listener *tls);
/* The port of the gRPC listener (for port 0); 0 when there is none. */
IDEM_API int idem_server_grpc_port(const idem_server *srv);
/* The port of the HTTP listener (for port 0). */
IDEM_API int idem_server_http_port(const idem_server *srv);

/* For tcp:// with port 0: the port actually bound by the first tcp listener. */
IDEM_API int idem_server_port(const idem_server *srv);

/* Lets running handlers finish and send their replies, answers waiting duplicates
 * UNAVAILABLE, drops queued calls without running them (their clients retry), closes
 * the socket and frees everything. With the store unreachable it returns, however many
 * calls were running, within the longest running handler plus 10 s (a finished
 * handler's outcome rides out an outage that long) plus two of the store's reconnect
 * bounds (PostgreSQL: idem_pg_opts.reconnect_ms, 10 s by default): one for the last
 * attempt of that retry, one for the outcomes left to record later, which are tried
 * once, and not at all after one attempt the store did not take (the lease keeper's
 * last one included). */
IDEM_API void idem_server_destroy(idem_server *srv);

/* The store the server uses (its own or opts.store). */
IDEM_API idem_store *idem_server_store(idem_server *srv);

/* ---- more metrics on GET /metrics ----
 *
 * A part of the program that keeps its own counts (the broker's consumer and relay:
 * idem_server_add_nats_consumer / idem_server_add_nats_relay in nats.h) adds them to the
 * server's /metrics as a source: a function the server calls on every scrape, which fills
 * out with up to max samples and returns how many. It runs on the thread that answers
 * /metrics, one scrape at a time, so it must be quick and read its counts thread-safely.
 * Samples of one name from several sources are printed under one HELP/TYPE. */
typedef struct idem_metric {
    const char *name;        /* [a-zA-Z_:][a-zA-Z0-9_:]*; a sample with another name is dropped */
    const char *help;        /* one line (NULL: none) */
    bool counter;            /* a counter (name ends in _total); else a gauge */
    const char *label;       /* NULL, or one label's name ([a-zA-Z_][a-zA-Z0-9_]*) ... */
    const char *label_value; /* ... and value (escaped by the server) */
    double value;
} idem_metric;
typedef size_t (*idem_metrics_fn)(void *arg, idem_metric *out, size_t max);
#define IDEM_MAX_METRICS_SOURCES 16 /* sources per server */
#define IDEM_MAX_METRICS_SAMPLES 64 /* max: samples one source gives per scrape */

/* Adds a source; *id (may be NULL) names it for idem_server_remove_metrics. arg must stay
 * valid until that removal or idem_server_destroy, which call drop(arg) (drop may be NULL)
 * after fn's last call. INVALID_ARGUMENT without srv or fn, RESOURCE_EXHAUSTED past
 * IDEM_MAX_METRICS_SOURCES (drop is not called then). */
IDEM_API idem_code idem_server_add_metrics(idem_server *srv, idem_metrics_fn fn, void *arg,
                                           void (*drop)(void *arg), unsigned *id);
/* Removes a source: once it returns, fn is not running and is not called again. An
 * unknown id is ignored. */
IDEM_API void idem_server_remove_metrics(idem_server *srv, unsigned id);

#ifdef __cplusplus
}
#endif
#endif

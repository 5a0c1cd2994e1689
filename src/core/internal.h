/* Internal helpers shared by src/ and interceptors/. Never installed; the symbols are
 * hidden (-fvisibility=hidden), only IDEM_API functions are exported. */
#ifndef IDEMRPC_INTERNAL_H
#define IDEMRPC_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "idemrpc/idemrpc.h"

#define IDEM_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Request metadata set by idem_client when it generated the key itself: a business key
 * from the method's extractor then takes precedence over that random one. */
#define IDEM_META_KEY_GENERATED "idem-key-generated"

/* Records detail for idem_errmsg() and returns code. */
idem_code idem__err(idem_code code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void idem__err_clear(void);
/* Keeps idem_errmsg() across a cleanup that may overwrite it:
 *   idem_errkeep k; idem__err_keep(&k); cleanup(); return idem__err_put(&k, code); */
typedef struct idem_errkeep {
    char msg[512];
} idem_errkeep;
void idem__err_keep(idem_errkeep *k);
idem_code idem__err_put(const idem_errkeep *k, idem_code code);

/* Bytes lent by their owner (e.g. a record in a store's open read transaction): valid
 * until end(a, b) is called, once; end NULL: nothing is lent. */
typedef struct idem_borrow {
    void (*end)(void *a, void *b);
    void *a, *b;
} idem_borrow;

uint64_t idem__now_ms(void);  /* CLOCK_REALTIME, unix ms: stored in records */
uint64_t idem__mono_ms(void); /* CLOCK_MONOTONIC: for waits and timeouts */
uint64_t idem__mono_us(void);
void idem__sleep_ms(uint64_t ms); /* the whole time, across signals */

/* Riding out a transient store failure (a database restarting, a full store): up to
 * IDEM_OUTAGE_RETRY_MS of attempts, pausing 10 ms, doubled up to 500 ms, between them.
 *   idem_outage o = idem__outage_start();
 *   do { code = attempt(); } while (idem__outage_again(&o, code == IDEM_UNAVAILABLE)); */
#define IDEM_OUTAGE_RETRY_MS 10000u
typedef struct idem_outage {
    uint64_t give_up, backoff;
} idem_outage;
idem_outage idem__outage_start(void);
/* True, after a pause, when a transient failure is worth another attempt. */
bool idem__outage_again(idem_outage *o, bool transient);

/* Big-endian u64: byte order = numeric order, so keys built with it sort by number. */
static inline void idem__put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (56 - 8 * i));
    }
}

static inline uint64_t idem__get_be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

static inline void idem__put_be32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) {
        p[i] = (uint8_t)(v >> (24 - 8 * i));
    }
}

/* a + b, at most UINT64_MAX: a "forever" TTL must not wrap into the past. */
static inline uint64_t idem__add_sat(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}
/* Timed waits run on the monotonic clock, so a wall-clock step (NTP) cannot stretch
 * or cut them: a condition variable made by idem__cond_init, waited on until
 * idem__abs_timespec(wait_ms). */
void idem__cond_init(pthread_cond_t *cv);
void idem__abs_timespec(struct timespec *ts, uint64_t wait_ms); /* MONOTONIC now + wait */

/* Fills buf from getrandom(2) (the kernel CSPRNG). Returns false only if the kernel
 * refuses, which callers treat as IDEM_INTERNAL. */
bool idem__random(void *buf, size_t len);
uint64_t idem__random_u64(void);
double idem__random_unit(void); /* [0,1), for jitter; not for secrets */

/* bytes fresh random bytes as lowercase hex into out (2*bytes+1): request ids and
 * generated keys. false when the kernel refused (out then holds zeros). */
bool idem__random_hex(char *out, size_t bytes);

/* Lowercase hex of len bytes into out (2*len+1). */
void idem__hex(char *out, const void *bytes, size_t len);
/* Unpadded base64url of len bytes into out (4*ceil(len/3)+1). */
void idem__base64url(char *out, const void *bytes, size_t len);

bool idem__utf8_valid(const char *s, size_t len);

/* SHA-256. */
/* false only when out of memory (out is then undefined). */
bool idem__sha256(const void *const *parts, const size_t *lens, size_t n, uint8_t out[32]);

/* ---- signed requests (signature.c, README "Security") ---- */
#define IDEM_META_SIGNATURE "idem-signature" /* hex HMAC-SHA256; HTTP Idem-Signature */
#define IDEM_META_TIMESTAMP "idem-timestamp" /* unix ms, decimal; HTTP Idem-Timestamp */
#define IDEM_META_SIGNER "idem-signer"       /* whose secret signed, when not the caller */
#define IDEM_SIGNATURE_HEX 64

/* What a signature covers. key is the explicit key as sent (idem__signed_key); NULL
 * strings sign as "". */
typedef struct idem_signed_fields {
    /* key_generated: the idem-key-generated metadata as sent ("1" or NULL): it decides
     * whether a business key may replace the key, so it is signed too. */
    const char *signer, *caller, *method, *key, *key_generated, *token;
    const void *payload;
    size_t payload_len;
    uint64_t timestamp_ms;
} idem_signed_fields;

/* Hex HMAC-SHA256 of the canonical string under secret (NUL-terminated). false when a
 * field exceeds the envelope's bounds or libcrypto fails. */
bool idem__signature(const char *secret, const idem_signed_fields *f,
                     char out[IDEM_SIGNATURE_HEX + 1]);
/* Constant-time comparison of two hex signatures (false unless both are 64 chars). */
bool idem__signature_equal(const char *a, const char *b);
/* The explicit key of a request as the server resolves it: the field, else metadata
 * idempotency-key, else "". */
const char *idem__signed_key(const char *field, const char *meta);

/* SHA-256 over each part prefixed with its be32 length (so that no two lists of parts
 * run together), then tail (tail_len bytes, may be NULL). n <= 8. */
bool idem__lp_sha256(const char *const *parts, size_t n, const void *tail, size_t tail_len,
                     uint8_t out[32]);

/* A step name of downstream.h: 1..IDEM_MAX_STEP bytes of [A-Za-z0-9._-]. */
bool idem__step_name_ok(const char *step);

/* The client's whole-call deadline for requests that set none (after defaults). */
struct idem_client;
uint32_t idem__client_deadline_ms(const struct idem_client *c);

/* strdup that returns NULL only on ENOMEM; NULL in → "". */
char *idem__strdup(const char *s);

/* Handler transactions (txn.h), backend-neutral: begin; then either abort, or write the COMPLETED
 * record into the same txn and commit both (the txn is freed either way). */
idem_code idem__store_txn_begin(idem_store *st, idem_txn **out);
/* The same for a handler that holds its claim in the txn: a session left idle in it for
 * idle_ms (its process stopped, or cut off) is ended by the database, so that a stopped
 * instance holds the key for a bounded time (PostgreSQL; 0: the default, 5 min). */
idem_code idem__store_txn_begin_idle(idem_store *st, uint64_t idle_ms, idem_txn **out);
void idem__store_txn_abort(idem_txn *t);
/* True when t's connection to the store broke (PostgreSQL: a restart, a failover, a
 * statement that got no answer): whatever failed in t failed for the store's sake. */
bool idem__store_txn_broken(const idem_txn *t);
/* Commits the business writes alone (no idempotency record); frees t. */
idem_code idem__store_txn_commit(idem_txn *t);
idem_code idem__store_txn_complete_commit(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                          const void *response, size_t len, uint64_t expires_ms,
                                          uint64_t now_ms);
/* Stores with IDEM__STORE_CAP_TXN_CLAIM (store.h): the claim inside t (rec always
 * initialised); then, for a final error, undo the handler's writes but keep the claim. */
idem_code idem__store_txn_claim(idem_txn *t, const idem_claim_req *req, idem_claim_outcome *outcome,
                                idem_record *rec);
idem_code idem__store_txn_undo(idem_txn *t);

#endif

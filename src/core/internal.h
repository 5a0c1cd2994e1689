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
#include "supplemental.h"

#define IDEM_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Request metadata set by idem_client when it generated the key itself: a business key
 * from the method's extractor then takes precedence over that random one. */
#define IDEM_META_KEY_GENERATED "idem-key-generated"

/* Records detail for idem_errmsg() and returns code. An argument may be idem_errmsg()
 * itself: idem__err(code, "context (%s)", idem_errmsg()) wraps the cause in its context. */
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
/* The key a request names, one rule for the server (key_resolution.c), idem_client
 * (which fixes a call's key before its first attempt) and the signature, so that they
 * agree on it:
 *   - the idempotency_key field, when it is not empty and not a key idem_client
 *     generated (field_generated: metadata idem-key-generated is "1");
 *   - else metadata idempotency-key when present ("" too: the server refuses it); it
 *     wins over a generated field (an older idem_client generated one even
 *     when the caller's key was in metadata);
 *   - else the generated field;
 *   - else none: NULL and IDEM_KEY_NONE (the token stands in, or nothing).
 * A field the caller chose and metadata that differ name two keys: *conflict (the
 * field is returned); the server refuses such a request and idem_client never sends it.
 * *source: IDEM_KEY_FIELD, IDEM_KEY_GENERATED, IDEM_KEY_METADATA or IDEM_KEY_NONE. */
const char *idem__request_key(const char *field, const char *meta, bool field_generated,
                              idem_key_source *source, bool *conflict);
/* Why a request whose field and metadata name two different keys is refused. */
#define IDEM__KEY_CONFLICT                                                                         \
    "the idempotency_key field and metadata idempotency-key name two different keys: send "        \
    "one of them"
/* Whether metadata idem-key-generated (its value, or NULL) marks a generated key. */
static inline bool idem__key_generated(const char *value)
{
    return value != NULL && value[0] == '1' && value[1] == '\0';
}
/* The key a signature covers: idem__request_key's, "" for none. generated is metadata
 * idem-key-generated as sent (or NULL). */
const char *idem__signed_key(const char *field, const char *meta, const char *generated);

/* Canonical fingerprints (fingerprint.c): what idem_server_register refuses about a
 * method's fingerprint extractor (a protobuf one without a descriptor, a JSON one in a
 * build without jansson). fingerprint_json.c: whether jansson is built in; a JSON
 * payload's canonical form (malloc'd, *n bytes), NULL when it is not JSON. */
idem_code idem__fingerprint_check(const char *method, idem_fingerprint_fn fn, const void *arg);
bool idem__fingerprint_json_built(void);
char *idem__json_canonical(const void *payload, size_t len, size_t *n);

/* A step name of downstream.h: 1..IDEM_MAX_STEP bytes of [A-Za-z0-9._-]. */
bool idem__step_name_ok(const char *step);

#endif

/* Signed requests: the one canonical string client and server both sign (README
 * "Security").
 *
 *   idem-sig-v2\n  then, for each of signer, caller, method, key, key-generated flag,
 *   token, hex SHA-256 of the payload, timestamp (unix ms, decimal):
 *   <decimal byte length>:<bytes>\n
 *
 * Every field is length-prefixed, so no choice of bytes in one field (a key may hold a
 * newline) can shift text into the next. The MAC is HMAC-SHA256 from libcrypto; the
 * server compares with CRYPTO_memcmp. */
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define SIG_VERSION "idem-sig-v2\n"

/* Appends "<len>:<s>\n"; false when cap is too small. */
static bool put_field(char *buf, size_t cap, size_t *at, const char *s, size_t len)
{
    int n = snprintf(buf + *at, cap - *at, "%zu:", len);
    if (n < 0 || (size_t)n + len + 1 > cap - *at) {
        return false;
    }
    *at += (size_t)n;
    memcpy(buf + *at, s, len);
    *at += len;
    buf[(*at)++] = '\n';
    return true;
}

bool idem__signature(const char *secret, const idem_signed_fields *f,
                     char out[IDEM_SIGNATURE_HEX + 1])
{
    /* Fields are bounded by the envelope (IDEM_MAX_*); a longer one cannot be served
     * anyway, so refusing to sign it loses nothing. */
    char buf[2048], digest_hex[65], ts[24];
    uint8_t digest[32], mac[EVP_MAX_MD_SIZE];
    unsigned mac_len = 0;
    size_t at = strlen(SIG_VERSION);
    memcpy(buf, SIG_VERSION, at);
    if (!idem__sha256((const void *const[]){f->payload != NULL ? f->payload : ""},
                      (const size_t[]){f->payload_len}, 1, digest)) {
        return false;
    }
    idem__hex(digest_hex, digest, sizeof(digest));
    snprintf(ts, sizeof(ts), "%llu", (unsigned long long)f->timestamp_ms);
    const char *parts[] = {f->signer,        f->caller, f->method,  f->key,
                           f->key_generated, f->token,  digest_hex, ts};
    for (size_t i = 0; i < IDEM_ARRAY_LEN(parts); i++) {
        const char *p = parts[i] != NULL ? parts[i] : "";
        if (!put_field(buf, sizeof(buf), &at, p, strlen(p))) {
            return false;
        }
    }
    if (HMAC(EVP_sha256(), secret, (int)strlen(secret), (const uint8_t *)buf, at, mac, &mac_len) ==
            NULL ||
        mac_len != 32) {
        return false;
    }
    idem__hex(out, mac, mac_len);
    return true;
}

bool idem__signature_equal(const char *a, const char *b)
{
    return strlen(a) == IDEM_SIGNATURE_HEX && strlen(b) == IDEM_SIGNATURE_HEX &&
           CRYPTO_memcmp(a, b, IDEM_SIGNATURE_HEX) == 0;
}

const char *idem__request_key(const char *field, const char *meta, bool field_generated,
                              idem_key_source *source, bool *conflict)
{
    bool has_field = field != NULL && field[0] != '\0';
    *conflict = has_field && !field_generated && meta != NULL && strcmp(field, meta) != 0;
    if (has_field && (!field_generated || meta == NULL)) {
        *source = field_generated ? IDEM_KEY_GENERATED : IDEM_KEY_FIELD;
        return field;
    }
    *source = meta != NULL ? IDEM_KEY_METADATA : IDEM_KEY_NONE;
    return meta;
}

const char *idem__signed_key(const char *field, const char *meta, const char *generated)
{
    idem_key_source source;
    bool conflict;
    const char *key =
        idem__request_key(field, meta, idem__key_generated(generated), &source, &conflict);
    return key != NULL ? key : "";
}

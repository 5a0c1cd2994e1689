/* SHA-256 for request fingerprints and index keys, through OpenSSL's libcrypto: its
 * implementation uses the CPU's SHA extensions where they exist (~15x the portable C
 * this file held before, which made hashing most of a large replay's server time).
 * The inputs are streamed as a list of parts so callers need not concatenate.
 *
 * The state lives on the stack (SHA256_Init/Update/Final): no allocation per hash. The
 * EVP interface costs one (a reused EVP_MD_CTX: OpenSSL 3.0 makes a new provider
 * context at every init) to three (a new context per hash, as this file did: two
 * allocations and an implicit fetch) per hash, for the same code underneath, and this
 * runs up to four times per new key. OpenSSL 3 marks these functions deprecated but
 * ships them; a libcrypto without them gets the EVP path below. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/evp.h>
#include <openssl/opensslv.h>
#include <openssl/sha.h>
#include <string.h>

#include "supplemental.h"

#if OPENSSL_VERSION_MAJOR < 4 && !defined(OPENSSL_NO_DEPRECATED_3_0)

bool idem__sha256(const void *const *parts, const size_t *lens, size_t n, uint8_t out[32])
{
    SHA256_CTX ctx;
    bool ok = SHA256_Init(&ctx) == 1;
    for (size_t i = 0; ok && i < n; i++) {
        ok = lens[i] == 0 || SHA256_Update(&ctx, parts[i], lens[i]) == 1;
    }
    ok = SHA256_Final(out, &ctx) == 1 && ok;
    return ok;
}

#else

bool idem__sha256(const void *const *parts, const size_t *lens, size_t n, uint8_t out[32])
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned int len = 0;
    bool ok = ctx != NULL && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1;
    for (size_t i = 0; ok && i < n; i++) {
        ok = lens[i] == 0 || EVP_DigestUpdate(ctx, parts[i], lens[i]) == 1;
    }
    ok = ok && EVP_DigestFinal_ex(ctx, out, &len) == 1 && len == 32;
    EVP_MD_CTX_free(ctx);
    return ok; /* only allocation fails */
}

#endif

bool idem__lp_sha256(const char *const *parts, size_t n, const void *tail, size_t tail_len,
                     uint8_t out[32])
{
    enum { MAX_PARTS = 8 };
    const void *p[2 * MAX_PARTS + 1];
    size_t lens[2 * MAX_PARTS + 1];
    uint8_t len_be[MAX_PARTS][4];
    if (n > MAX_PARTS) {
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t len = (uint32_t)strlen(parts[i]);
        idem__put_be32(len_be[i], len);
        p[2 * i] = len_be[i];
        lens[2 * i] = 4;
        p[2 * i + 1] = parts[i];
        lens[2 * i + 1] = len;
    }
    p[2 * n] = tail != NULL ? tail : "";
    lens[2 * n] = tail != NULL ? tail_len : 0;
    return idem__sha256(p, lens, 2 * n + 1, out);
}

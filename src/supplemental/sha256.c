/* SHA-256 for request fingerprints and index keys, through OpenSSL's libcrypto: its
 * implementation uses the CPU's SHA extensions where they exist (~15x the portable C
 * this file held before, which made hashing most of a large replay's server time).
 * The inputs are streamed as a list of parts so callers need not concatenate. */
#include <openssl/evp.h>

#include "internal.h"

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

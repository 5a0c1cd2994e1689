/* Versioned records: the optimistic lock.
 *
 * Value layout: be32 magic ‖ be64 version ‖ user bytes. A put states the version it
 * read; if the stored one differs, another writer committed in between and the put is
 * refused (ABORTED) without writing, so a read-modify-write over two txns never loses an
 * update. The version only grows: it cannot come back to a value a stale reader holds. */
#include <stdlib.h>
#include <string.h>

#include "toolkit_internal.h"

#include "idemrpc/toolkit.h"

#define VER_MAGIC 0x69760001u /* "iv" v1 */
#define VER_HDR 12

static idem_code ver_decode(const uint8_t *raw, size_t n, const void **val, size_t *vlen,
                            uint64_t *version)
{
    if (n < VER_HDR || raw[0] != (VER_MAGIC >> 24) || raw[1] != ((VER_MAGIC >> 16) & 0xff) ||
        raw[2] != ((VER_MAGIC >> 8) & 0xff) || raw[3] != (VER_MAGIC & 0xff)) {
        return idem__err(IDEM_DATA_LOSS, "versioned: the stored value is not a versioned record");
    }
    *version = idem__get_be64(raw + 4);
    *val = raw + VER_HDR;
    *vlen = n - VER_HDR;
    return IDEM_OK;
}

static void ver_header(uint8_t *buf, uint64_t version)
{
    for (int i = 0; i < 4; i++) {
        buf[i] = (uint8_t)(VER_MAGIC >> (24 - 8 * i));
    }
    idem__put_be64(buf + 4, version);
}

idem_code idem_versioned_get(idem_txn *t, const char *db, const void *key, size_t klen,
                             const void **val, size_t *vlen, uint64_t *version)
{
    const void *raw;
    size_t n;
    *version = 0;
    *val = NULL;
    *vlen = 0;
    idem_code code = idem_txn_get(t, db, key, klen, &raw, &n);
    return code != IDEM_OK ? code : ver_decode(raw, n, val, vlen, version);
}

idem_code idem_versioned_put(idem_txn *t, const char *db, const void *key, size_t klen,
                             uint64_t expected, const void *val, size_t vlen, uint64_t *new_version)
{
    const void *cur;
    size_t cur_len;
    uint64_t version;
    if (vlen > IDEM_VERSIONED_MAX_VALUE || (vlen > 0 && val == NULL)) {
        return idem__err(IDEM_INVALID_ARGUMENT, "versioned: value must be 0..%d bytes",
                         IDEM_VERSIONED_MAX_VALUE);
    }
    idem_code code = idem_versioned_get(t, db, key, klen, &cur, &cur_len, &version);
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return code;
    }
    if (version != expected) {
        return idem__err(IDEM_ABORTED, "version conflict: expected %llu, found %llu",
                         (unsigned long long)expected, (unsigned long long)version);
    }
    if (version == UINT64_MAX) {
        return idem__err(IDEM_OUT_OF_RANGE, "versioned: version exhausted");
    }
    uint8_t *buf = malloc(VER_HDR + vlen);
    if (buf == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    ver_header(buf, version + 1);
    if (vlen > 0) {
        memcpy(buf + VER_HDR, val, vlen);
    }
    code = idem_txn_put(t, db, key, klen, buf, VER_HDR + vlen);
    free(buf);
    if (code == IDEM_OK && new_version != NULL) {
        *new_version = version + 1;
    }
    return code;
}

idem_code idem_store_versioned_get(idem_store *st, const char *db, const void *key, size_t klen,
                                   void **val, size_t *vlen, uint64_t *version)
{
    void *raw;
    size_t n;
    const void *v;
    *val = NULL;
    *vlen = 0;
    *version = 0;
    idem_code code = idem_store_app_get(st, db, key, klen, &raw, &n);
    if (code != IDEM_OK) {
        return code;
    }
    if ((code = ver_decode(raw, n, &v, vlen, version)) != IDEM_OK) {
        free(raw);
        return code;
    }
    memmove(raw, v, *vlen); /* the value without the header, in the caller's buffer */
    *val = raw;
    return IDEM_OK;
}

/* Tombstones behind the idem_store interface: what a COMPLETED record leaves once its
 * result expired (store.h: idem_tombstone), read and deleted by operator tools, kept by
 * the sweep for the longest horizon of the servers on the store (tomb_keep). A backend
 * without them answers IDEM_UNIMPLEMENTED and keeps none. */
#include <string.h>

#include "store.h"
#include "wire.h"

idem_code idem__store_tomb_keep(idem_store *st, uint64_t keep_ms)
{
    if (st->ops->tomb_keep != NULL) {
        return st->ops->tomb_keep(st, keep_ms);
    }
    if (keep_ms != 0) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "tombstone_ttl_ms: the %s store keeps no tombstones; a late duplicate "
                         "would run again",
                         st->ops->name);
    }
    return IDEM_OK;
}

idem_code idem_store_tombstone_get(idem_store *st, const idem_key_ref *key, idem_tombstone *out)
{
    idem_code code = idem__key_check(key);
    if (code != IDEM_OK) {
        return code;
    }
    if (st->ops->tomb_get == NULL) {
        return idem__err(IDEM_UNIMPLEMENTED, "%s store keeps no tombstones", st->ops->name);
    }
    return st->ops->tomb_get(st, key, out);
}

idem_code idem_store_tombstone_delete(idem_store *st, const idem_key_ref *key)
{
    idem_code code = idem__key_check(key);
    if (code != IDEM_OK) {
        return code;
    }
    if (st->ops->tomb_del == NULL) {
        return idem__err(IDEM_UNIMPLEMENTED, "%s store keeps no tombstones", st->ops->name);
    }
    return st->ops->tomb_del(st, key);
}

idem_code idem_store_tombstone_foreach(idem_store *st, idem_tombstone_visit_fn fn, void *arg)
{
    if (fn == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "no visit function");
    }
    if (st->ops->tomb_foreach == NULL) {
        return idem__err(IDEM_UNIMPLEMENTED, "%s store keeps no tombstones", st->ops->name);
    }
    return st->ops->tomb_foreach(st, fn, arg);
}

bool idem__tomb_decides(const idem_tombstone *t, const idem_claim_req *req, uint64_t now_ms)
{
    return req->tombstone_ttl_ms != 0 &&
           now_ms < idem__add_sat(t->expired_at_ms, req->tombstone_ttl_ms) && now_ms < t->until_ms;
}

bool idem__tomb_same(const idem_tombstone *t, const uint8_t fp[IDEM_FINGERPRINT_LEN])
{
    size_t n = t->fingerprint_len;
    return memcmp(t->fingerprint, fp,
                  n > 0 && n < IDEM_TOMBSTONE_FP_LEN ? n : IDEM_TOMBSTONE_FP_LEN) == 0;
}

void idem__tomb_answer(const idem_tombstone *t, const idem_claim_req *req,
                       idem_claim_outcome *outcome, idem_record *rec)
{
    *outcome = idem__tomb_same(t, req->fingerprint) ? IDEM_CLAIM_TOMBSTONE : IDEM_CLAIM_MISMATCH;
    if (rec != NULL) {
        memset(rec, 0, sizeof(*rec));
        rec->state = IDEM_REC_TOMBSTONE;
        memcpy(rec->fingerprint, t->fingerprint, IDEM_TOMBSTONE_FP_LEN);
        rec->first_at_ms = t->first_at_ms;
        rec->expires_ms = t->expired_at_ms;
        rec->result_code = t->code;
    }
}

/* Walks the top-level fields of the stored Response for field 1 (code, a varint);
 * proto3 leaves it out when it is IDEM_OK. */
idem_code idem__response_code(const void *buf, size_t len)
{
    const uint8_t *p = buf, *end = p + len;
    uint64_t tag, v;
    while (p < end) {
        if (!read_varint(&p, end, &tag)) {
            return IDEM_UNKNOWN;
        }
        switch (tag & 7) {
        case 0:
            if (!read_varint(&p, end, &v)) {
                return IDEM_UNKNOWN;
            }
            if (tag >> 3 == 1) {
                return v <= IDEM_UNAUTHENTICATED ? (idem_code)v : IDEM_UNKNOWN;
            }
            break;
        case 2:
            if (!read_varint(&p, end, &v) || v > (uint64_t)(end - p)) {
                return IDEM_UNKNOWN;
            }
            p += v;
            break;
        default:
            return IDEM_UNKNOWN; /* the Response has no other wire types */
        }
    }
    return IDEM_OK;
}

/* Replays as stored bytes: a completed call's reply is stored as the wire Response the
 * first call sent, checked once it is read back (idem__replay_wire_ok: canonical
 * lengths, bounded metadata entries, none of the names the library sets), and
 * completed for the retry by appending the library's own entries (request id, key,
 * first-at) as a suffix, so a replay is answered without a decode and re-encode. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "wire.h"

/* A length-delimited field's length, canonical (minimal varint) and within the buffer;
 * *p then points at its bytes. */
static bool read_len(const uint8_t **p, const uint8_t *end, uint64_t *n)
{
    const uint8_t *start = *p;
    return read_varint(p, end, n) && (size_t)(*p - start) == varint_size(*n) &&
           *n <= (uint64_t)(end - *p);
}

/* The names the library itself sets on a response (call.h IDEM_RESERVED_METADATA). */
static bool library_name(const uint8_t *name, size_t n)
{
    static const char *const names[] = {"request-id", "idem-key", "idem-first-at",
                                        "retry-after-ms"};
    for (size_t i = 0; i < IDEM_ARRAY_LEN(names); i++) {
        if (strlen(names[i]) == n && memcmp(names[i], name, n) == 0) {
            return true;
        }
    }
    return false;
}

/* One metadata entry in canonical form: key (field 1) 1..IDEM_MAX_METADATA_NAME bytes,
 * then optionally value (field 2) 1..IDEM_MAX_METADATA_VALUE bytes, neither with NUL. */
static bool entry_ok(const uint8_t *p, const uint8_t *end, const uint8_t **name, size_t *name_len)
{
    uint64_t n;
    if (p == end || *p++ != 0x0a || !read_len(&p, end, &n) || n == 0 ||
        n > IDEM_MAX_METADATA_NAME || memchr(p, 0, n) != NULL) {
        return false;
    }
    *name = p;
    *name_len = n;
    p += n;
    if (p == end) {
        return true;
    }
    if (*p++ != 0x12 || !read_len(&p, end, &n) || n == 0 || n > IDEM_MAX_METADATA_VALUE ||
        memchr(p, 0, n) != NULL) {
        return false;
    }
    return p + n == end;
}

bool idem__replay_wire_ok(const void *buf, size_t len)
{
    const uint8_t *p = buf, *end = p + len;
    const uint8_t *names[IDEM_MAX_METADATA - IDEM_RESERVED_METADATA];
    size_t name_lens[IDEM_MAX_METADATA - IDEM_RESERVED_METADATA], n_meta = 0;
    unsigned last = 0;
    while (p < end) {
        uint8_t tag = *p++;
        uint64_t n;
        unsigned field = tag >> 3;
        if (field < last || (field == last && field != 4)) {
            return false; /* out of order, or a field repeated */
        }
        last = field;
        switch (tag) {
        case 0x08: /* code: a known nonzero code is one byte */
            if (p == end || *p == 0 || *p >= IDEM_CODE_COUNT) {
                return false;
            }
            p++;
            break;
        case 0x12: /* message */
        case 0x1a: /* payload */
            if (!read_len(&p, end, &n) || n == 0 || (tag == 0x12 && memchr(p, 0, n) != NULL)) {
                return false;
            }
            p += n;
            break;
        case 0x22: /* a metadata entry */
            if (n_meta == IDEM_ARRAY_LEN(names) || !read_len(&p, end, &n) ||
                !entry_ok(p, p + n, &names[n_meta], &name_lens[n_meta]) ||
                library_name(names[n_meta], name_lens[n_meta])) {
                return false;
            }
            for (size_t i = 0; i < n_meta; i++) {
                if (name_lens[i] == name_lens[n_meta] &&
                    memcmp(names[i], names[n_meta], name_lens[i]) == 0) {
                    return false;
                }
            }
            n_meta++;
            p += n;
            break;
        default: /* replayed, request_id (never stored) or a field unknown here */
            return false;
        }
    }
    return true;
}

const char *idem__call_answer_key(const idem_call *call)
{
    return call->key_source != IDEM_KEY_NONE && call->key_source != IDEM_KEY_TOKEN ? call->key
                                                                                   : NULL;
}

static size_t entry_body_size(size_t name_len, size_t value_len)
{
    return 1 + varint_size(name_len) + name_len +
           (value_len > 0 ? 1 + varint_size(value_len) + value_len : 0);
}

static uint8_t *put_entry(uint8_t *p, const char *name, const char *value)
{
    size_t nl = strlen(name), vl = strlen(value);
    *p++ = 0x22;
    p = put_varint(p, entry_body_size(nl, vl));
    *p++ = 0x0a;
    p = put_varint(p, nl);
    memcpy(p, name, nl);
    p += nl;
    if (vl > 0) {
        *p++ = 0x12;
        p = put_varint(p, vl);
        memcpy(p, value, vl);
        p += vl;
    }
    return p;
}

/* The per-call fields, in the order the decode + re-encode path has them: metadata
 * idem-first-at (result_cache), idem-key (dispatch), request-id (the nng front), then
 * replayed = true and request_id. Each value is bounded (24, IDEM_MAX_KEY,
 * IDEM_MAX_REQUEST_ID bytes), so they fit in IDEM_REPLAY_SUFFIX_MAX. */
size_t idem__replay_suffix(const idem_call *call, uint8_t out[IDEM_REPLAY_SUFFIX_MAX])
{
    const char *key = idem__call_answer_key(call);
    size_t rid = strnlen(call->request_id, IDEM_MAX_REQUEST_ID);
    uint8_t *p = put_entry(out, "idem-first-at", call->replay_first_at);
    if (key != NULL) {
        p = put_entry(p, "idem-key", key);
    }
    p = put_entry(p, "request-id", call->request_id);
    *p++ = 0x28; /* replayed */
    *p++ = 1;
    if (rid > 0) {
        *p++ = 0x32;
        p = put_varint(p, rid);
        memcpy(p, call->request_id, rid);
        p += rid;
    }
    return (size_t)(p - out);
}

idem_code idem__call_materialize_replay(idem_call *call)
{
    uint8_t *wire = call->replay_wire;
    if (wire == NULL) {
        return IDEM_OK;
    }
    idem_kv *since = call->meta; /* set after the replay: they follow idem-first-at */
    size_t n_since = call->meta_count;
    const char *key = idem__call_answer_key(call);
    call->meta = NULL;
    call->meta_count = 0;
    call->meta_cap = 0;
    idem_code code = idem__load_call_response(call, wire, call->replay_wire_len);
    idem__call_drop_replay_wire(call); /* the load copied what it keeps */
    if (code == IDEM_OK) {
        code = idem__call_set_meta(call, "idem-first-at", call->replay_first_at);
    }
    for (size_t i = 0; i < n_since; i++) {
        if (code == IDEM_OK) {
            code = idem__call_set_meta(call, since[i].name, since[i].value);
        }
    }
    idem__kv_free(since, n_since);
    if (code == IDEM_OK && key != NULL) {
        code = idem__call_set_meta(call, "idem-key", key);
    }
    call->replayed = true;
    return code;
}

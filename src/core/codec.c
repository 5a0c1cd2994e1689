/* protobuf-c glue: decode and validate Requests, encode Responses. protobuf-c checks
 * the wire format; the bounds and UTF-8 rules of the envelope are checked here, so
 * every later layer may treat the strings as bounded, NUL-free C strings. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "wire.h"

/* No C0 control characters or DEL: the field is echoed in logs and headers. */
static idem_code check_printable(const char *field, const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p < 0x20 || *p == 0x7f) {
            return idem__err(IDEM_INVALID_ARGUMENT, "%s contains a control character", field);
        }
    }
    return IDEM_OK;
}

static idem_code check_string(const char *field, const char *s, size_t max, bool required)
{
    size_t len = strlen(s);
    if (required && len == 0) {
        return idem__err(IDEM_INVALID_ARGUMENT, "%s is required", field);
    }
    if (len > max) {
        return idem__err(IDEM_INVALID_ARGUMENT, "%s too long (%zu bytes, max %zu)", field, len,
                         max);
    }
    if (!idem__utf8_valid(s, len)) {
        return idem__err(IDEM_INVALID_ARGUMENT, "%s is not valid UTF-8", field);
    }
    return IDEM_OK;
}

/* "package.Service/Method": printable ASCII, one '/', neither side empty. The one rule
 * for the wire and for idem_server_register. */
idem_code idem__method_name_check(const char *m)
{
    if (m == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "method name is NULL");
    }
    idem_code code = check_string("method", m, IDEM_MAX_METHOD, true);
    if (code != IDEM_OK) {
        return code;
    }
    const char *slash = strchr(m, '/');
    bool ok = slash != NULL && slash != m && slash[1] != '\0' && strchr(slash + 1, '/') == NULL;
    for (const char *p = m; ok && *p; p++) {
        ok = *p > ' ' && *p < 0x7f;
    }
    return ok ? IDEM_OK
              : idem__err(IDEM_INVALID_ARGUMENT,
                          "method must look like \"package.Service/Method\"");
}

bool idem__step_name_ok(const char *step)
{
    size_t n = step != NULL ? strlen(step) : 0;
    if (n == 0 || n > IDEM_MAX_STEP) {
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        char ch = step[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == '-')) {
            return false;
        }
    }
    return true;
}

bool idem__caller_name_ok(const char *caller)
{
    return caller != NULL && caller[0] != '\0' &&
           check_string("caller", caller, IDEM_MAX_CALLER, true) == IDEM_OK &&
           check_printable("caller", caller) == IDEM_OK;
}

idem_code idem__request_check(const Idem__V1__Request *r)
{
    idem_code code;
    if ((code = idem__method_name_check(r->method)) != IDEM_OK ||
        (code = check_string("idempotency_key (Idempotency-Key)", r->idempotency_key, IDEM_MAX_KEY,
                             false)) != IDEM_OK ||
        (code = check_string("request_id (X-Request-Id)", r->request_id, IDEM_MAX_REQUEST_ID,
                             false)) != IDEM_OK ||
        (code = check_string("token (Idem-Token)", r->token, IDEM_MAX_TOKEN, false)) != IDEM_OK ||
        (code = check_string("caller (X-Caller)", r->caller, IDEM_MAX_CALLER, false)) != IDEM_OK ||
        (code = check_printable("request_id (X-Request-Id)", r->request_id)) != IDEM_OK ||
        (code = check_printable("token (Idem-Token)", r->token)) != IDEM_OK ||
        (code = check_printable("caller (X-Caller)", r->caller)) != IDEM_OK) {
        return code;
    }
    if (r->n_metadata > IDEM_MAX_METADATA) {
        return idem__err(IDEM_INVALID_ARGUMENT, "too many metadata entries (%zu, max %d)",
                         r->n_metadata, IDEM_MAX_METADATA);
    }
    for (size_t i = 0; i < r->n_metadata; i++) {
        for (size_t j = 0; j < i; j++) { /* one meaning per name: the first and the last agree */
            if (strcmp(r->metadata[j]->key, r->metadata[i]->key) == 0) {
                return idem__err(IDEM_INVALID_ARGUMENT, "metadata name repeated");
            }
        }
        if ((code = check_string("metadata name", r->metadata[i]->key, IDEM_MAX_METADATA_NAME,
                                 true)) != IDEM_OK ||
            (code = check_string("metadata value", r->metadata[i]->value, IDEM_MAX_METADATA_VALUE,
                                 false)) != IDEM_OK) {
            return code;
        }
    }
    return IDEM_OK;
}

/* protobuf-c hands strings over as C strings, so a string with an embedded NUL would be
 * cut short silently (and "a\0b" would collide with "a"). This walks the wire form and
 * reports a NUL in any field whose number is in string_fields; map_field's entries are
 * nested messages whose fields 1 and 2 (key, value) are strings. */
static bool wire_strings_have_nul(const uint8_t *p, const uint8_t *end, uint32_t string_fields,
                                  uint32_t map_field)
{
    while (p < end) {
        uint64_t tag, n;
        if (!read_varint(&p, end, &tag)) {
            return true;
        }
        uint64_t field = tag >> 3;
        switch (tag & 7) {
        case 0:
            if (!read_varint(&p, end, &n)) {
                return true;
            }
            break;
        case 1:
        case 5:
            n = (tag & 7) == 1 ? 8 : 4;
            if ((uint64_t)(end - p) < n) {
                return true;
            }
            p += n;
            break;
        case 2:
            if (!read_varint(&p, end, &n) || n > (uint64_t)(end - p)) {
                return true;
            }
            if (field < 32 && (string_fields & (1u << field)) && memchr(p, 0, n) != NULL) {
                return true;
            }
            if (field == map_field && wire_strings_have_nul(p, p + n, (1u << 1) | (1u << 2), 0)) {
                return true;
            }
            p += n;
            break;
        default:
            return true; /* groups are not part of proto3 */
        }
    }
    return false;
}

static idem_code decode_request(const void *buf, size_t len, bool writable, idem_arena *a,
                                Idem__V1__Request **out);

idem_code idem__decode_request(const void *buf, size_t len, Idem__V1__Request **out)
{
    return decode_request(buf, len, false, NULL, out);
}

void idem__free_request(Idem__V1__Request *req)
{
    if (req != NULL) {
        idem__v1__request__free_unpacked(req, NULL);
    }
}

idem_code idem__encode_call_response_to(const idem_call *call, bool for_wire,
                                        void *(*buf_for)(void *arg, size_t len), void *arg)
{
    Idem__V1__Response r = IDEM__V1__RESPONSE__INIT;
    Idem__V1__Response__MetadataEntry entries[IDEM_MAX_METADATA];
    Idem__V1__Response__MetadataEntry *ptrs[IDEM_MAX_METADATA];

    r.code = (Idem__V1__Code)call->code;
    r.message = call->message != NULL ? call->message : "";
    r.payload.data = call->payload;
    r.payload.len = call->payload_len;
    for (size_t i = 0; i < call->meta_count && i < IDEM_MAX_METADATA; i++) {
        idem__v1__response__metadata_entry__init(&entries[i]);
        entries[i].key = call->meta[i].name;
        entries[i].value = call->meta[i].value;
        ptrs[i] = &entries[i];
    }
    r.n_metadata = call->meta_count;
    r.metadata = ptrs;
    if (for_wire) {
        r.replayed = call->replayed;
        r.request_id = (char *)call->request_id;
    }
    size_t len = idem__v1__response__get_packed_size(&r);
    uint8_t *out = buf_for(arg, len);
    if (out == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory encoding response");
    }
    idem__v1__response__pack(&r, out);
    return IDEM_OK;
}

typedef struct malloc_out {
    uint8_t *buf;
    size_t len;
} malloc_out;

static void *malloc_for(void *arg, size_t len)
{
    malloc_out *o = arg;
    o->len = len;
    return o->buf = malloc(len ? len : 1);
}

idem_code idem__encode_call_response(const idem_call *call, bool for_wire, uint8_t **out,
                                     size_t *len)
{
    malloc_out o = {NULL, 0};
    idem_code code = idem__encode_call_response_to(call, for_wire, malloc_for, &o);
    *out = o.buf;
    *len = o.len;
    return code;
}

idem_code idem__load_call_response(idem_call *call, const void *buf, size_t len)
{
    Idem__V1__Response *r = idem__v1__response__unpack(NULL, len, buf);
    if (r == NULL) {
        return idem__err(IDEM_DATA_LOSS, "stored response does not decode");
    }
    idem__call_reset_response(call);
    idem_code code = idem_call_reply(call, (idem_code)r->code, r->payload.data, r->payload.len);
    if (code == (idem_code)r->code && r->message[0] != '\0') {
        code = idem__call_set_message(call, r->message) == IDEM_OK ? code : IDEM_RESOURCE_EXHAUSTED;
    }
    for (size_t i = 0; i < r->n_metadata && code == (idem_code)r->code; i++) {
        if (idem__call_set_meta(call, r->metadata[i]->key, r->metadata[i]->value) != IDEM_OK) {
            code = IDEM_RESOURCE_EXHAUSTED;
        }
    }
    bool ok = code == (idem_code)r->code;
    idem__v1__response__free_unpacked(r, NULL);
    return ok ? IDEM_OK : idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory loading response");
}

bool idem__fingerprint(const char *method, const void *payload, size_t len, uint8_t out[32])
{
    const void *parts[] = {method, "", payload != NULL ? payload : ""};
    const size_t lens[] = {strlen(method), 1, len};
    return idem__sha256(parts, lens, 3, out);
}

static idem_code fingerprint_of(const idem_call *call, uint8_t out[32])
{
    const idem_method *m = call->method;
    size_t plen;
    const void *payload = idem_call_payload(call, &plen);
    if (m->opts.fingerprint == NULL) {
        return idem__fingerprint(m->name, payload, plen, out)
                   ? IDEM_OK
                   : idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory hashing the request");
    }
    uint8_t *buf = malloc(IDEM_MAX_FINGERPRINT_INPUT);
    size_t n = 0;
    if (buf == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    idem_code code = IDEM_OK;
    if (!m->opts.fingerprint(call, buf, IDEM_MAX_FINGERPRINT_INPUT, &n, m->opts.fingerprint_arg) ||
        n > IDEM_MAX_FINGERPRINT_INPUT) {
        code = idem__err(IDEM_INVALID_ARGUMENT,
                         "the request has no fingerprint: %s's fingerprint extractor refused it",
                         m->name);
    } else {
        /* 'F' keeps an extracted fingerprint apart from a whole-payload one. */
        const void *parts[] = {m->name, "", "F", buf};
        const size_t lens[] = {strlen(m->name), 1, 1, n};
        code = idem__sha256(parts, lens, 4, out)
                   ? IDEM_OK
                   : idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory hashing the request");
    }
    free(buf);
    return code;
}

/* Once per call: result_cache on the fast path and again on the worker, steps.c. */
idem_code idem__call_fingerprint(idem_call *call, uint8_t out[32])
{
    if (!call->has_fingerprint) {
        idem_code code = fingerprint_of(call, call->fingerprint);
        if (code != IDEM_OK) {
            return code;
        }
        call->has_fingerprint = true;
    }
    memcpy(out, call->fingerprint, sizeof(call->fingerprint));
    return IDEM_OK;
}

/* ---- the request decode into an arena (arena.c) ---- */

/* A tag or a length: protobuf-c takes at most 5 bytes and 32 bits for either, so this
 * walk may not accept more (it would take a frame the plain decode refuses). */
static bool read_varint32(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    const uint8_t *start = *p;
    return read_varint(p, end, v) && *p - start <= 5 && *v <= UINT32_MAX;
}

/* Where the frame's one bytes field number `number` (length-delimited) is: its whole
 * field [*field, *field_end) and its bytes [*data, *field_end). false when the frame is
 * not well formed as far as this walk sees, or has no such field, or more than one (the
 * plain decode then decides, as before). */
static bool find_bytes_field(const uint8_t *p, const uint8_t *end, uint64_t number,
                             const uint8_t **field, const uint8_t **data, const uint8_t **field_end)
{
    size_t found = 0;
    while (p < end) {
        const uint8_t *start = p;
        uint64_t tag, n;
        if (!read_varint32(&p, end, &tag)) {
            return false;
        }
        switch (tag & 7) {
        case 0:
            if (!read_varint(&p, end, &n)) {
                return false;
            }
            break;
        case 1:
        case 5:
            n = (tag & 7) == 1 ? 8 : 4;
            if ((uint64_t)(end - p) < n) {
                return false;
            }
            p += n;
            break;
        case 2:
            if (!read_varint32(&p, end, &n) || n > (uint64_t)(end - p)) {
                return false;
            }
            if (tag >> 3 == number) {
                *field = start;
                *data = p;
                *field_end = p + n;
                found++;
            }
            p += n;
            break;
        default:
            return false;
        }
        if (tag >> 3 == number && (tag & 7) != 2) {
            return false; /* the field in the wrong wire type: protobuf-c refuses it */
        }
    }
    return found == 1;
}

/* protobuf-c copies every bytes field. The frame without its payload field (small:
 * the envelope) is decoded from a copy in the arena instead, and the payload is set
 * afterwards: the same Request, since fields are independent and the payload occurs
 * once. Handlers have long read the payload as a C string (sscanf), so it is followed
 * by a NUL: in a writable frame whose payload is not the last field, the payload stays
 * where it is and the byte after it (the next field's first byte, decoded already from
 * the copy) becomes that NUL; else the payload is copied into the arena with one. */
static Idem__V1__Request *unpack_borrowing_payload(const uint8_t *buf, size_t len, bool writable,
                                                   idem_arena *a)
{
    const uint8_t *field, *data, *field_end, *end = buf + len;
    if (!find_bytes_field(buf, end, 6, &field, &data, &field_end)) {
        /* The plain decode decides (a payload field twice: the last wins); its payload
         * copy gets the NUL too. */
        Idem__V1__Request *r = idem__v1__request__unpack(&a->pa, len, buf);
        uint8_t *payload;
        if (r != NULL && r->payload.len > 0) {
            if ((payload = idem__arena_alloc(a, r->payload.len + 1)) == NULL) {
                return NULL;
            }
            memcpy(payload, r->payload.data, r->payload.len);
            payload[r->payload.len] = '\0';
            r->payload.data = payload;
        }
        return r;
    }
    size_t before = (size_t)(field - buf), after = (size_t)(end - field_end);
    size_t n = (size_t)(field_end - data);
    uint8_t *rest = idem__arena_alloc(a, before + after + 1);
    if (rest == NULL) {
        return NULL;
    }
    memcpy(rest, buf, before);
    memcpy(rest + before, field_end, after);
    Idem__V1__Request *r = idem__v1__request__unpack(&a->pa, before + after, rest);
    if (r == NULL || n == 0) {
        return r; /* no payload: data NULL, as protobuf-c leaves it */
    }
    uint8_t *payload = (uint8_t *)data;
    if (!writable || after == 0) {
        if ((payload = idem__arena_alloc(a, n + 1)) == NULL) {
            return NULL;
        }
        memcpy(payload, data, n);
    }
    payload[n] = '\0';
    r->payload.data = payload;
    r->payload.len = n;
    return r;
}

/* Decodes with protobuf-c's allocator (a == NULL: free with idem__free_request) or into
 * the arena a (writable: see unpack_borrowing_payload); then the envelope checks, the
 * same for both. */
static idem_code decode_request(const void *buf, size_t len, bool writable, idem_arena *a,
                                Idem__V1__Request **out)
{
    *out = NULL;
    if (len == 0) {
        return idem__err(IDEM_INVALID_ARGUMENT, "empty frame: expected an idem.v1.Request");
    }
    /* Request string fields: method 1, idempotency_key 2, request_id 3, token 4, caller 9;
     * metadata (5) is a map<string,string>. Walked before the decode may write. */
    const uint32_t strings = (1u << 1) | (1u << 2) | (1u << 3) | (1u << 4) | (1u << 9);
    bool nul = wire_strings_have_nul(buf, (const uint8_t *)buf + len, strings, 5);
    Idem__V1__Request *r = a != NULL ? unpack_borrowing_payload(buf, len, writable, a)
                                     : idem__v1__request__unpack(NULL, len, buf);
    if (r == NULL) {
        if (a != NULL) {
            idem__arena_reset(a);
        }
        return idem__err(IDEM_INVALID_ARGUMENT, "frame is not a valid idem.v1.Request");
    }
    idem_code code = idem__request_check(r);
    if (code == IDEM_OK && nul) {
        code = idem__err(IDEM_INVALID_ARGUMENT, "string field contains a NUL byte");
    }
    if (code != IDEM_OK) {
        if (a != NULL) {
            idem__arena_reset(a);
        } else {
            idem__v1__request__free_unpacked(r, NULL);
        }
        return code;
    }
    *out = r;
    return IDEM_OK;
}

idem_code idem__decode_request_arena(const void *buf, size_t len, bool writable, idem_arena *a,
                                     Idem__V1__Request **out)
{
    return decode_request(buf, len, writable, a, out);
}

Idem__V1__Response *idem__decode_response_arena(const void *buf, size_t len, idem_arena *a)
{
    const uint8_t *field, *data, *field_end, *end = (const uint8_t *)buf + len;
    Idem__V1__Response *r;
    if (!find_bytes_field(buf, end, 3, &field, &data, &field_end)) {
        r = idem__v1__response__unpack(&a->pa, len, buf);
    } else { /* as unpack_borrowing_payload; the reader copies the payload itself */
        size_t before = (size_t)(field - (const uint8_t *)buf), after = (size_t)(end - field_end);
        uint8_t *rest = idem__arena_alloc(a, before + after + 1);
        r = NULL;
        if (rest != NULL) {
            memcpy(rest, buf, before);
            memcpy(rest + before, field_end, after);
            r = idem__v1__response__unpack(&a->pa, before + after, rest);
        }
        if (r != NULL) {
            r->payload.len = (size_t)(field_end - data);
            r->payload.data = r->payload.len > 0 ? (uint8_t *)data : NULL;
        }
    }
    if (r == NULL) {
        idem__arena_reset(a);
    }
    return r;
}

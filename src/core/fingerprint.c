/* Canonical fingerprints (server.h: idem_fingerprint_protobuf, idem_fingerprint_json):
 * fingerprint extractors that reduce a request to a canonical encoding of its meaning
 * and hand over the SHA-256 of that (the encoding may pass IDEM_MAX_FINGERPRINT_INPUT;
 * its hash never does). A one-letter tag ahead of the encoding keeps the two kinds
 * apart. JSON's canonical form comes from fingerprint_json.c (jansson), or its stub. */
#include <protobuf-c/protobuf-c.h>
#include <stdlib.h>

#include "internal.h"
#include "wire.h"

/* protobuf-c's unpack recurses once per nested message, without a bound: a request
 * nested deeper than this (protobuf's own default recursion limit) is refused first. */
#define MAX_NESTING 100

static bool hash_into(char tag, const void *canon, size_t n, void *buf, size_t cap, size_t *len)
{
    if (cap < 32 ||
        !idem__sha256((const void *const[]){&tag, canon}, (const size_t[]){1, n}, 2, buf)) {
        return false;
    }
    *len = 32;
    return true;
}

static const ProtobufCMessageDescriptor *descriptor_of(const void *arg)
{
    const ProtobufCMessageDescriptor *d = arg;
    return d != NULL && d->magic == PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC ? d : NULL;
}

/* Whether the message d in [p, end) nests no deeper than depth more levels: a walk of
 * its fields that enters the length-delimited ones d says are messages. A malformed
 * message passes (the unpack refuses it). */
static bool nesting_ok(const ProtobufCMessageDescriptor *d, const uint8_t *p, const uint8_t *end,
                       int depth)
{
    while (p < end) {
        uint64_t tag, n;
        if (!read_varint(&p, end, &tag)) {
            return true;
        }
        switch (tag & 7) {
        case 0:
            n = 0;
            if (!read_varint(&p, end, &n)) {
                return true;
            }
            continue;
        case 1:
        case 5:
            n = (tag & 7) == 1 ? 8 : 4;
            break;
        case 2: {
            if (!read_varint(&p, end, &n) || n > (uint64_t)(end - p)) {
                return true;
            }
            const ProtobufCFieldDescriptor *f =
                tag >> 3 <= UINT32_MAX
                    ? protobuf_c_message_descriptor_get_field(d, (unsigned)(tag >> 3))
                    : NULL;
            if (f != NULL && f->type == PROTOBUF_C_TYPE_MESSAGE &&
                (depth == 0 || !nesting_ok(f->descriptor, p, p + n, depth - 1))) {
                return false;
            }
            break;
        }
        default:
            return true; /* groups: protobuf-c refuses them */
        }
        if (n > (uint64_t)(end - p)) {
            return true;
        }
        p += n;
    }
    return true;
}

bool idem_fingerprint_protobuf(const idem_call *call, void *buf, size_t cap, size_t *len, void *arg)
{
    const ProtobufCMessageDescriptor *d = descriptor_of(arg);
    size_t plen;
    const uint8_t *payload = idem_call_payload(call, &plen);
    payload = payload != NULL ? payload : (const uint8_t *)"";
    if (d == NULL || !nesting_ok(d, payload, payload + plen, MAX_NESTING)) {
        return false;
    }
    ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, plen, payload);
    if (m == NULL) {
        return false;
    }
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *canon = malloc(n + 1);
    bool ok = canon != NULL && protobuf_c_message_pack(m, canon) == n &&
              hash_into('P', canon, n, buf, cap, len);
    free(canon);
    protobuf_c_message_free_unpacked(m, NULL);
    return ok;
}

bool idem_fingerprint_json(const idem_call *call, void *buf, size_t cap, size_t *len, void *arg)
{
    (void)arg;
    size_t plen, n = 0;
    const void *payload = idem_call_payload(call, &plen);
    char *canon = idem__json_canonical(payload, plen, &n);
    bool ok = canon != NULL && hash_into('J', canon, n, buf, cap, len);
    free(canon);
    return ok;
}

idem_code idem__fingerprint_check(const char *method, idem_fingerprint_fn fn, const void *arg)
{
    if (fn == idem_fingerprint_protobuf && descriptor_of(arg) == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "cannot register method %s: idem_fingerprint_protobuf needs the "
                         "request message's ProtobufCMessageDescriptor as fingerprint_arg",
                         method);
    }
    if (fn == idem_fingerprint_json && !idem__fingerprint_json_built()) {
        return idem__err(IDEM_UNIMPLEMENTED,
                         "cannot register method %s: idem_fingerprint_json needs a build with "
                         "jansson (meson -Djson=enabled)",
                         method);
    }
    return IDEM_OK;
}

/* An HTTP request as the idem.v1.Request frame the chain reads (for http_front.c).
 *
 * Header values are taken whole: their bounds are checked once, for both fronts, by the
 * request decoder. A header that names a field of the frame (Idempotency-Key, the caller
 * header, X-Request-Id, Idem-Token, Grpc-Timeout, Idem-Signature, Idem-Timestamp,
 * Idem-Signer) may
 * appear once: a repeat is a 400 (a gateway and this server must not pick different
 * copies). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "http_deadline.h"
#include "http_front.h"

static const char many[] = "more than one Idempotency-Key value (a list or a repeated "
                           "header is refused; quote a key that contains a comma)";

/* The value of a header that may appear once, NUL-terminated: *out NULL when absent.
 * False when it is repeated (*err says which) or out of memory (*err NULL). */
static bool single(const idem_hreq *r, const char *name, char **out, const char **err)
{
    static _Thread_local char msg[96];
    const char *v;
    size_t vl;
    size_t n = idem__http_field(r, name, &v, &vl);
    *out = NULL;
    if (n > 1) {
        snprintf(msg, sizeof(msg), "the header %s may appear once", name);
        *err = strcmp(name, "Idempotency-Key") == 0 ? many : msg;
        return false;
    }
    return n == 0 || (*out = strndup(v, vl)) != NULL;
}

/* Idempotency-Key as the draft sends it, a structured-field string ("..." with \" and \\
 * escapes), or a bare token. A list ("a", "b") or a repeated header is refused: one
 * request, one key. Returns a malloc'd key ("" when absent), or NULL with *err set (or
 * with *err NULL when out of memory). */
static char *idempotency_key(const idem_hreq *r, const char **err)
{
    char *hv;
    *err = NULL;
    if (!single(r, "Idempotency-Key", &hv, err)) {
        return NULL;
    }
    const char *v = hv != NULL ? hv : "";
    char *out = malloc(strlen(v) + 1), *o = out;
    if (out == NULL) {
        free(hv);
        return NULL;
    }
    if (v[0] != '"') {
        *err = strchr(v, ',') != NULL ? many : NULL;
        strcpy(out, v);
    } else {
        const char *p = v + 1;
        for (; *p != '\0' && *p != '"'; p++) {
            if (*p == '\\' && p[1] != '"' && p[1] != '\\') {
                /* only \" and \\ are escapes in a structured-field string (and a
                 * backslash at the end escapes nothing) */
                *err = "Idempotency-Key: invalid escape";
                break;
            }
            if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e) {
                *err = "Idempotency-Key: a quoted key is printable ASCII only";
                break;
            }
            p += *p == '\\';
            *o++ = *p;
        }
        *o = '\0';
        const char *after = *p == '"' ? p + 1 + strspn(p + 1, " \t") : p;
        if (*err != NULL) {
            /* already said */
        } else if (*p != '"') {
            *err = "Idempotency-Key: unterminated quoted string";
        } else if (*after == ';') {
            *err = "Idempotency-Key: parameters are not supported";
        } else if (*after == ',') {
            *err = many;
        } else if (*after != '\0') {
            *err = "Idempotency-Key: unexpected text after the quoted key";
        }
    }
    free(hv);
    if (*err != NULL) {
        free(out);
        return NULL;
    }
    return out;
}

/* Headers carried into the request's metadata, for the identity step (identity.c). */
static const struct {
    const char *header, *meta;
} signature_headers[] = {
    {"Idem-Signature", IDEM_META_SIGNATURE},
    {"Idem-Timestamp", IDEM_META_TIMESTAMP},
    {"Idem-Signer", IDEM_META_SIGNER},
};

/* Singletons of the frame, by field: which header, and where its value goes. */
enum { H_REQUEST_ID, H_CALLER, H_TOKEN, H_TIMEOUT, H_SIG0, H_COUNT = H_SIG0 + 3 };

/* method from the target's path (idem__http_target_path): /a/b names a/b. */
static char *target_method(const idem_hreq *r)
{
    size_t n;
    const char *p = idem__http_target_path(r, &n);
    return n > 0 && p[0] == '/' ? strndup(p + 1, n - 1) : strndup(p, n);
}

static uint8_t *pack(Idem__V1__Request *q, char **v, const void *body, size_t blen, size_t *len)
{
    uint8_t *frame;
    q->request_id = v[H_REQUEST_ID] != NULL ? v[H_REQUEST_ID] : "";
    q->caller = v[H_CALLER] != NULL ? v[H_CALLER] : "";
    q->token = v[H_TOKEN] != NULL ? v[H_TOKEN] : "";
    q->payload.data = (uint8_t *)body;
    q->payload.len = blen;
    q->attempt = 1;
    *len = idem__v1__request__get_packed_size(q);
    if ((frame = malloc(*len ? *len : 1)) != NULL) {
        idem__v1__request__pack(q, frame);
    }
    return frame;
}

uint8_t *idem__http_request_frame(const idem_hreq *r, const char *caller_header,
                                  const void *body, size_t blen, size_t *len, const char **err)
{
    Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
    Idem__V1__Request__MetadataEntry meta[IDEM_ARRAY_LEN(signature_headers)];
    Idem__V1__Request__MetadataEntry *meta_ptrs[IDEM_ARRAY_LEN(signature_headers)];
    const char *names[H_COUNT] = {"X-Request-Id", caller_header, "Idem-Token",
                                  IDEM_HTTP_TIMEOUT_HEADER};
    char *v[H_COUNT] = {NULL};
    char *method = target_method(r), *key = idempotency_key(r, err);
    bool ok = method != NULL && key != NULL;
    for (size_t i = 0; i < H_COUNT; i++) {
        names[i] = i >= H_SIG0 ? signature_headers[i - H_SIG0].header : names[i];
        ok = ok && single(r, names[i], &v[i], err);
    }
    for (size_t i = 0; ok && i < IDEM_ARRAY_LEN(signature_headers); i++) {
        if (v[H_SIG0 + i] != NULL) { /* the value whole: the decoder checks its bounds */
            idem__v1__request__metadata_entry__init(&meta[q.n_metadata]);
            meta[q.n_metadata].key = (char *)signature_headers[i].meta;
            meta[q.n_metadata].value = v[H_SIG0 + i];
            meta_ptrs[q.n_metadata] = &meta[q.n_metadata];
            q.n_metadata++;
        }
    }
    q.metadata = meta_ptrs;
    q.method = method;
    q.idempotency_key = key;
    ok = ok && idem__http_deadline(v[H_TIMEOUT], idem__now_ms(), &q.deadline_unix_ms,
                                   &q.call_deadline_unix_ms, err);
    uint8_t *frame = ok ? pack(&q, v, body, blen, len) : NULL;
    for (size_t i = 0; i < H_COUNT; i++) {
        free(v[i]);
    }
    free(method);
    free(key);
    return frame;
}

/* A gRPC request as the idem.v1.Request frame the chain reads (for grpc_front.c).
 *
 * The message is the payload (raw bytes: any protobuf schema). Metadata that names a
 * field of the frame may appear once (a repeat is INVALID_ARGUMENT: a proxy and this
 * server must not pick different copies): idempotency-key, x-request-id, the caller
 * header, idem-token, grpc-timeout (the whole call's deadline, as the HTTP front's
 * Grpc-Timeout, http_deadline.c) and the signature's idem-signature, idem-timestamp,
 * idem-signer (passed on as metadata for the identity step). Values are taken whole:
 * the request decoder checks their bounds, for every front. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_front.h"
#include "http_deadline.h"

enum { M_KEY, M_REQUEST_ID, M_CALLER, M_TOKEN, M_TIMEOUT, M_SIG0, M_COUNT = M_SIG0 + 3 };

static const char *const signature_meta[] = {IDEM_META_SIGNATURE, IDEM_META_TIMESTAMP,
                                             IDEM_META_SIGNER};

/* Each singleton's value (NULL: absent); false with *err on a repeat. */
static bool singletons(const idem_greq *r, const char *const names[M_COUNT], const char *v[M_COUNT],
                       const char **err)
{
    static _Thread_local char msg[160];
    for (size_t i = 0; i < r->n_meta; i++) {
        for (size_t k = 0; k < M_COUNT; k++) {
            if (strcmp(r->meta[i].name, names[k]) != 0) {
                continue;
            }
            if (v[k] != NULL) {
                snprintf(msg, sizeof(msg), "the metadata %s may appear once", names[k]);
                *err = msg;
                return false;
            }
            v[k] = r->meta[i].value;
        }
    }
    return true;
}

static void lowercase(const char *in, char *out, size_t cap)
{
    size_t i = 0;
    for (; in[i] != '\0' && i + 1 < cap; i++) {
        out[i] = (char)(in[i] >= 'A' && in[i] <= 'Z' ? in[i] - 'A' + 'a' : in[i]);
    }
    out[i] = '\0';
}

uint8_t *idem__grpc_request_frame(const idem_greq *r, const char *caller_header, size_t *len,
                                  const char **err)
{
    Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
    Idem__V1__Request__MetadataEntry meta[M_COUNT - M_SIG0], *meta_ptrs[M_COUNT - M_SIG0];
    char caller[64];
    lowercase(caller_header != NULL ? caller_header : "x-caller", caller, sizeof(caller));
    const char *names[M_COUNT] = {"idempotency-key",   "x-request-id",  caller,
                                  "idem-token",        "grpc-timeout",  IDEM_META_SIGNATURE,
                                  IDEM_META_TIMESTAMP, IDEM_META_SIGNER};
    const char *v[M_COUNT] = {NULL};
    *err = NULL;
    if (!singletons(r, names, v, err) ||
        !idem__http_deadline(v[M_TIMEOUT], idem__now_ms(), &q.deadline_unix_ms,
                             &q.call_deadline_unix_ms, err)) {
        return NULL;
    }
    for (size_t i = 0; i < M_COUNT - M_SIG0; i++) {
        if (v[M_SIG0 + i] != NULL) {
            idem__v1__request__metadata_entry__init(&meta[q.n_metadata]);
            meta[q.n_metadata].key = (char *)signature_meta[i];
            meta[q.n_metadata].value = (char *)v[M_SIG0 + i];
            meta_ptrs[q.n_metadata] = &meta[q.n_metadata];
            q.n_metadata++;
        }
    }
    q.metadata = meta_ptrs;
    q.method = (char *)r->method;
    q.idempotency_key = (char *)(v[M_KEY] != NULL ? v[M_KEY] : "");
    q.request_id = (char *)(v[M_REQUEST_ID] != NULL ? v[M_REQUEST_ID] : "");
    q.caller = (char *)(v[M_CALLER] != NULL ? v[M_CALLER] : "");
    q.token = (char *)(v[M_TOKEN] != NULL ? v[M_TOKEN] : "");
    q.payload.data = (uint8_t *)r->msg;
    q.payload.len = r->len;
    q.attempt = 1;
    *len = idem__v1__request__get_packed_size(&q);
    uint8_t *frame = malloc(*len ? *len : 1);
    if (frame != NULL) {
        idem__v1__request__pack(&q, frame);
    }
    return frame;
}

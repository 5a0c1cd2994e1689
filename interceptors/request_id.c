/* request_id: gives every call a trace id and resolves its idempotency key.
 *
 * Request id: Request.request_id, else metadata "x-request-id", else 128 random bits in
 * hex. Key: Request.idempotency_key, else metadata "idempotency-key", else the method's
 * extractor, else the token; the extractor goes first when the client marked its key as
 * generated. The key is scoped later by (caller, method). */
#include <string.h>

#include "call.h"

static void resolve_request_id(idem_call *call)
{
    const char *id = call->req->request_id;
    if (id[0] == '\0') {
        const char *m = idem_call_metadata(call, "x-request-id");
        id = m != NULL ? m : "";
    }
    if (id[0] != '\0' && strlen(id) <= IDEM_MAX_REQUEST_ID) {
        strcpy(call->request_id, id);
        return;
    }
    idem__random_hex(call->request_id, 16);
}

static bool set_key(idem_call *call, const char *key, idem_key_source source)
{
    size_t len = key != NULL ? strlen(key) : 0;
    if (len == 0 || len > IDEM_MAX_KEY || !idem__utf8_valid(key, len)) {
        return false;
    }
    memcpy(call->key, key, len + 1);
    call->key_source = source;
    return true;
}

/* The method's business key, when it has an extractor and the payload carries one. */
static idem_code extract_key(idem_call *call)
{
    const idem_method *m = call->method;
    char buf[IDEM_MAX_KEY + 2] = {0};
    if (m == NULL || m->opts.extractor == NULL ||
        !m->opts.extractor(call, buf, sizeof(buf), m->opts.extractor_arg)) {
        return IDEM_OK;
    }
    return set_key(call, buf, IDEM_KEY_EXTRACTED)
               ? IDEM_OK
               : idem__reject(call, IDEM_REASON_BAD_KEY, IDEM_INVALID_ARGUMENT,
                              "extracted business key must be 1..%d bytes of UTF-8", IDEM_MAX_KEY);
}

/* Returns IDEM_OK, or INVALID_ARGUMENT for a key that is present but unusable. A key
 * that idem_client generated itself (metadata idem-key-generated) yields to the
 * business key: the same callback sent twice carries two random keys but one
 * out_trade_no. */
static idem_code resolve_key(idem_call *call)
{
    const char *meta = idem_call_metadata(call, "idempotency-key");
    const char *generated = idem_call_metadata(call, IDEM_META_KEY_GENERATED);
    idem_code code;

    if (generated != NULL && strcmp(generated, "1") == 0 &&
        ((code = extract_key(call)) != IDEM_OK || call->key_source != IDEM_KEY_NONE)) {
        return code;
    }
    if (set_key(call, call->req->idempotency_key, IDEM_KEY_FIELD)) {
        return IDEM_OK;
    }
    if (meta != NULL) {
        return set_key(call, meta, IDEM_KEY_METADATA)
                   ? IDEM_OK
                   : idem__reject(call, IDEM_REASON_BAD_KEY, IDEM_INVALID_ARGUMENT,
                                  "metadata idempotency-key must be 1..%d bytes of UTF-8",
                                  IDEM_MAX_KEY);
    }
    if ((code = extract_key(call)) != IDEM_OK || call->key_source != IDEM_KEY_NONE) {
        return code;
    }
    set_key(call, call->req->token, IDEM_KEY_TOKEN);
    return IDEM_OK;
}

idem_code idem__request_id_interceptor(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    resolve_request_id(call);
    idem_code code = resolve_key(call);
    if (code != IDEM_OK) {
        return code;
    }
    const idem_method *m = call->method;
    if (m != NULL && (m->opts.flags & IDEM_METHOD_KEY_REQUIRED) &&
        call->key_source == IDEM_KEY_NONE) {
        return idem__reject(call, IDEM_REASON_KEY_REQUIRED, IDEM_INVALID_ARGUMENT,
                            "method %s requires an idempotency key (idempotency_key field "
                            "or metadata idempotency-key)",
                            m->name);
    }
    return idem_call_next(call, next);
}

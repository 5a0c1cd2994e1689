/* request_id: gives every call a trace id and resolves its idempotency key.
 *
 * Request id: Request.request_id, else metadata "x-request-id", else 128 random bits in
 * hex. Key: the method's business key (extractor) when the request carries one, else
 * the key the request names (idem__request_key: Request.idempotency_key, else metadata
 * "idempotency-key", which wins over a key idem_client generated; two different keys
 * are refused), else the token. The key is scoped later by (caller, method). */
#include <string.h>

#include "builtins.h"

static void resolve_request_id(idem_call *call)
{
    const char *id = call->req->request_id;
    if (id[0] == '\0') {
        const char *m = idem_call_metadata(call, "x-request-id");
        id = m != NULL ? m : "";
    }
    size_t len = strlen(id);
    bool printable = true; /* it is echoed in logs, headers and JSON */
    for (size_t i = 0; i < len && printable; i++) {
        printable = (unsigned char)id[i] >= 0x20 && id[i] != 0x7f;
    }
    if (len > 0 && len <= IDEM_MAX_REQUEST_ID && printable) {
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

/* The method's business key into buf ("" when it has no extractor or the payload
 * carries none). */
static idem_code extract_key(idem_call *call, char buf[IDEM_MAX_KEY + 2])
{
    const idem_method *m = call->method;
    buf[0] = '\0';
    if (m == NULL || m->opts.extractor == NULL ||
        !m->opts.extractor(call, buf, IDEM_MAX_KEY + 2, m->opts.extractor_arg)) {
        buf[0] = '\0';
        return IDEM_OK;
    }
    buf[IDEM_MAX_KEY + 1] = '\0';
    size_t len = strlen(buf);
    return len > 0 && len <= IDEM_MAX_KEY && idem__utf8_valid(buf, len)
               ? IDEM_OK
               : idem__reject(call, IDEM_REASON_BAD_KEY, IDEM_INVALID_ARGUMENT,
                              "extracted business key must be 1..%d bytes of UTF-8", IDEM_MAX_KEY);
}

/* Returns IDEM_OK, or INVALID_ARGUMENT for a key that is present but unusable.
 *
 * The key the request names is idem__request_key's, the rule idem_client follows too.
 * A method's business key IS its key: the same callback sent twice carries one
 * out_trade_no whatever keys the senders chose, so an explicit key that differs is
 * refused (accepting it would let `--key K` run the debit a second time) and a key
 * idem_client generated yields to it. */
static idem_code resolve_key(idem_call *call)
{
    const char *gen = idem_call_metadata(call, IDEM_META_KEY_GENERATED);
    idem_key_source source;
    bool conflict;
    const char *named =
        idem__request_key(call->req->idempotency_key, idem_call_metadata(call, "idempotency-key"),
                          idem__key_generated(gen), &source, &conflict);
    char business[IDEM_MAX_KEY + 2];
    idem_code code;

    if (conflict) {
        return idem__reject(call, IDEM_REASON_BAD_KEY, IDEM_INVALID_ARGUMENT, IDEM__KEY_CONFLICT);
    }
    if (source == IDEM_KEY_METADATA && !set_key(call, named, IDEM_KEY_METADATA)) {
        return idem__reject(call, IDEM_REASON_BAD_KEY, IDEM_INVALID_ARGUMENT,
                            "metadata idempotency-key must be 1..%d bytes of UTF-8", IDEM_MAX_KEY);
    }
    if ((code = extract_key(call, business)) != IDEM_OK) {
        return code;
    }
    if (business[0] != '\0') {
        if (named != NULL && source != IDEM_KEY_GENERATED && strcmp(named, business) != 0) {
            return idem__reject(call, IDEM_REASON_BAD_KEY, IDEM_INVALID_ARGUMENT,
                                "method %s derives its idempotency key from the request (its "
                                "business key); an explicit key that differs is refused: send "
                                "none, or the business key",
                                call->method->name);
        }
        set_key(call, business, IDEM_KEY_EXTRACTED);
    } else if (source == IDEM_KEY_FIELD || source == IDEM_KEY_GENERATED) {
        set_key(call, named, source);
    } else if (source == IDEM_KEY_NONE) {
        set_key(call, call->req->token, IDEM_KEY_TOKEN);
    }
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
    bool chosen = call->key_source != IDEM_KEY_NONE && call->key_source != IDEM_KEY_GENERATED;
    if (m != NULL && (m->opts.flags & IDEM_METHOD_KEY_REQUIRED) && !chosen) {
        return idem__reject(call, IDEM_REASON_KEY_REQUIRED, IDEM_INVALID_ARGUMENT,
                            "method %s requires an idempotency key chosen by the caller "
                            "(idempotency_key field, metadata idempotency-key or the "
                            "Idempotency-Key header)%s",
                            m->name,
                            call->key_source == IDEM_KEY_GENERATED
                                ? "; a key idem_client generated does not count"
                                : "");
    }
    return idem_call_next(call, next);
}

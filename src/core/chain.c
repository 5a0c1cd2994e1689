/* The interceptor chain and the idem_call accessors. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"

idem_code idem__call_suspend(idem_call *call, idem_suspend why)
{
    call->suspend = why;
    return IDEM_UNAVAILABLE; /* never sent: the server answers once the call resumes */
}

bool idem__call_recorded(idem_call *call)
{
    return atomic_fetch_sub(&call->recording.turns, 1) == 1;
}

idem_code idem__call_defer(idem_call *call, size_t pos)
{
    call->resume_pos = pos;
    return idem__call_suspend(call, IDEM__SUSPEND_DEFER);
}

idem_code idem_call_next(idem_call *call, idem_next next)
{
    if (next.chain != NULL && next.pos < next.chain->n) {
        const idem_interceptor *it = &next.chain->items[next.pos];
        if (call->fast_only && !it->fast_safe) {
            return idem__call_defer(call, next.pos);
        }
        return it->fn(call, (idem_next){next.chain, next.pos + 1}, it->arg);
    }
    if (call->fast_only) {
        return idem__call_defer(call, next.pos); /* handlers run on workers */
    }
    if (call->method == NULL) {
        return idem__reject(call, IDEM_REASON_UNIMPLEMENTED, IDEM_UNIMPLEMENTED,
                            "unknown method \"%s\"", idem_call_method(call));
    }
    call->executed = true;
    idem_code code = call->method->fn(call, call->method->arg);
    if (call->locks != NULL) {
        call->locks_release(call); /* locks end with the handler that took them */
    }
    if ((unsigned)code >= IDEM_CODE_COUNT) {
        return idem_call_fail(call, IDEM_INTERNAL, "handler of %s returned %d, not an idem_code",
                              call->method->name, (int)code);
    }
    if (code != call->code) {
        /* A handler that returned one code and replied another: the return wins. */
        call->code = code;
    }
    return code;
}

void idem__call_init(idem_call *call, const Idem__V1__Request *req, const idem_method *m,
                     idem_runtime *rt)
{
    memset(call, 0, sizeof(*call));
    call->req = req;
    call->method = m;
    call->rt = rt;
    /* Bounded by codec.c; cut, never overrun, for a request built by hand. */
    snprintf(call->caller, sizeof(call->caller), "%s", req->caller != NULL ? req->caller : "");
}

void idem__call_drop_replay_wire(idem_call *call)
{
    idem_borrow b = call->replay_borrow;
    if (b.end != NULL) {
        b.end(b.a, b.b);
    } else {
        free(call->replay_wire);
    }
    call->replay_borrow.end = NULL;
    call->replay_wire = NULL;
    call->replay_wire_len = 0;
}

void idem__call_reset_response(idem_call *call)
{
    free(call->message);
    free(call->payload);
    idem__kv_free(call->meta, call->meta_count);
    idem__call_drop_replay_wire(call);
    call->message = NULL;
    call->payload = NULL;
    call->payload_len = 0;
    call->meta = NULL;
    call->meta_count = 0;
    call->meta_cap = 0;
    call->code = IDEM_OK;
    call->replayed = false;
}

void idem__call_fini(idem_call *call)
{
    if (call->saga_free != NULL) {
        call->saga_free(call);
    }
    idem__call_reset_response(call);
}

const char *idem_call_method(const idem_call *call)
{
    return call->req->method;
}

const char *idem_call_caller(const idem_call *call)
{
    return call->caller;
}

bool idem_call_caller_verified(const idem_call *call)
{
    return call->caller_verified;
}

const char *idem_call_request_id(const idem_call *call)
{
    return call->request_id;
}

const char *idem_call_token(const idem_call *call)
{
    return call->req->token;
}

const void *idem_call_payload(const idem_call *call, size_t *len)
{
    *len = call->req->payload.len;
    return call->req->payload.data;
}

uint32_t idem_call_attempt(const idem_call *call)
{
    return call->req->attempt;
}

uint64_t idem_call_deadline_ms(const idem_call *call)
{
    return call->req->deadline_unix_ms;
}

uint64_t idem_call_overall_deadline_ms(const idem_call *call)
{
    uint64_t attempt = call->req->deadline_unix_ms, whole = call->req->call_deadline_unix_ms;
    if (attempt == 0 || whole == 0) { /* no bound on the attempt, or not sent: the other */
        return attempt == 0 ? whole : attempt;
    }
    return whole > attempt ? whole : attempt; /* never shorter than the attempt's */
}

const char *idem_call_metadata(const idem_call *call, const char *name)
{
    for (size_t i = 0; i < call->req->n_metadata; i++) {
        if (strcmp(call->req->metadata[i]->key, name) == 0) {
            return call->req->metadata[i]->value;
        }
    }
    return NULL;
}

size_t idem_call_metadata_count(const idem_call *call)
{
    return call->req->n_metadata;
}

void idem_call_metadata_at(const idem_call *call, size_t i, const char **name, const char **value)
{
    *name = i < call->req->n_metadata ? call->req->metadata[i]->key : NULL;
    *value = i < call->req->n_metadata ? call->req->metadata[i]->value : NULL;
}

const char *idem_call_key(const idem_call *call)
{
    return call->key_source != IDEM_KEY_NONE ? call->key : NULL;
}

idem_key_source idem_call_key_source(const idem_call *call)
{
    return call->key_source;
}

idem_code idem_call_reply(idem_call *call, idem_code code, const void *payload, size_t len)
{
    uint8_t *copy = NULL;
    if (len > 0 && (copy = malloc(len)) == NULL) {
        return idem_call_fail(call, IDEM_RESOURCE_EXHAUSTED, "out of memory for reply");
    }
    if (len > 0) {
        memcpy(copy, payload, len);
    }
    free(call->payload);
    call->payload = copy;
    call->payload_len = len;
    call->code = code;
    return code;
}

idem_code idem__call_set_message(idem_call *call, const char *msg)
{
    char *copy = idem__strdup(msg);
    if (copy == NULL) {
        return IDEM_RESOURCE_EXHAUSTED;
    }
    free(call->message);
    call->message = copy;
    return IDEM_OK;
}

idem_code idem_call_fail(idem_call *call, idem_code code, const char *fmt, ...)
{
    char buf[IDEM_MAX_MESSAGE + 1];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    free(call->payload);
    call->payload = NULL;
    call->payload_len = 0;
    call->code = code;
    idem__call_set_message(call, buf); /* on ENOMEM the code alone still tells */
    return code;
}

void idem__kv_free(idem_kv *kv, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(kv[i].name);
    }
    free(kv);
}

/* An entry in one allocation: name, then value. */
static bool kv_make(idem_kv *kv, const char *name, const char *value)
{
    size_t n = strlen(name) + 1, v = strlen(value) + 1;
    char *b = malloc(n + v);
    if (b == NULL) {
        return false;
    }
    memcpy(b, name, n);
    memcpy(b + n, value, v);
    *kv = (idem_kv){b, b + n};
    return true;
}

/* Adds or replaces an entry while the response holds fewer than limit entries. The
 * array grows by doubling from the library's own entries' count. */
static idem_code set_meta(idem_call *call, const char *name, const char *value, size_t limit)
{
    if (strlen(name) > IDEM_MAX_METADATA_NAME || strlen(value) > IDEM_MAX_METADATA_VALUE) {
        return idem__err(IDEM_INVALID_ARGUMENT, "metadata entry too long");
    }
    size_t i = 0;
    while (i < call->meta_count && strcmp(call->meta[i].name, name) != 0) {
        i++;
    }
    if (i == call->meta_count && i >= limit) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "response metadata limit (%zu)", limit);
    }
    if (i == call->meta_cap) {
        size_t cap = call->meta_cap > 0 ? 2 * call->meta_cap : IDEM_RESERVED_METADATA;
        idem_kv *grown = realloc(call->meta, cap * sizeof(*grown));
        if (grown == NULL) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        }
        call->meta = grown;
        call->meta_cap = cap;
    }
    idem_kv kv;
    if (!kv_make(&kv, name, value)) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (i < call->meta_count) {
        free(call->meta[i].name);
    } else {
        call->meta_count++;
    }
    call->meta[i] = kv;
    return IDEM_OK;
}

idem_code idem__reject(idem_call *call, const char *reason, idem_code code, const char *fmt, ...)
{
    char buf[IDEM_MAX_MESSAGE + 1];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    call->reason = reason;
    return idem_call_fail(call, code, "%s", buf);
}

idem_code idem_call_set_response_metadata(idem_call *call, const char *name, const char *value)
{
    return set_meta(call, name, value, IDEM_MAX_METADATA - IDEM_RESERVED_METADATA);
}

idem_code idem__call_set_meta(idem_call *call, const char *name, const char *value)
{
    return set_meta(call, name, value, IDEM_MAX_METADATA);
}

idem_code idem_call_code(const idem_call *call)
{
    return call->code;
}

const char *idem_call_message(const idem_call *call)
{
    return call->message != NULL ? call->message : "";
}

const void *idem_call_response_payload(const idem_call *call, size_t *len)
{
    *len = call->payload_len;
    return call->payload;
}

const char *idem_call_response_metadata(const idem_call *call, const char *name)
{
    for (size_t i = 0; i < call->meta_count; i++) {
        if (strcmp(call->meta[i].name, name) == 0) {
            return call->meta[i].value;
        }
    }
    return NULL;
}

bool idem_call_replayed(const idem_call *call)
{
    return call->replayed;
}

void idem_call_set_user(idem_call *call, void *user)
{
    call->user = user;
}

void *idem_call_user(const idem_call *call)
{
    return call->user;
}

idem_txn *idem_call_txn(idem_call *call)
{
    return call->txn;
}

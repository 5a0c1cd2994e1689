/* What the client puts on the wire and takes off it: the call's key (fixed once for
 * every attempt), one attempt's request envelope (the caller's metadata, then the
 * library's own entries: the generated-key mark and, for a signing client, the
 * signature signed anew for every attempt, so that a retry never falls out of the
 * server's clock window), and the idem_result a response is copied into (owned by the
 * caller, freed with idem_result_clear). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

const char *idem__client_request_meta(const idem_request *req, const char *name)
{
    for (size_t i = 0; i < req->metadata_count; i++) {
        if (req->metadata[i].name != NULL && strcmp(req->metadata[i].name, name) == 0) {
            return req->metadata[i].value;
        }
    }
    return NULL;
}

idem_code idem__client_fix_key(const idem_request *req, bool never_generate,
                               char key[IDEM_CLIENT_KEY_MAX + 1], idem_key_source *source)
{
    bool conflict;
    const char *named =
        idem__request_key(req->idempotency_key, idem__client_request_meta(req, "idempotency-key"),
                          false, source, &conflict);
    if (conflict) {
        return idem__err(IDEM_INVALID_ARGUMENT, IDEM__KEY_CONFLICT);
    }
    if (named != NULL) {
        if (strlen(named) > IDEM_CLIENT_KEY_MAX) {
            return idem__err(IDEM_INVALID_ARGUMENT, "idempotency key too long");
        }
        strcpy(key, named);
    } else if ((req->token != NULL && req->token[0] != '\0') || never_generate) {
        key[0] = '\0'; /* the server makes the one-time token the key, or refuses */
    } else {
        if (!idem__ordered_key_hex(key)) {
            return idem__err(IDEM_INTERNAL, "getrandom failed");
        }
        *source = IDEM_KEY_GENERATED;
    }
    return IDEM_OK;
}

/* Appends one metadata entry the library adds (the room was checked). */
static void add_entry(Idem__V1__Request__MetadataEntry *e, Idem__V1__Request__MetadataEntry **ptrs,
                      size_t *n, const char *name, const char *value)
{
    idem__v1__request__metadata_entry__init(&e[*n]);
    e[*n].key = (char *)name;
    e[*n].value = (char *)value;
    ptrs[*n] = &e[*n];
    (*n)++;
}

/* The signature entries of one attempt (README "Security"): signed anew every time, so
 * that a retry never falls out of the server's clock window. */
static idem_code sign_attempt(const idem_client *c, const Idem__V1__Request *m,
                              Idem__V1__Request__MetadataEntry *e,
                              Idem__V1__Request__MetadataEntry **ptrs, size_t *n, char ts[24],
                              char sig[IDEM_SIGNATURE_HEX + 1])
{
    const char *meta_key = NULL, *generated = NULL;
    for (size_t i = 0; i < *n; i++) { /* the server refuses duplicate names */
        meta_key = strcmp(e[i].key, "idempotency-key") == 0 ? e[i].value : meta_key;
        generated = strcmp(e[i].key, IDEM_META_KEY_GENERATED) == 0 ? e[i].value : generated;
    }
    uint64_t now = idem__now_ms();
    idem_signed_fields f = {.signer = c->signer,
                            .caller = m->caller,
                            .method = m->method,
                            .key = idem__signed_key(m->idempotency_key, meta_key, generated),
                            .key_generated = generated,
                            .token = m->token,
                            .payload = m->payload.data,
                            .payload_len = m->payload.len,
                            .timestamp_ms = now};
    if (!idem__signature(c->secret, &f, sig)) {
        return idem__err(IDEM_INVALID_ARGUMENT, "cannot sign the request (a field is over its "
                                                "bound)");
    }
    snprintf(ts, 24, "%llu", (unsigned long long)now);
    add_entry(e, ptrs, n, IDEM_META_SIGNATURE, sig);
    add_entry(e, ptrs, n, IDEM_META_TIMESTAMP, ts);
    if (c->signer != NULL) {
        add_entry(e, ptrs, n, IDEM_META_SIGNER, c->signer);
    }
    return IDEM_OK;
}

idem_code idem__client_build_msg(const idem_client *c, const idem_request *r, const char *caller,
                                 const char *key, bool key_generated, uint32_t attempt,
                                 uint64_t deadline, uint64_t call_deadline, nng_msg **out)
{
    Idem__V1__Request m = IDEM__V1__REQUEST__INIT;
    Idem__V1__Request__MetadataEntry entries[64], *ptrs[64]; /* the server takes 64 */
    char ts[24], sig[IDEM_SIGNATURE_HEX + 1];
    nng_msg *msg;
    size_t n = r->metadata_count;
    size_t ours = key_generated + (c->secret != NULL ? 2 + (c->signer != NULL) : 0);

    if (n + ours > IDEM_ARRAY_LEN(entries)) {
        return idem__err(IDEM_INVALID_ARGUMENT, "at most %zu metadata entries",
                         IDEM_ARRAY_LEN(entries) - ours);
    }
    for (size_t i = 0; i < n; i++) {
        idem__v1__request__metadata_entry__init(&entries[i]);
        entries[i].key = (char *)r->metadata[i].name;
        entries[i].value = (char *)r->metadata[i].value;
        ptrs[i] = &entries[i];
    }
    if (key_generated) { /* lets a business key (the method's extractor) win over ours */
        add_entry(entries, ptrs, &n, IDEM_META_KEY_GENERATED, "1");
    }
    m.method = (char *)r->method;
    m.idempotency_key = (char *)key;
    m.request_id = (char *)(r->request_id ? r->request_id : "");
    m.token = (char *)(r->token ? r->token : "");
    m.caller = (char *)caller;
    m.payload.data = (uint8_t *)r->payload;
    m.payload.len = r->payload_len;
    m.attempt = attempt;
    m.deadline_unix_ms = deadline;
    m.call_deadline_unix_ms = call_deadline; /* the handler's downstream calls inherit it */
    idem_code code;
    if (c->secret != NULL && (code = sign_attempt(c, &m, entries, ptrs, &n, ts, sig)) != IDEM_OK) {
        return code;
    }
    m.n_metadata = n;
    m.metadata = ptrs;
    size_t len = idem__v1__request__get_packed_size(&m);
    if (nng_msg_alloc(&msg, len) != 0) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    idem__v1__request__pack(&m, nng_msg_body(msg));
    *out = msg;
    return IDEM_OK;
}

static char *dup_bytes(const void *p, size_t n)
{
    char *s = malloc(n + 1);
    if (s != NULL) {
        if (n > 0) {
            memcpy(s, p, n);
        }
        s[n] = '\0';
    }
    return s;
}

/* s copied to *at, which moves past it. */
static char *put_str(char **at, const char *s)
{
    size_t n = strlen(s) + 1;
    char *copy = memcpy(*at, s, n);
    *at += n;
    return copy;
}

/* The response's metadata table, message, request id and metadata strings are one
 * block (out->metadata is its start), the payload a buffer of its own (a caller may
 * take it): two allocations per result, not two per metadata entry. */
idem_code idem__client_result_fill(idem_result *out, const Idem__V1__Response *r)
{
    size_t n = r->n_metadata, size = (n + 1) * sizeof(idem_metadata_kv);
    size += strlen(r->message) + strlen(r->request_id) + 2;
    for (size_t i = 0; i < n; i++) {
        size += strlen(r->metadata[i]->key) + strlen(r->metadata[i]->value) + 2;
    }
    out->code = (idem_code)r->code;
    out->replayed = r->replayed;
    out->payload = dup_bytes(r->payload.data, r->payload.len);
    out->payload_len = r->payload.len;
    out->metadata = malloc(size);
    if (out->payload == NULL || out->metadata == NULL) {
        return IDEM_RESOURCE_EXHAUSTED;
    }
    char *at = (char *)(out->metadata + n + 1);
    out->message = put_str(&at, r->message);
    out->request_id = put_str(&at, r->request_id);
    for (size_t i = 0; i < n; i++) {
        const char *k = put_str(&at, r->metadata[i]->key);
        out->metadata[i] = (idem_metadata_kv){k, put_str(&at, r->metadata[i]->value)};
    }
    out->metadata[n] = (idem_metadata_kv){NULL, NULL};
    out->metadata_count = n;
    return IDEM_OK;
}

const char *idem_result_metadata(const idem_result *r, const char *name)
{
    for (size_t i = 0; i < r->metadata_count; i++) {
        if (r->metadata[i].name != NULL && strcmp(r->metadata[i].name, name) == 0) {
            return r->metadata[i].value;
        }
    }
    return NULL;
}

void idem_result_clear(idem_result *r)
{
    if (r == NULL) {
        return;
    }
    if (r->metadata == NULL) { /* no response was copied: an error message of its own */
        free(r->message);
        free(r->request_id);
    }
    free(r->metadata); /* the block that holds message, request_id and the entries */
    free(r->payload);
    r->metadata = NULL;
    r->metadata_count = 0;
    r->message = r->payload = r->request_id = NULL;
    r->payload_len = 0;
}

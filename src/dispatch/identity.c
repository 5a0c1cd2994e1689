/* The identity step (identity.h): runs on every call before the deadline check and the
 * chain, on nng's callback thread for the fast path too, so it never blocks (a table
 * look-up and one HMAC).
 *
 * Invariant: once a caller is verified, call->caller is that caller and nothing a client
 * writes changes it; every scope (records, tokens, the in-flight table, debounce) reads
 * it through idem_call_caller(). */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "identity.h"

typedef struct secret_entry {
    char caller[IDEM_MAX_CALLER + 1];
    char secret[IDEM_MAX_CALLER_SECRET + 1];
    bool proxy;
} secret_entry;

typedef struct uid_entry {
    uint64_t uid;
    char caller[IDEM_MAX_CALLER + 1];
} uid_entry;

#define MAX_TLS_CALLERS 64
#define MAX_WINDOW_MS (24 * 3600 * 1000ull)

struct idem_identity {
    secret_entry *secrets;
    size_t n_secrets;
    uid_entry *uids;
    size_t n_uids;
    uint64_t window_ms;
    bool require_verified;
    /* Callers of TLS listeners, added at listen (append-only: a name is written, then
     * the count published, so readers on nng's threads need no lock). */
    char tls_callers[MAX_TLS_CALLERS][IDEM_MAX_CALLER + 1];
    atomic_size_t n_tls_callers;
};

static idem_code copy_secrets(idem_identity *id, const idem_server_opts *o)
{
    if (o->n_caller_secrets > IDEM_MAX_CALLER_SECRETS) {
        return idem__err(IDEM_INVALID_ARGUMENT, "%zu caller secrets; at most %d",
                         o->n_caller_secrets, IDEM_MAX_CALLER_SECRETS);
    }
    if (o->n_caller_secrets > 0 &&
        (id->secrets = calloc(o->n_caller_secrets, sizeof(secret_entry))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < o->n_caller_secrets; i++) {
        const idem_caller_secret *s = &o->caller_secrets[i];
        size_t len = s->secret != NULL ? strlen(s->secret) : 0;
        if (!idem__caller_name_ok(s->caller)) {
            return idem__err(IDEM_INVALID_ARGUMENT,
                             "caller secret %zu: the caller must be 1..%d "
                             "printable bytes",
                             i, IDEM_MAX_CALLER);
        }
        if (len < IDEM_MIN_CALLER_SECRET || len > IDEM_MAX_CALLER_SECRET) {
            return idem__err(IDEM_INVALID_ARGUMENT,
                             "caller secret %zu: the secret must be %d..%d "
                             "bytes (it has %zu)",
                             i, IDEM_MIN_CALLER_SECRET, IDEM_MAX_CALLER_SECRET, len);
        }
        for (size_t j = 0; j < i; j++) {
            if (strcmp(id->secrets[j].caller, s->caller) == 0) {
                return idem__err(IDEM_INVALID_ARGUMENT,
                                 "caller secret %zu: a second secret for "
                                 "one caller (entry %zu)",
                                 i, j);
            }
        }
        secret_entry *e = &id->secrets[id->n_secrets++];
        strcpy(e->caller, s->caller);
        strcpy(e->secret, s->secret);
        e->proxy = s->proxy;
    }
    return IDEM_OK;
}

static idem_code copy_uids(idem_identity *id, const idem_server_opts *o)
{
    if (o->n_ipc_callers > IDEM_MAX_IPC_CALLERS) {
        return idem__err(IDEM_INVALID_ARGUMENT, "%zu ipc callers; at most %d", o->n_ipc_callers,
                         IDEM_MAX_IPC_CALLERS);
    }
    if (o->n_ipc_callers > 0 && (id->uids = calloc(o->n_ipc_callers, sizeof(uid_entry))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < o->n_ipc_callers; i++) {
        const idem_ipc_caller *u = &o->ipc_callers[i];
        if (!idem__caller_name_ok(u->caller)) {
            return idem__err(IDEM_INVALID_ARGUMENT,
                             "ipc caller %zu: the caller must be 1..%d "
                             "printable bytes",
                             i, IDEM_MAX_CALLER);
        }
        for (size_t j = 0; j < i; j++) {
            if (id->uids[j].uid == u->uid) {
                return idem__err(IDEM_INVALID_ARGUMENT,
                                 "ipc caller %zu: uid %" PRIu64 " is mapped twice", i, u->uid);
            }
        }
        uid_entry *e = &id->uids[id->n_uids++];
        e->uid = u->uid;
        strcpy(e->caller, u->caller);
    }
    return IDEM_OK;
}

idem_code idem__identity_create(idem_identity **out, const idem_server_opts *opts)
{
    *out = NULL;
    if (opts->signature_window_ms > MAX_WINDOW_MS) {
        return idem__err(IDEM_INVALID_ARGUMENT, "signature_window_ms: at most %llu (a day)",
                         (unsigned long long)MAX_WINDOW_MS);
    }
    idem_identity *id = calloc(1, sizeof(*id));
    if (id == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    id->window_ms = opts->signature_window_ms; /* its default set by idem__server_opts_defaults */
    id->require_verified = opts->require_verified_caller;
    idem_code code;
    if ((code = copy_secrets(id, opts)) != IDEM_OK || (code = copy_uids(id, opts)) != IDEM_OK) {
        idem__identity_destroy(id);
        return code;
    }
    *out = id;
    return IDEM_OK;
}

void idem__identity_destroy(idem_identity *id)
{
    if (id == NULL) {
        return;
    }
    if (id->secrets != NULL) { /* secrets do not outlive the server in freed memory */
        explicit_bzero(id->secrets, id->n_secrets * sizeof(secret_entry));
    }
    free(id->secrets);
    free(id->uids);
    free(id);
}

/* ---- per call ---- */

/* s for an error message: at most 64 bytes, control characters, '"' and '\' as \xNN
 * (metadata values are client-supplied and not checked for them). */
static const char *quoted(char out[4 * 64 + 4], const char *s)
{
    size_t o = 0;
    for (size_t i = 0; s[i] != '\0'; i++) {
        unsigned char c = (unsigned char)s[i];
        if (i == 64) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        if (c < 0x20 || c == 0x7f || c == '"' || c == '\\') {
            o += (size_t)snprintf(out + o, 5, "\\x%02x", c);
        } else {
            out[o++] = (char)c;
        }
    }
    out[o] = '\0';
    return out;
}

static const char *uid_caller(const idem_identity *id, const idem_peer *peer)
{
    for (size_t i = 0; peer != NULL && peer->has_uid && i < id->n_uids; i++) {
        if (id->uids[i].uid == peer->uid) {
            return id->uids[i].caller;
        }
    }
    return NULL;
}

static const secret_entry *find_secret(const idem_identity *id, const char *name)
{
    for (size_t i = 0; i < id->n_secrets; i++) {
        if (strcmp(id->secrets[i].caller, name) == 0) {
            return &id->secrets[i];
        }
    }
    return NULL;
}

/* idem-timestamp: unix ms in decimal, nothing else. */
static bool parse_ms(const char *s, uint64_t *out)
{
    size_t len = strlen(s);
    if (len == 0 || len > 19 || strspn(s, "0123456789") != len) {
        return false;
    }
    *out = strtoull(s, NULL, 10);
    return true;
}

/* The request's signature and timestamp, within the window. */
static idem_code check_signature(const idem_identity *id, idem_call *call, const secret_entry *e,
                                 const char *sig, const char *ts_text)
{
    const Idem__V1__Request *r = call->req;
    uint64_t ts, now = idem__rt_now_ms(call->rt);
    if (!parse_ms(ts_text, &ts)) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_UNAUTHENTICATED,
                            "idem-timestamp (Idem-Timestamp) must be unix milliseconds");
    }
    if (ts + id->window_ms < now || ts > now + id->window_ms) {
        bool stale = ts < now;
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_UNAUTHENTICATED,
                            "signature timestamp is %llu ms in the %s; the server accepts %llu ms "
                            "either way (sign every attempt anew; check the clocks)",
                            (unsigned long long)(stale ? now - ts : ts - now),
                            stale ? "past" : "future", (unsigned long long)id->window_ms);
    }
    char want[IDEM_SIGNATURE_HEX + 1];
    idem_signed_fields f = {
        .signer = idem_call_metadata(call, IDEM_META_SIGNER),
        .caller = r->caller,
        .method = r->method,
        .key = idem__signed_key(r->idempotency_key, idem_call_metadata(call, "idempotency-key"),
                                idem_call_metadata(call, IDEM_META_KEY_GENERATED)),
        .key_generated = idem_call_metadata(call, IDEM_META_KEY_GENERATED),
        .token = r->token,
        .payload = r->payload.data,
        .payload_len = r->payload.len,
        .timestamp_ms = ts,
    };
    if (!idem__signature(e->secret, &f, want)) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_INTERNAL,
                            "cannot compute the request signature");
    }
    if (!idem__signature_equal(want, sig)) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_UNAUTHENTICATED,
                            "idem-signature does not match the request (it covers signer, caller, "
                            "method, key, token, payload and timestamp)");
    }
    return IDEM_OK;
}

/* A signed request's verified caller into *verified (NULL when unsigned). */
static idem_code verify_signed(const idem_identity *id, idem_call *call, const char **verified)
{
    *verified = NULL;
    if (id->n_secrets == 0) {
        return IDEM_OK; /* no secrets here: a signature means nothing (and costs nothing) */
    }
    const char *sig = idem_call_metadata(call, IDEM_META_SIGNATURE);
    const char *ts = idem_call_metadata(call, IDEM_META_TIMESTAMP);
    const char *signer = idem_call_metadata(call, IDEM_META_SIGNER);
    const char *caller = call->req->caller;
    char q1[260], q2[260];
    if (sig == NULL && ts == NULL && signer == NULL) {
        return IDEM_OK; /* unsigned */
    }
    if (sig == NULL || ts == NULL) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_UNAUTHENTICATED,
                            "a signed request carries both idem-signature and idem-timestamp "
                            "(HTTP: Idem-Signature, Idem-Timestamp)");
    }
    if (caller[0] == '\0') {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_UNAUTHENTICATED,
                            "a signed request must name its caller (caller / X-Caller)");
    }
    const char *name = signer != NULL ? signer : caller;
    const secret_entry *e = find_secret(id, name);
    if (e == NULL) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_UNAUTHENTICATED,
                            "no signing secret is configured for \"%s\"", quoted(q1, name));
    }
    if (e != find_secret(id, caller) && !e->proxy) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_PERMISSION_DENIED,
                            "\"%s\" is not a proxy: it signs only for itself, not for caller "
                            "\"%s\"",
                            quoted(q1, name), quoted(q2, caller));
    }
    idem_code code = check_signature(id, call, e, sig, ts);
    *verified = code == IDEM_OK ? caller : NULL;
    return code;
}

idem_code idem__identity_add_tls_caller(idem_identity *id, const char *caller)
{
    size_t n = atomic_load(&id->n_tls_callers);
    for (size_t i = 0; i < n; i++) {
        if (strcmp(id->tls_callers[i], caller) == 0) {
            return IDEM_OK;
        }
    }
    if (n == MAX_TLS_CALLERS) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d TLS callers", MAX_TLS_CALLERS);
    }
    snprintf(id->tls_callers[n], sizeof(id->tls_callers[n]), "%s", caller);
    atomic_store(&id->n_tls_callers, n + 1); /* listens are serialised by the server */
    return IDEM_OK;
}

/* A name some verified source speaks for: nobody may merely declare it. */
static bool protected_name(const idem_identity *id, const char *name)
{
    size_t n = atomic_load(&((idem_identity *)id)->n_tls_callers);
    for (size_t i = 0; i < n; i++) {
        if (strcmp(id->tls_callers[i], name) == 0) {
            return true;
        }
    }
    for (size_t i = 0; i < id->n_uids; i++) {
        if (strcmp(id->uids[i].caller, name) == 0) {
            return true;
        }
    }
    return find_secret(id, name) != NULL;
}

/* The caller the transport vouches for: a TLS listener's verified client, a mapped
 * ipc uid. */
static const char *transport_caller(const idem_identity *id, const idem_peer *peer)
{
    if (peer != NULL && peer->tls_caller[0] != '\0') {
        return peer->tls_caller;
    }
    return id != NULL ? uid_caller(id, peer) : NULL;
}

idem_code idem__identity_resolve(const idem_identity *id, const idem_peer *peer, idem_call *call)
{
    const char *declared = call->req->caller;
    const char *verified = transport_caller(id, peer);
    char q1[260], q2[260];
    idem_code code;
    if (peer != NULL && peer->redriven) {
        snprintf(call->caller, sizeof(call->caller), "%s", peer->redriven_caller);
        call->caller_verified = peer->redriven_verified;
        return IDEM_OK;
    }
    if (peer != NULL && peer->transport_unverified) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_UNAUTHENTICATED,
                            "this TLS connection's client certificate could not be confirmed as "
                            "verified; reconnect");
    }
    if (verified == NULL && (code = verify_signed(id, call, &verified)) != IDEM_OK) {
        return code;
    }
    if (verified == NULL && id->require_verified) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_UNAUTHENTICATED,
                            "this server serves verified callers only: connect over ipc:// as a "
                            "mapped uid or over TLS, or sign the request (idem-signature and "
                            "idem-timestamp; README \"Security\")");
    }
    if (verified == NULL && declared[0] != '\0' && protected_name(id, declared)) {
        /* A name a secret, a uid or a TLS listener speaks for is never taken on trust:
         * otherwise an unverified connection would share that caller's records. */
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_PERMISSION_DENIED,
                            "caller \"%s\" is verified on this server: connect or sign as it "
                            "(README \"Security\")",
                            quoted(q1, declared));
    }
    if (verified == NULL) {
        return IDEM_OK; /* self-declared: trusted network only */
    }
    if (declared[0] != '\0' && strcmp(declared, verified) != 0) {
        return idem__reject(call, IDEM_REASON_IDENTITY, IDEM_PERMISSION_DENIED,
                            "caller \"%s\" is not the verified caller of this connection (\"%s\")",
                            quoted(q1, declared), quoted(q2, verified));
    }
    snprintf(call->caller, sizeof(call->caller), "%s", verified);
    call->caller_verified = true;
    return IDEM_OK;
}

/* idem_client: req0 socket, one nng context per logical call, Feign-style retries.
 *
 * nng's own REQ resend is switched off: the retryer resends instead, so that every
 * attempt carries attempt+1 and the per-attempt timeout and backoff are ours. */
#include <math.h>
#include <pthread.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "arena.h"
#include "client_internal.h"
#include "nng_close.h"

#define DEFAULT_MAX_FRAME (((size_t)4 << 20) + ((size_t)64 << 10))

void idem_client_opts_init(idem_client_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
}

static void retry_defaults(idem_retry_policy *p)
{
    p->max_attempts = p->max_attempts ? p->max_attempts : 5;
    p->period_ms = p->period_ms ? p->period_ms : 100;
    p->max_period_ms = p->max_period_ms ? p->max_period_ms : 1000;
    p->multiplier = p->multiplier > 0 ? p->multiplier : 1.5;
    p->jitter = p->jitter == 0 ? 0.2 : (p->jitter < 0 ? 0 : p->jitter);
}

void idem__client_opts_defaults(idem_client_opts *o)
{
    retry_defaults(&o->retry);
    o->attempt_timeout_ms = o->attempt_timeout_ms ? o->attempt_timeout_ms : 2000;
    o->deadline_ms = o->deadline_ms ? o->deadline_ms : 10000;
    o->max_frame = o->max_frame ? o->max_frame : DEFAULT_MAX_FRAME;
}

uint32_t idem_backoff_ms(const idem_retry_policy *policy, uint32_t retry, double rnd)
{
    idem_retry_policy p = *policy;
    retry_defaults(&p);
    double d = p.period_ms * pow(p.multiplier, retry > 0 ? retry - 1 : 0);
    if (d > p.max_period_ms) {
        d = p.max_period_ms;
    }
    d *= 1.0 + p.jitter * (2.0 * rnd - 1.0);
    return d < 0 ? 0 : (uint32_t)d;
}

static void free_strings(idem_client *c)
{
    if (c->secret != NULL) {
        explicit_bzero(c->secret, strlen(c->secret));
    }
    free(c->secret);
    free(c->signer);
    free(c->caller);
}

/* The options' strings, copied (the caller's are not retained). */
static idem_code copy_strings(idem_client *c)
{
    const char *secret = c->opts.signing_secret;
    size_t slen = secret != NULL ? strlen(secret) : 0;
    if (secret != NULL && (slen < IDEM_MIN_CALLER_SECRET || slen > IDEM_MAX_CALLER_SECRET)) {
        return idem__err(IDEM_INVALID_ARGUMENT, "signing secret must be %d..%d bytes (it has %zu)",
                         IDEM_MIN_CALLER_SECRET, IDEM_MAX_CALLER_SECRET, slen);
    }
    if ((c->caller = idem__strdup(c->opts.caller)) == NULL ||
        (secret != NULL && (c->secret = idem__strdup(secret)) == NULL) ||
        (c->opts.signer != NULL && (c->signer = idem__strdup(c->opts.signer)) == NULL)) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    c->opts.caller = c->caller;
    c->opts.signing_secret = c->secret;
    c->opts.signer = c->signer;
    return IDEM_OK;
}

idem_code idem_client_open(idem_client **out, const char *const *urls, size_t n,
                           const idem_client_opts *opts)
{
    idem_client *c;
    int rv;

    *out = NULL;
    if (n == 0) {
        return idem__err(IDEM_INVALID_ARGUMENT, "no server URL");
    }
    if ((c = calloc(1, sizeof(*c))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (opts != NULL) {
        c->opts = *opts;
    }
    idem__client_opts_defaults(&c->opts);
    idem_code code = copy_strings(c);
    if (code != IDEM_OK) {
        free_strings(c);
        free(c);
        return code;
    }
    if ((rv = nng_req0_open(&c->sock)) != 0) {
        free_strings(c);
        free(c);
        return idem__err(IDEM_UNAVAILABLE, "nng_req0_open: %s", nng_strerror(rv));
    }
    pthread_mutex_init(&c->mu, NULL); /* from here on idem_client_close cleans up */
    if ((rv = nng_socket_set_ms(c->sock, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE)) != 0 ||
        (rv = nng_socket_set_size(c->sock, NNG_OPT_RECVMAXSZ, c->opts.max_frame)) != 0) {
        idem_client_close(c);
        return idem__err(IDEM_INTERNAL, "client socket options: %s", nng_strerror(rv));
    }
    for (size_t i = 0; i < n; i++) {
        if ((code = idem__client_dial(c->sock, urls[i], &c->opts)) != IDEM_OK) {
            idem_client_close(c);
            return code;
        }
    }
    c->opts.tls_ca_file = c->opts.tls_cert_key_file = c->opts.tls_server_name = NULL;
    *out = c;
    return IDEM_OK;
}

static void slot_free(ctx_slot *s)
{
    nng_aio_free(s->aio);
    nng_ctx_close(s->ctx);
    free(s);
}

void idem_client_close(idem_client *c)
{
    if (c != NULL) {
        for (ctx_slot *s = c->idle, *next; s != NULL; s = next) {
            next = s->next;
            slot_free(s);
        }
        pthread_mutex_destroy(&c->mu);
        idem__nng_close_bounded(c->sock);
        free_strings(c);
        free(c);
    }
}

/* An idle context, or a new one: opening a context and an aio per attempt costs more
 * than a replay does on the server. */
static idem_code slot_get(idem_client *c, ctx_slot **out)
{
    pthread_mutex_lock(&c->mu);
    ctx_slot *s = c->idle;
    if (s != NULL) {
        c->idle = s->next;
        c->n_idle--;
    }
    pthread_mutex_unlock(&c->mu);
    if (s != NULL) {
        *out = s;
        return IDEM_OK;
    }
    int rv;
    if ((s = calloc(1, sizeof(*s))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    if ((rv = nng_ctx_open(&s->ctx, c->sock)) != 0) {
        free(s);
        return idem__err(IDEM_UNAVAILABLE, "nng_ctx_open: %s", nng_strerror(rv));
    }
    if ((rv = nng_aio_alloc(&s->aio, NULL, NULL)) != 0) {
        nng_ctx_close(s->ctx);
        free(s);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "nng_aio_alloc: %s", nng_strerror(rv));
    }
    *out = s;
    return IDEM_OK;
}

/* A context that timed out or failed may still hold a request: it is closed, never
 * reused. */
static void slot_put(idem_client *c, ctx_slot *s, bool clean)
{
    if (clean) {
        pthread_mutex_lock(&c->mu);
        if (c->n_idle < CTX_CACHE) {
            s->next = c->idle;
            c->idle = s;
            c->n_idle++;
            s = NULL;
        }
        pthread_mutex_unlock(&c->mu);
    }
    if (s != NULL) {
        slot_free(s);
    }
}

/* A decoded reply: the Response lives in arena, its payload in msg. */
typedef struct reply {
    nng_msg *msg;
    Idem__V1__Response *resp;
    idem_arena arena;
} reply;

static void reply_free(reply *rep)
{
    if (rep->resp != NULL) {
        idem__arena_reset(&rep->arena);
        rep->resp = NULL;
    }
    if (rep->msg != NULL) {
        nng_msg_free(rep->msg);
        rep->msg = NULL;
    }
}

/* One attempt: send, wait up to timeout_ms for the reply. Returns the transport
 * outcome; on IDEM_OK rep->resp holds the decoded response (free with reply_free).
 * *sent: nng handed the request to a connection (req0 completes the send then), so the
 * server may have it; false only when it provably never left. */
static idem_code attempt_once(idem_client *c, nng_msg *msg, uint32_t timeout_ms, reply *rep,
                              bool *sent)
{
    ctx_slot *slot = NULL;
    int rv;
    *sent = false;
    idem_code code = slot_get(c, &slot);
    if (code != IDEM_OK) {
        nng_msg_free(msg);
        return code;
    }
    nng_ctx ctx = slot->ctx;
    nng_aio *aio = slot->aio;
    nng_aio_set_timeout(aio, (nng_duration)timeout_ms);
    nng_aio_set_msg(aio, msg);
    nng_ctx_send(ctx, aio);
    nng_aio_wait(aio);
    if ((rv = nng_aio_result(aio)) == 0) {
        *sent = true;
        nng_ctx_recv(ctx, aio);
        nng_aio_wait(aio);
        rv = nng_aio_result(aio);
    } else {
        nng_msg_free(nng_aio_get_msg(aio));
    }
    if (rv == 0) {
        rep->msg = nng_aio_get_msg(aio);
        idem__arena_init(&rep->arena);
        rep->resp =
            idem__decode_response_arena(nng_msg_body(rep->msg), nng_msg_len(rep->msg), &rep->arena);
        if (rep->resp == NULL) {
            reply_free(rep);
            code = idem__err(IDEM_DATA_LOSS, "reply is not a valid idem.v1.Response");
        }
    } else if (rv == NNG_ETIMEDOUT) {
        code = idem__err(IDEM_DEADLINE_EXCEEDED, "no reply within %u ms", timeout_ms);
    } else {
        code = idem__err(IDEM_UNAVAILABLE, "transport: %s", nng_strerror(rv));
    }
    slot_put(c, slot, rv == 0);
    return code;
}

/* RESOURCE_EXHAUSTED is retried only as server back-pressure (it then carries
 * retry-after-ms); "store full" and "frame too large" would fail again. */
static bool retryable(idem_code code, uint32_t retry_after)
{
    return code == IDEM_UNAVAILABLE || code == IDEM_DEADLINE_EXCEEDED || code == IDEM_ABORTED ||
           (code == IDEM_RESOURCE_EXHAUSTED && retry_after > 0);
}

static uint32_t retry_after_hint(const Idem__V1__Response *r)
{
    for (size_t i = 0; r != NULL && i < r->n_metadata; i++) {
        if (strcmp(r->metadata[i]->key, "retry-after-ms") == 0) {
            unsigned long v = strtoul(r->metadata[i]->value, NULL, 10);
            return v > 60000 ? 60000 : (uint32_t)v;
        }
    }
    return 0;
}

uint32_t idem__client_deadline_ms(const idem_client *c)
{
    return c->opts.deadline_ms;
}

/* The last reply (resp, in rep) copied into out, with the key the server used (e.g. the
 * method's business key); code, or RESOURCE_EXHAUSTED when a copy failed. */
static idem_code call_result(idem_result *out, reply *rep, const Idem__V1__Response *resp,
                             idem_code code)
{
    idem_code fill = idem__client_result_fill(out, resp);
    const char *used = idem_result_metadata(out, "idem-key");
    if (used != NULL && strlen(used) <= IDEM_CLIENT_KEY_MAX) {
        strcpy(out->key, used); /* e.g. the method's business key */
    }
    reply_free(rep);
    if (fill != IDEM_OK) {
        idem_result_clear(out);
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    return code;
}

/* Whether an answer (code, with resp when one arrived and its retry-after hint) may be
 * followed by another attempt. A call with a key (or a token, which the server makes its
 * key) is retried on every transient answer: the server dedupes the repeat. A call with
 * neither is resent only when it provably did not reach the handler: it never left
 * (!sent), or the server turned it away before queueing it (back-pressure:
 * RESOURCE_EXHAUSTED with retry-after-ms). After a timeout, a lost connection or any
 * other answer its effect may have happened, and a resend would be a second one. */
static bool may_resend(bool keyed, idem_code code, const Idem__V1__Response *resp, bool sent,
                       uint32_t hint)
{
    if (!retryable(code, hint)) {
        return false;
    }
    return keyed || !sent || (resp != NULL && code == IDEM_RESOURCE_EXHAUSTED && hint > 0);
}

/* The pause before attempt+1: the policy's backoff, or the server's retry-after hint
 * when longer. false, without waiting, when it would reach the call's end (monotonic
 * ms): no attempt is left, and the call reports the answer it has. */
static bool backoff_wait(const idem_client *c, uint32_t attempt, uint32_t hint, uint64_t end)
{
    uint32_t wait = idem_backoff_ms(&c->opts.retry, attempt, idem__random_unit());
    wait = hint > wait ? hint : wait;
    if (idem__mono_ms() + wait >= end) {
        return false;
    }
    idem__sleep_ms(wait);
    return true;
}

/* The next attempt's reply wait (*timeout, ms) and the deadline it sends (unix ms): the
 * attempt timeout, cut to what is left of the call. false when nothing is left. */
static bool attempt_bounds(const idem_client *c, uint64_t end, uint64_t deadline_unix,
                           uint32_t *timeout, uint64_t *deadline)
{
    uint64_t now = idem__mono_ms();
    if (now >= end) {
        return false;
    }
    uint64_t left = end - now;
    *timeout = left < c->opts.attempt_timeout_ms ? (uint32_t)left : c->opts.attempt_timeout_ms;
    /* The attempt's own deadline: a duplicate waiting on the server answers ABORTED
     * "in progress" before this attempt gives up, instead of after. */
    *deadline = idem__now_ms() + *timeout;
    *deadline = *deadline > deadline_unix ? deadline_unix : *deadline;
    return true;
}

idem_code idem_client_call(idem_client *c, const idem_request *req, idem_result *out)
{
    const char *caller = req->caller != NULL ? req->caller : c->caller;
    uint32_t total_ms = req->deadline_ms ? req->deadline_ms : c->opts.deadline_ms;
    uint64_t end = idem__mono_ms() + total_ms, deadline_unix = idem__now_ms() + total_ms;
    idem_key_source source;
    idem_code code;

    memset(out, 0, sizeof(*out));
    code = req->method == NULL
               ? idem__err(IDEM_INVALID_ARGUMENT, "method is required")
               : idem__client_fix_key(req, c->opts.never_generate_key, out->key, &source);
    if (code != IDEM_OK) {
        out->message = idem__strdup(idem_errmsg());
        return out->code = code;
    }
    /* the field carries the key unless the caller's is in metadata (sent as it is) */
    const char *field = source == IDEM_KEY_METADATA ? "" : out->key;
    bool keyed = out->key[0] != '\0' || (req->token != NULL && req->token[0] != '\0');
    reply rep = {.msg = NULL, .resp = NULL};
    for (uint32_t attempt = 1;; attempt++) {
        uint32_t timeout;
        uint64_t attempt_deadline;
        nng_msg *msg = NULL;
        bool sent;
        if (!attempt_bounds(c, end, deadline_unix, &timeout, &attempt_deadline)) {
            code = idem__err(IDEM_DEADLINE_EXCEEDED, "call deadline of %u ms passed", total_ms);
            break;
        }
        if ((code = idem__client_build_msg(c, req, caller, field, source == IDEM_KEY_GENERATED,
                                           attempt, attempt_deadline, deadline_unix, &msg)) !=
            IDEM_OK) {
            break;
        }
        out->attempts = attempt;
        code = attempt_once(c, msg, timeout, &rep, &sent);
        const Idem__V1__Response *resp = code == IDEM_OK ? rep.resp : NULL;
        code = resp != NULL ? (idem_code)resp->code : code;
        uint32_t hint = retry_after_hint(resp);
        if (attempt >= c->opts.retry.max_attempts || !may_resend(keyed, code, resp, sent, hint) ||
            !backoff_wait(c, attempt, hint, end)) {
            code = resp != NULL ? call_result(out, &rep, resp, code) : code;
            break;
        }
        reply_free(&rep);
    }
    if (out->message == NULL && code != IDEM_OK) {
        out->message = idem__strdup(idem_errmsg());
    }
    out->code = code;
    return code;
}

idem_code idem_client_issue_token(idem_client *c, const char *caller, char *buf, size_t cap,
                                  uint64_t *expires_unix_ms)
{
    idem_request req = {.method = "idem.Token/Issue", .caller = caller};
    idem_result res;
    idem_code code = idem_client_call(c, &req, &res);
    if (code == IDEM_OK) {
        Idem__V1__IssueTokenResponse *t =
            idem__v1__issue_token_response__unpack(NULL, res.payload_len, res.payload);
        if (t == NULL) {
            code = idem__err(IDEM_DATA_LOSS, "token reply does not decode");
        } else if (strlen(t->token) + 1 > cap) {
            code = idem__err(IDEM_INVALID_ARGUMENT, "token buffer too small");
        } else {
            strcpy(buf, t->token);
            if (expires_unix_ms != NULL) {
                *expires_unix_ms = t->expires_unix_ms;
            }
        }
        if (t != NULL) {
            idem__v1__issue_token_response__free_unpacked(t, NULL);
        }
    } else {
        idem__err(code, "issue token: %s", res.message ? res.message : "");
    }
    idem_result_clear(&res);
    return code;
}

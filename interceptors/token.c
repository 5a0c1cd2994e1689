/* token: one-time submit tokens.
 *
 * idem.Token/Issue returns 128 random bits (getrandom) in base64url, stored with the
 * caller as scope and an expiry. A method registered IDEM_METHOD_TOKEN_REQUIRED needs
 * Request.token; the token becomes the idempotency key unless the request names one (a
 * business key or an explicit key: two tokens for one out_trade_no are still one
 * order), and result_cache consumes it in the same write transaction as the claim. So
 * the first call uses the token up, and a retry with the same token finds the record
 * and replays the first result. */
#include <stdio.h>
#include <string.h>

#include "builtins.h"
#include "store.h"

#define TOKEN_BYTES 16

idem_code idem__token_issue_handler(idem_call *call, void *arg)
{
    const idem_token_cfg *cfg = arg;
    uint8_t rnd[TOKEN_BYTES];
    char token[2 * TOKEN_BYTES + 1];
    if (!idem__random(rnd, sizeof(rnd))) {
        return idem_call_fail(call, IDEM_INTERNAL, "getrandom failed");
    }
    idem__base64url(token, rnd, sizeof(rnd));
    uint64_t now = idem__rt_now_ms(call->rt), expires = now + cfg->ttl_ms;
    idem_code code =
        idem__store_token_put_at(cfg->store, token, idem_call_caller(call), expires, now);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "token store: %s", idem_errmsg());
    }
    Idem__V1__IssueTokenResponse resp = IDEM__V1__ISSUE_TOKEN_RESPONSE__INIT;
    uint8_t buf[64];
    resp.token = token;
    resp.expires_unix_ms = expires;
    size_t n = idem__v1__issue_token_response__pack(&resp, buf);
    return idem_call_reply(call, IDEM_OK, buf, n);
}

idem_code idem__token_interceptor(idem_call *call, idem_next next, void *arg)
{
    const idem_token_cfg *cfg = arg;
    const idem_method *m = call->method;
    if (m == NULL || !(m->opts.flags & IDEM_METHOD_TOKEN_REQUIRED)) {
        return idem_call_next(call, next);
    }
    const char *token = idem_call_token(call);
    size_t len = strlen(token);
    if (len == 0) {
        return idem__reject(call, IDEM_REASON_TOKEN, IDEM_FAILED_PRECONDITION,
                            "method %s requires a token from " IDEM_TOKEN_ISSUE_METHOD, m->name);
    }
    if (call->key_source == IDEM_KEY_NONE || call->key_source == IDEM_KEY_GENERATED) {
        memcpy(call->key, token, len + 1); /* codec bounds tokens below IDEM_MAX_KEY */
        call->key_source = IDEM_KEY_TOKEN;
    }
    if (cfg->consume_with_claim) {
        call->token_to_consume = token;
        return idem_call_next(call, next);
    }
    /* No result cache to consume it with the claim: consume it now, on its own. */
    if (call->fast_only) {
        return idem__call_defer(call, next.pos - 1); /* a write: a worker resumes here */
    }
    idem_code code = idem_store_token_consume(cfg->store, token, idem_call_caller(call),
                                              idem__rt_now_ms(call->rt));
    if (code != IDEM_OK) {
        return idem__reject(call, IDEM_REASON_TOKEN, code, "%s", idem_errmsg());
    }
    return idem_call_next(call, next);
}

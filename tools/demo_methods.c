/* idemrpc-demo's methods (registered by demo_register):
 *   demo.Counter/Add     payload "N" → new total; cached, key required; metadata "fence"
 *   demo.Counter/Get     → total; plain (read-only: nothing to dedupe)
 *   demo.Order/Submit    → "ORD-000001"...; needs a token from idem.Token/Issue
 *   demo.Pay/Notify      payload "out_trade_no=T&amount=N&sign=S" → adds N to the total;
 *                        key = out_trade_no, fingerprint = out_trade_no + amount (a
 *                        re-signed redelivery replays, another amount is key reuse) */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "demo.h"

/* --flaky N: the first N executions (of any method) fail transiently. */
static bool flaky_now(demo *d)
{
    pthread_mutex_lock(&d->mu);
    bool fail = d->flaky > 0;
    d->flaky -= fail;
    pthread_mutex_unlock(&d->mu);
    return fail;
}

static bool parse_ll(const void *p, size_t n, long long *out)
{
    char buf[32];
    if (n == 0 || n >= sizeof(buf)) {
        return false;
    }
    memcpy(buf, p, n);
    buf[n] = '\0';
    char *end;
    errno = 0;
    *out = strtoll(buf, &end, 10);
    return errno == 0 && *end == '\0';
}

static idem_code reply_number(idem_call *call, long long v)
{
    char out[32];
    int n = snprintf(out, sizeof(out), "%lld", v);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static idem_code add_to_total(idem_call *call, demo *d, long long delta)
{
    char fence[24];
    if (flaky_now(d)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "flaky: try again");
    }
    if (d->delay_ms > 0) {
        struct timespec ts = {d->delay_ms / 1000, (d->delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&d->mu);
    long long total = d->total += delta;
    pthread_mutex_unlock(&d->mu);
    snprintf(fence, sizeof(fence), "%" PRIu64, idem_call_fence(call));
    idem_call_set_response_metadata(call, "fence", fence);
    return reply_number(call, total);
}

static idem_code counter_add(idem_call *call, void *arg)
{
    size_t n;
    const void *p = idem_call_payload(call, &n);
    long long delta;
    if (!parse_ll(p, n, &delta)) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload must be a decimal integer");
    }
    return add_to_total(call, arg, delta);
}

/* The value of field name in an "a=1&b=2" payload into out (cap bytes); false if absent. */
static bool form_field(const idem_call *call, const char *name, char *out, size_t cap)
{
    size_t n, nl = strlen(name);
    const char *p = idem_call_payload(call, &n), *end = p + n;
    while (p < end) {
        const char *amp = memchr(p, '&', (size_t)(end - p));
        const char *stop = amp != NULL ? amp : end;
        if ((size_t)(stop - p) > nl && memcmp(p, name, nl) == 0 && p[nl] == '=') {
            size_t vl = (size_t)(stop - p) - nl - 1;
            if (vl == 0 || vl >= cap) {
                return false;
            }
            memcpy(out, p + nl + 1, vl);
            out[vl] = '\0';
            return true;
        }
        p = stop + 1;
    }
    return false;
}

static bool notify_key(const idem_call *call, char *buf, size_t cap, void *arg)
{
    (void)arg;
    return form_field(call, "out_trade_no", buf, cap);
}

/* out_trade_no and amount make two notifications the same; sign and the rest do not. */
static bool notify_fingerprint(const idem_call *call, void *buf, size_t cap, size_t *len, void *arg)
{
    (void)arg;
    char trade_no[256], amount[32];
    if (!form_field(call, "out_trade_no", trade_no, sizeof(trade_no)) ||
        !form_field(call, "amount", amount, sizeof(amount))) {
        return false;
    }
    int n = snprintf(buf, cap, "%s|%s", trade_no, amount);
    *len = (size_t)n;
    return n > 0 && (size_t)n < cap;
}

static idem_code pay_notify(idem_call *call, void *arg)
{
    char amount[32];
    long long cents;
    if (!form_field(call, "amount", amount, sizeof(amount)) ||
        !parse_ll(amount, strlen(amount), &cents)) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "amount must be a decimal integer");
    }
    return add_to_total(call, arg, cents);
}

static idem_code counter_get(idem_call *call, void *arg)
{
    demo *d = arg;
    pthread_mutex_lock(&d->mu);
    long long total = d->total;
    pthread_mutex_unlock(&d->mu);
    return reply_number(call, total);
}

static idem_code order_submit(idem_call *call, void *arg)
{
    demo *d = arg;
    char out[32];
    if (flaky_now(d)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "flaky: try again");
    }
    pthread_mutex_lock(&d->mu);
    unsigned long no = ++d->orders;
    pthread_mutex_unlock(&d->mu);
    int n = snprintf(out, sizeof(out), "ORD-%06lu", no);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

idem_code demo_register(idem_server *srv, demo *d)
{
    idem_method_opts add = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts submit = {.flags = IDEM_METHOD_TOKEN_REQUIRED | IDEM_METHOD_DEBOUNCE};
    idem_method_opts notify = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED,
                               .extractor = notify_key,
                               .fingerprint = notify_fingerprint};
    idem_code code;
    if ((code = idem_server_register(srv, "demo.Counter/Add", counter_add, d, &add)) != IDEM_OK ||
        (code = idem_server_register(srv, "demo.Counter/Get", counter_get, d, NULL)) != IDEM_OK ||
        (code = idem_server_register(srv, "demo.Order/Submit", order_submit, d, &submit)) !=
            IDEM_OK) {
        return code;
    }
    return idem_server_register(srv, "demo.Pay/Notify", pay_notify, d, &notify);
}

/* "k=v&k=v" payloads: the example's wire format, readable in logs and with idemrpc-call.
 * No percent-decoding: values are restricted to a safe alphabet instead. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "payments.h"

static bool value_char_ok(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == ':' || c == '-';
}

bool pay_form_get(const void *p, size_t n, const char *name, char *out, size_t cap)
{
    const char *s = p, *end = s + n;
    size_t ln = strlen(name);
    while (s < end) {
        const char *amp = memchr(s, '&', (size_t)(end - s));
        const char *pair_end = amp != NULL ? amp : end;
        if ((size_t)(pair_end - s) > ln && memcmp(s, name, ln) == 0 && s[ln] == '=') {
            const char *v = s + ln + 1;
            size_t lv = (size_t)(pair_end - v);
            if (lv == 0 || lv >= cap) {
                return false;
            }
            for (size_t i = 0; i < lv; i++) {
                if (!value_char_ok(v[i])) {
                    return false;
                }
            }
            memcpy(out, v, lv);
            out[lv] = '\0';
            return true;
        }
        s = pair_end + 1;
    }
    return false;
}

bool pay_form_amount(const void *p, size_t n, const char *name, long long *out)
{
    char buf[16];
    long long v = 0;
    if (!pay_form_get(p, n, name, buf, sizeof(buf))) {
        return false;
    }
    for (const char *c = buf; *c != '\0'; c++) {
        if (*c < '0' || *c > '9' || v > PAY_MAX_AMOUNT) {
            return false;
        }
        v = v * 10 + (*c - '0');
    }
    if (v <= 0 || v > PAY_MAX_AMOUNT) {
        return false;
    }
    *out = v;
    return true;
}

idem_code pay_reply(idem_call *call, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(buf)) {
        return idem_call_fail(call, IDEM_INTERNAL, "reply too long");
    }
    return idem_call_reply(call, IDEM_OK, buf, (size_t)n);
}

/* idem_errmsg() belongs to the library; the example's own failures (its SQL) keep their
 * detail here, per thread like idem_errmsg(), until pay_errmsg() reports it. */
static _Thread_local char own_error[512];

void pay_set_errmsg(const char *fmt, ...)
{
    va_list ap;
    own_error[0] = '\0';
    if (fmt != NULL) {
        va_start(ap, fmt);
        vsnprintf(own_error, sizeof(own_error), fmt, ap);
        va_end(ap);
    }
}

const char *pay_errmsg(void)
{
    static _Thread_local char reported[sizeof(own_error)];
    if (own_error[0] == '\0') {
        return idem_errmsg();
    }
    memcpy(reported, own_error, sizeof(reported));
    own_error[0] = '\0';
    return reported;
}

idem_code pay_rollback(idem_call *call, idem_code code, const char *what)
{
    idem_code answer = (IDEM_CODE_BIT(code) & IDEM_TRANSIENT_CODES) ? code : IDEM_INTERNAL;
    return idem_call_fail(call, answer, "%s: %s (%s), rolled back", what, idem_code_name(code),
                          pay_errmsg());
}

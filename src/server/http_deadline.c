/* An HTTP request's deadline: the Grpc-Timeout header, as gRPC sends it over HTTP/2
 * ("TimeoutValue TimeoutUnit": at most 8 ASCII digits, then H, M, S, m, u or n).
 *
 * Why this header: a relative duration does not depend on the caller's clock agreeing
 * with ours (an absolute time would, and skew would cut or stretch every call); gRPC
 * clients, grpc-gateway and Envoy already send and propagate it; and its grammar is
 * short, exact and bounded (8 digits), so a bad value is easy to refuse. The duration
 * is the caller's whole remaining time: the request becomes one attempt whose deadline
 * and whole-call deadline are both now + the duration, and the handler's downstream
 * calls inherit it less a margin (downstream.h). */
#include <string.h>

#include "http_deadline.h"

static const char bad[] = IDEM_HTTP_TIMEOUT_HEADER
    ": expected 1..8 digits and a unit (H, M, S, m, u or n), e.g. 10S or 500m";
static const char too_long[] = IDEM_HTTP_TIMEOUT_HEADER ": at most 24 hours";

/* The unit's milliseconds as num/den. */
static bool unit_ms(char u, uint64_t *num, uint64_t *den)
{
    static const struct {
        char u;
        uint64_t num, den;
    } units[] = {{'H', 3600000, 1}, {'M', 60000, 1}, {'S', 1000, 1},
                 {'m', 1, 1},       {'u', 1, 1000},  {'n', 1, 1000000}};
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        if (units[i].u == u) {
            *num = units[i].num;
            *den = units[i].den;
            return true;
        }
    }
    return false;
}

bool idem__http_deadline(const char *v, uint64_t now_ms, uint64_t *attempt, uint64_t *call,
                         const char **err)
{
    uint64_t value = 0, num, den;
    size_t digits = v != NULL ? strspn(v, "0123456789") : 0;
    if (v == NULL) {
        return true; /* none: the call has no deadline of its own */
    }
    if (digits == 0 || digits > 8 || strlen(v) != digits + 1 || !unit_ms(v[digits], &num, &den)) {
        *err = bad;
        return false;
    }
    for (size_t i = 0; i < digits; i++) {
        value = value * 10 + (uint64_t)(v[i] - '0');
    }
    uint64_t ms = value * num / den; /* 99999999 H fits: < 2^49 */
    if (ms > IDEM_HTTP_TIMEOUT_MAX_MS) {
        *err = too_long;
        return false;
    }
    *attempt = *call = now_ms + ms;
    return true;
}

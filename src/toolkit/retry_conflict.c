/* idem_retry_on_conflict: re-run an optimistic update while it loses version races.
 *
 * A loop with a hard attempt cap (never recursion, never unbounded): conflicts under
 * contention are normal, endless conflicts are an incident, which the exhaustion hook
 * reports. The backoff is the client's schedule (idem_backoff_ms) with its own numbers:
 * milliseconds, doubling, ±50 % jitter so that colliding writers spread out. */
#include <errno.h>
#include <time.h>

#include "internal.h"

#include "idemrpc/client.h"
#include "idemrpc/toolkit.h"

#define DEFAULT_ATTEMPTS 5
#define DEFAULT_BASE_MS 2
#define DEFAULT_MAX_MS 100

idem_code idem_retry_on_conflict(const idem_conflict_policy *p, idem_attempt_fn fn, void *arg)
{
    idem_conflict_policy d = {0};
    if (p != NULL) {
        d = *p;
    }
    uint32_t max = d.max_attempts ? d.max_attempts : DEFAULT_ATTEMPTS;
    max = max < IDEM_CONFLICT_MAX_ATTEMPTS ? max : IDEM_CONFLICT_MAX_ATTEMPTS;
    idem_retry_policy schedule = {.period_ms = d.base_ms ? d.base_ms : DEFAULT_BASE_MS,
                                  .max_period_ms = d.max_ms ? d.max_ms : DEFAULT_MAX_MS,
                                  .multiplier = 2.0,
                                  .jitter = 0.5};
    if (fn == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "retry on conflict needs a function");
    }
    for (uint32_t attempt = 1;; attempt++) {
        idem_code code = fn(arg, attempt);
        if (code != IDEM_ABORTED) {
            return code;
        }
        if (attempt == max) {
            break;
        }
        idem__sleep_ms(idem_backoff_ms(&schedule, attempt, idem__random_unit()));
    }
    if (d.on_exhausted != NULL) {
        d.on_exhausted(arg, max, d.hook_arg);
    }
    return idem__err(IDEM_ABORTED, "version conflict: gave up after %u attempts", max);
}

/* Status codes (idem_code = wire Code) and the per-thread error detail. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static const char *const code_names[IDEM_CODE_COUNT] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

const char *idem_code_name(int code)
{
    if (code < 0 || code >= IDEM_CODE_COUNT) {
        return "UNKNOWN_CODE";
    }
    return code_names[code];
}

bool idem_code_from_name(const char *name, idem_code *out)
{
    for (int i = 0; i < IDEM_CODE_COUNT; i++) {
        if (name != NULL && strcmp(name, code_names[i]) == 0) {
            *out = (idem_code)i;
            return true;
        }
    }
    return false;
}

/* Per-thread like errno: not shared state, so no lock. */
static _Thread_local char errmsg[512];

const char *idem_errmsg(void)
{
    return errmsg;
}

void idem__err_clear(void)
{
    errmsg[0] = '\0';
}

void idem__err_keep(idem_errkeep *k)
{
    snprintf(k->msg, sizeof(k->msg), "%s", errmsg);
}

idem_code idem__err_put(const idem_errkeep *k, idem_code code)
{
    return idem__err(code, "%s", k->msg);
}

/* Formats into a buffer of its own first: an argument may be idem_errmsg() itself (a
 * cause wrapped in its context), which vsnprintf must not read while writing over it. */
idem_code idem__err(idem_code code, const char *fmt, ...)
{
    char msg[sizeof(errmsg)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    memcpy(errmsg, msg, strlen(msg) + 1);
    return code;
}

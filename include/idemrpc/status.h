/* idemrpc status codes: the one error vocabulary of the library. The numbers are the
 * gRPC status codes and equal the wire enum idem.v1.Code. */
#ifndef IDEMRPC_STATUS_H
#define IDEMRPC_STATUS_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define IDEM_API __attribute__((visibility("default")))
#else
#define IDEM_API
#endif

typedef enum idem_code {
    IDEM_OK = 0,
    IDEM_CANCELLED = 1,
    IDEM_UNKNOWN = 2,
    IDEM_INVALID_ARGUMENT = 3,
    IDEM_DEADLINE_EXCEEDED = 4,
    IDEM_NOT_FOUND = 5,
    IDEM_ALREADY_EXISTS = 6,
    IDEM_PERMISSION_DENIED = 7,
    IDEM_RESOURCE_EXHAUSTED = 8,
    IDEM_FAILED_PRECONDITION = 9,
    IDEM_ABORTED = 10,
    IDEM_OUT_OF_RANGE = 11,
    IDEM_UNIMPLEMENTED = 12,
    IDEM_INTERNAL = 13,
    IDEM_UNAVAILABLE = 14,
    IDEM_DATA_LOSS = 15,
    IDEM_UNAUTHENTICATED = 16,
} idem_code;

#define IDEM_CODE_COUNT 17

/* "OK", "INVALID_ARGUMENT", ...; "UNKNOWN_CODE" for values outside the enum. */
IDEM_API const char *idem_code_name(int code);

/* Parses a name as returned by idem_code_name() (case-sensitive). Returns false when
 * the name is not a code. */
IDEM_API bool idem_code_from_name(const char *name, idem_code *out);

/* Detail of the last error returned by an idemrpc function on this thread (like
 * dlerror()); "" when none. Valid until the next idemrpc call on the thread. Read it
 * right after a call that returned an error: the server's setup calls (create,
 * register, use, listen) clear it when they succeed, other calls that succeed may
 * leave an earlier detail in place. idem_client_call: the server's message is in
 * idem_result.message. */
IDEM_API const char *idem_errmsg(void);

/* A code as a bit for the idem_code masks in method options. */
#define IDEM_CODE_BIT(c) (1u << (unsigned)(c))

/* Codes whose result is not stored: the claim is released and a retry runs again. */
#define IDEM_TRANSIENT_CODES                                                                       \
    (IDEM_CODE_BIT(IDEM_UNAVAILABLE) | IDEM_CODE_BIT(IDEM_DEADLINE_EXCEEDED) |                     \
     IDEM_CODE_BIT(IDEM_INTERNAL) | IDEM_CODE_BIT(IDEM_RESOURCE_EXHAUSTED) |                       \
     IDEM_CODE_BIT(IDEM_ABORTED) | IDEM_CODE_BIT(IDEM_CANCELLED) | IDEM_CODE_BIT(IDEM_UNKNOWN))

#ifdef __cplusplus
}
#endif
#endif

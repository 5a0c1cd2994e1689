/* The whole-call deadline an HTTP request carries (http_deadline.c). */
#ifndef IDEMRPC_HTTP_DEADLINE_H
#define IDEMRPC_HTTP_DEADLINE_H

#include <stdbool.h>
#include <stdint.h>


#define IDEM_HTTP_TIMEOUT_HEADER "Grpc-Timeout"
#define IDEM_HTTP_TIMEOUT_MAX_MS (24ull * 3600 * 1000) /* a day: more is refused (400) */

/* Sets *attempt and *call (unix ms) from v, the request's one Grpc-Timeout value (NULL:
 * absent, and they stay 0): now_ms plus its duration. false, with *err naming the
 * header, for a value that is not 1..8 digits and one unit of H M S m u n, or a
 * duration over IDEM_HTTP_TIMEOUT_MAX_MS. (A repeated header is refused before.) */
bool idem__http_deadline(const char *v, uint64_t now_ms, uint64_t *attempt, uint64_t *call,
                         const char **err);

#endif

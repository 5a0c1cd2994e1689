/* The whole-call deadline an HTTP request carries (http_deadline.c). */
#ifndef IDEMRPC_HTTP_DEADLINE_H
#define IDEMRPC_HTTP_DEADLINE_H

#include <stdbool.h>
#include <stdint.h>

#include <nng/nng.h>
#include <nng/supplemental/http/http.h>

#define IDEM_HTTP_TIMEOUT_HEADER "Grpc-Timeout"
#define IDEM_HTTP_TIMEOUT_MAX_MS (24ull * 3600 * 1000) /* a day: more is refused (400) */

/* Sets *attempt and *call (unix ms) from the request's Grpc-Timeout header, now_ms plus
 * its duration; leaves them 0 when it is absent. false, with *err naming the header,
 * for a value that is not 1..8 digits and one unit of H M S m u n, a repeated header,
 * or a duration over IDEM_HTTP_TIMEOUT_MAX_MS. */
bool idem__http_deadline(nng_http_req *req, uint64_t now_ms, uint64_t *attempt, uint64_t *call,
                         const char **err);

#endif

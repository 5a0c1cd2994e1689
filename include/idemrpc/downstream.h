/* Calling other services from inside a handler: one effect per hop.
 *
 * A handler that calls another service must send the SAME key downstream on every
 * retry of its own call, or each upstream retry becomes a second downstream effect (a
 * second charge). idem_call_downstream() derives that key from the call itself:
 *
 *   key = "d-" hex(SHA-256(len-prefixed caller, method, effective key, step))
 *
 * so every attempt, every re-run after a crash or a lease takeover, on any instance,
 * sends the same downstream key for the same step. The downstream caller is this
 * service (the client's own caller and signing identity), never the upstream caller.
 * The call also inherits the upstream deadline (minus a margin, so that the answer
 * still gets back in time), the request id, and W3C trace context (metadata
 * traceparent / tracestate), so one logical request can be followed across services
 * in the logfmt lines (request_id=..., trace_id=...).
 *
 * For downstreams that are not idemrpc services (an HTTP payment API with its own
 * Idempotency-Key header), idem_call_derive_key() gives the same key to send there. */
#ifndef IDEMRPC_DOWNSTREAM_H
#define IDEMRPC_DOWNSTREAM_H

#include "chain.h"
#include "client.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_MAX_STEP 64        /* bytes of a step name: [A-Za-z0-9._-] */
#define IDEM_DERIVED_KEY_LEN 66 /* "d-" + 64 hex digits */
#define IDEM_HOP_MARGIN_MS 50   /* kept back from the upstream deadline (at most 10 % of it) */

/* The downstream key of `step` of this call into out. IDEM_FAILED_PRECONDITION when the
 * call has no idempotency key (nothing stable to derive from: make the method
 * KEY_REQUIRED); IDEM_INVALID_ARGUMENT for a step name that is empty, too long or has
 * other characters. */
IDEM_API idem_code idem_call_derive_key(const idem_call *call, const char *step,
                                        char out[IDEM_DERIVED_KEY_LEN + 1]);

/* idem_client_call() as step `step` of call: req's idempotency_key is the derived key
 * (req must not set one, nor a caller: INVALID_ARGUMENT), its deadline the smaller of
 * req's (or the client's) and the time the upstream call has left minus the margin
 * (DEADLINE_EXCEEDED without sending when nothing is left), its request id the
 * upstream's unless req sets one, and the upstream's traceparent / tracestate metadata
 * are added unless req sets them. The client retries as usual, always with that key. */
IDEM_API idem_code idem_call_downstream(idem_call *call, idem_client *client, const char *step,
                                        const idem_request *req, idem_result *out);

#ifdef __cplusplus
}
#endif
#endif

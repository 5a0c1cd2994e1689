/* The client's state, shared by its files: client.c (the socket, its contexts, the
 * retrying call) and envelope.c (the request envelope and the result). */
#ifndef IDEMRPC_CLIENT_INTERNAL_H
#define IDEMRPC_CLIENT_INTERNAL_H

#include <nng/nng.h>
#include <pthread.h>

#include "idemrpc.pb-c.h"
#include "internal.h"

#define CTX_CACHE 64 /* idle (context, aio) pairs kept for reuse */

/* One nng context with its aio: one outstanding request at a time. */
typedef struct ctx_slot {
    nng_ctx ctx;
    nng_aio *aio;
    struct ctx_slot *next;
} ctx_slot;

struct idem_client {
    nng_socket sock;
    idem_client_opts opts;
    char *caller, *secret, *signer; /* copies; secret and signer NULL when unsigned */
    pthread_mutex_t mu;             /* guards idle */
    ctx_slot *idle;
    size_t n_idle;
};

/* Encodes the request for one attempt into a new nng message. */
idem_code idem__client_build_msg(const idem_client *c, const idem_request *r, const char *caller,
                                 const char *key, bool key_generated, uint32_t attempt,
                                 uint64_t deadline, uint64_t call_deadline, nng_msg **out);
/* Copies a response into out (IDEM_RESOURCE_EXHAUSTED when a copy fails: clear out). */
idem_code idem__client_result_fill(idem_result *out, const Idem__V1__Response *r);

/* The client's whole-call deadline for requests that set none (after defaults). */
uint32_t idem__client_deadline_ms(const idem_client *c);

#endif

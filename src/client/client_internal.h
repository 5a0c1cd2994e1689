/* The client's state, shared by its files: client.c (the socket, its contexts, the
 * retrying call), dial.c (its dialers) and envelope.c (the call's key, the request
 * envelope and the result). */
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

/* Dials url without waiting (the server may start later); tls+ URLs over TLS (dial.c). */
idem_code idem__client_dial(nng_socket sock, const char *url, const idem_client_opts *o);

/* The value of the request's metadata entry name, or NULL. */
const char *idem__client_request_meta(const idem_request *req, const char *name);
/* The call's key into key, fixed once for every attempt as the server will resolve it
 * (idem__request_key): the caller's, from the field or from metadata (both sent as they
 * are), else none when a token stands in for it (or never_generate), else a time-ordered
 * one for the field (unix ms and 80 random bits). *source says which: IDEM_KEY_FIELD,
 * IDEM_KEY_METADATA, IDEM_KEY_GENERATED or IDEM_KEY_NONE. INVALID_ARGUMENT when the
 * field and metadata name two different keys, or the key is too long. */
idem_code idem__client_fix_key(const idem_request *req, bool never_generate,
                               char key[IDEM_CLIENT_KEY_MAX + 1], idem_key_source *source);
/* Encodes the request for one attempt into a new nng message. */
idem_code idem__client_build_msg(const idem_client *c, const idem_request *r, const char *caller,
                                 const char *key, bool key_generated, uint32_t attempt,
                                 uint64_t deadline, uint64_t call_deadline, nng_msg **out);
/* Copies a response into out (IDEM_RESOURCE_EXHAUSTED when a copy fails: clear out). */
idem_code idem__client_result_fill(idem_result *out, const Idem__V1__Response *r);

/* The client's whole-call deadline for requests that set none (after defaults). */
uint32_t idem__client_deadline_ms(const idem_client *c);
/* Gives every field of o left 0 its documented default (client.h). */
void idem__client_opts_defaults(idem_client_opts *o);

#endif

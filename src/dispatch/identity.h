/* Who is calling (identity.c): the step before the chain that decides the caller which
 * scopes keys and tokens. README "Security" states the threat model. */
#ifndef IDEMRPC_IDENTITY_H
#define IDEMRPC_IDENTITY_H

#include "call.h"

/* What a front knows about the sender of one frame, from the transport, not from the
 * frame: the kernel's peer credentials of an ipc:// connection. */
typedef struct idem_peer {
    bool has_uid;
    uint64_t uid;
    /* The caller of a TLS listener whose client certificate verified; "" otherwise. */
    char tls_caller[IDEM_MAX_CALLER + 1];
    /* The frame came through a TLS listener, but the pipe's verification could not be
     * read (or said no): the call is refused, never taken as self-declared. */
    bool transport_unverified;
    /* Not a transport: the re-driver (src/server/redriver.c) runs a call again from its
     * stored request, as the caller its first run resolved (taken as is, verified or
     * not as it was then), with a new deadline. */
    bool redriven;
    bool redriven_verified;
    char redriven_caller[IDEM_MAX_CALLER + 1];
    uint64_t redriven_deadline_ms;
} idem_peer;

/* The server's identity configuration, copied from idem_server_opts (the caller's
 * arrays are not retained); read-only after creation. */
typedef struct idem_identity idem_identity;

/* Refuses out-of-bound secrets, empty or over-long names, duplicates and a window over
 * a day with INVALID_ARGUMENT. With nothing configured, callers stay self-declared. */
idem_code idem__identity_create(idem_identity **out, const idem_server_opts *opts);
/* A TLS listener's caller: from now on it is never accepted merely declared. */
idem_code idem__identity_add_tls_caller(idem_identity *id, const char *caller);
void idem__identity_destroy(idem_identity *id);

/* Sets call->caller and call->caller_verified, in this order of trust:
 *   1. the transport: a mapped ipc peer uid or a TLS listener's verified client (peer
 *      may be NULL);
 *   2. a valid idem-signature (its caller; a proxy's signature vouches for the caller it
 *      names);
 *   3. Request.caller as sent, unverified.
 * A present but invalid signature, and no verified caller when one is required, are
 * UNAUTHENTICATED; a verified caller and a different Request.caller are
 * PERMISSION_DENIED. On failure the call is answered (reason "identity") and nothing
 * else may run. id NULL: step 3 only. */
idem_code idem__identity_resolve(const idem_identity *id, const idem_peer *peer, idem_call *call);

#endif

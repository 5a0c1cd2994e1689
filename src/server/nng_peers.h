/* What the transport says about each open pipe of the nng front (nng_peers.c): read
 * once when the pipe is added, not per message. */
#ifndef IDEMRPC_NNG_PEERS_H
#define IDEMRPC_NNG_PEERS_H

#include <pthread.h>
#include <stdint.h>

#include "identity.h"

#define IDEM_PIPE_PEERS_MAX 4096    /* entries; further pipes are read per message */
#define IDEM_PIPE_PEERS_BUCKETS 256 /* a power of two */
#define IDEM_PIPE_PEERS_GONE 64     /* removals of pipes not (yet) added, remembered */

typedef struct idem_pipe_peer idem_pipe_peer;

/* Guarded by mu: pipe events and messages arrive on nng's threads at once. */
typedef struct idem_pipe_peers {
    pthread_mutex_t mu;
    idem_pipe_peer *buckets[IDEM_PIPE_PEERS_BUCKETS];
    size_t count;
    uint32_t gone[IDEM_PIPE_PEERS_GONE];
    size_t gone_next;
} idem_pipe_peers;

void idem__pipe_peers_init(idem_pipe_peers *c);
/* Frees every entry. Only once no callback can run (after nng_close). */
void idem__pipe_peers_fini(idem_pipe_peers *c);
/* Remembers peer (what the transport said of pipe id: uid, TLS caller, unverified) as
 * pipe id's, replacing an entry of the same id. Nothing when the cache is full, out of
 * memory, or the pipe was removed before (its removal overtook this add). */
void idem__pipe_peers_add(idem_pipe_peers *c, uint32_t id, const idem_peer *peer);
/* Pipe id's peer, as added, into *peer; false when it has no entry. */
bool idem__pipe_peers_get(idem_pipe_peers *c, uint32_t id, idem_peer *peer);
void idem__pipe_peers_remove(idem_pipe_peers *c, uint32_t id);
size_t idem__pipe_peers_count(idem_pipe_peers *c);

#endif

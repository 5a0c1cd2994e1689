/* The nng front's cache of each pipe's transport identity (nng_peers.h).
 *
 * Reading it per message cost a getsockopt(SO_PEERCRED) for the ipc peer uid and a
 * pipe lookup for the TLS verification, yet neither changes while the pipe is open.
 * The front fills an entry on NNG_PIPE_EV_ADD_PRE and drops it on REM_POST. Invariants
 * (nng 1.5.2, src/core/socket.c, pipe.c):
 *   - ADD_PRE runs before the protocol starts the pipe, so before its first message;
 *     an entry under a reused id is replaced there before any message of the new pipe.
 *   - REM_POST runs only for a pipe whose ADD_PRE ran, but may overtake the end of
 *     the ADD_PRE callback (the pipe closes meanwhile): a removal of an id without an
 *     entry is remembered (gone[]) and the late add skips it. Should that ring wrap
 *     first, the entry stays until its id is reused: it costs a slot, never a wrong
 *     identity.
 *   - A message whose pipe has no entry (cache full, out of memory) is read as before,
 *     per message: the cache only saves work, never decides. */
#include <stdlib.h>
#include <string.h>

#include "nng_peers.h"

struct idem_pipe_peer {
    idem_pipe_peer *next;
    uint32_t id;
    idem_peer peer;
};

static idem_pipe_peer **bucket(idem_pipe_peers *c, uint32_t id)
{
    return &c->buckets[(id * 2654435761u) >> 24 & (IDEM_PIPE_PEERS_BUCKETS - 1)];
}

/* The link that points at id's entry, or at the bucket's terminating NULL. */
static idem_pipe_peer **find(idem_pipe_peers *c, uint32_t id)
{
    idem_pipe_peer **pp = bucket(c, id);
    while (*pp != NULL && (*pp)->id != id) {
        pp = &(*pp)->next;
    }
    return pp;
}

void idem__pipe_peers_init(idem_pipe_peers *c)
{
    memset(c, 0, sizeof(*c));
    pthread_mutex_init(&c->mu, NULL);
}

void idem__pipe_peers_fini(idem_pipe_peers *c)
{
    for (size_t i = 0; i < IDEM_PIPE_PEERS_BUCKETS; i++) {
        while (c->buckets[i] != NULL) {
            idem_pipe_peer *e = c->buckets[i];
            c->buckets[i] = e->next;
            free(e);
        }
    }
    c->count = 0;
    pthread_mutex_destroy(&c->mu);
}

/* True (and forgotten) when id's removal came before its add. Under mu. */
static bool take_gone(idem_pipe_peers *c, uint32_t id)
{
    for (size_t i = 0; i < IDEM_PIPE_PEERS_GONE; i++) {
        if (c->gone[i] == id) {
            c->gone[i] = 0;
            return true;
        }
    }
    return false;
}

void idem__pipe_peers_add(idem_pipe_peers *c, uint32_t id, const idem_peer *peer)
{
    idem_pipe_peer *fresh = malloc(sizeof(*fresh)); /* outside the lock */
    pthread_mutex_lock(&c->mu);
    idem_pipe_peer **pp = find(c, id), *e = *pp;
    if (take_gone(c, id) || (e == NULL && (c->count == IDEM_PIPE_PEERS_MAX || fresh == NULL))) {
        pthread_mutex_unlock(&c->mu);
        free(fresh);
        return;
    }
    if (e == NULL) {
        e = fresh;
        fresh = NULL;
        e->next = NULL;
        e->id = id;
        *pp = e;
        c->count++;
    }
    e->peer = *peer;
    pthread_mutex_unlock(&c->mu);
    free(fresh);
}

bool idem__pipe_peers_get(idem_pipe_peers *c, uint32_t id, idem_peer *peer)
{
    pthread_mutex_lock(&c->mu);
    idem_pipe_peer *e = *find(c, id);
    if (e != NULL) {
        *peer = e->peer;
    }
    pthread_mutex_unlock(&c->mu);
    return e != NULL;
}

void idem__pipe_peers_remove(idem_pipe_peers *c, uint32_t id)
{
    pthread_mutex_lock(&c->mu);
    idem_pipe_peer **pp = find(c, id), *e = *pp;
    if (e != NULL) {
        *pp = e->next;
        c->count--;
    } else {
        c->gone[c->gone_next++ % IDEM_PIPE_PEERS_GONE] = id;
    }
    pthread_mutex_unlock(&c->mu);
    free(e);
}

size_t idem__pipe_peers_count(idem_pipe_peers *c)
{
    pthread_mutex_lock(&c->mu);
    size_t n = c->count;
    pthread_mutex_unlock(&c->mu);
    return n;
}

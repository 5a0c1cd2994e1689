/* A bounded local cache of COMPLETED records in front of the PostgreSQL store's reads
 * (replay_cache.c), so that a replay on this instance needs no round trip.
 *
 * Why it may exist at all: a COMPLETED record does not change until it expires; the
 * only other way it goes is a forget (idem_store_delete, `idemctl delete`), on any
 * instance. A forget announces itself on PG_CHANNEL like a completion does, and every
 * announcement of a key's hash drops that hash's entries here. So after a forget
 * elsewhere this instance may still replay the old result until the announcement
 * arrives, and never longer than the entry's ttl (a lost announcement: the listening
 * connection was down, a pooler, no_notify). Bounded by entries and bytes, evicted
 * least recently used; an entry also ends at the record's own expiry. */
#ifndef IDEMRPC_STORE_PG_REPLAY_CACHE_H
#define IDEMRPC_STORE_PG_REPLAY_CACHE_H

#include "store.h"

#define PG_RCACHE_DEFAULT_BYTES ((size_t)16 << 20)
#define PG_RCACHE_DEFAULT_TTL_MS 5000u
#define PG_RCACHE_MAX_ENTRIES ((size_t)1 << 20)
#define PG_RCACHE_MAX_TTL_MS 3600000u

typedef struct pg_rcache pg_rcache;

typedef struct pg_rcache_stats {
    size_t entries, bytes;
    uint64_t hits, misses, drops;
} pg_rcache_stats;

/* NULL in *out when entries is 0 (off); bytes 0 and ttl_ms 0 take the defaults. */
idem_code idem__pg_rcache_create(pg_rcache **out, size_t entries, size_t bytes, uint32_t ttl_ms);
void idem__pg_rcache_destroy(pg_rcache *c);

/* What a read that missed the cache carries to its put: the announcements' generation
 * of its key's hash and when the read began (monotonic). */
typedef struct pg_rcache_miss {
    uint64_t gen;
    uint64_t read_ms;
} pg_rcache_miss;

/* A live entry for key into *rec (its response a malloc'd copy, rec->now_ms the
 * database clock as estimated from the read that filled it): true. Else false, with
 * *miss to pass to the put of the read that follows. c may be NULL. */
bool idem__pg_rcache_get(pg_rcache *c, const idem_key_ref *key, idem_record *rec,
                         pg_rcache_miss *miss);
/* Keeps a copy of rec when it is COMPLETED and unexpired and no announcement for its
 * key's hash came since the read began; answered until ttl after the read BEGAN (a
 * slow read does not lengthen it). */
void idem__pg_rcache_put(pg_rcache *c, const idem_key_ref *key, const idem_record *rec,
                         const pg_rcache_miss *miss);
/* Drops every entry of key hash (an announcement, a local forget), every entry for
 * IDEM__STORE_WATCH_ALL (the listener listens anew): an idem__store_watch_fn. */
void idem__pg_rcache_drop_hash(void *c, uint32_t hash);
void idem__pg_rcache_stats(pg_rcache *c, pg_rcache_stats *out);

#endif

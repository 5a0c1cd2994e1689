/* The store's watch and unwatch ops: one listener per store (listen.c), started by the
 * first watch when the store announces completions (no_notify: waiters re-read on their
 * timers), stopped at close (store_pg.c); the replay cache, which drops what the
 * announcements name. */
#include "pg_internal.h"

idem_code idem__pg_watch(idem_store *base, idem__store_watch_fn fn, void *arg)
{
    pg_store *st = (pg_store *)base;
    idem_code code = IDEM_OK;
    if (!st->notify) {
        return IDEM_OK; /* waiters re-read on their timers */
    }
    pthread_mutex_lock(&st->mu);
    if (st->listener == NULL) {
        code = idem__pg_listener_start(st->hosts, &st->listener);
    }
    pthread_mutex_unlock(&st->mu);
    if (code != IDEM_OK) {
        return code;
    }
    return idem__pg_listener_add(st->listener, fn, arg);
}

void idem__pg_unwatch(idem_store *base, idem__store_watch_fn fn, void *arg)
{
    pg_listener *l = ((pg_store *)base)->listener;
    if (l != NULL) {
        idem__pg_listener_remove(l, fn, arg);
    }
}

idem_code idem__pg_rcache_open(pg_store *st, const idem_pg_opts *opts)
{
    idem_code code = idem__pg_rcache_create(&st->rcache, opts->replay_cache_entries,
                                            opts->replay_cache_bytes, opts->replay_cache_ttl_ms);
    if (code != IDEM_OK || st->rcache == NULL || !st->notify) {
        return code; /* without announcements an entry lives its ttl */
    }
    return idem__pg_watch(&st->base, idem__pg_rcache_drop_hash, st->rcache);
}

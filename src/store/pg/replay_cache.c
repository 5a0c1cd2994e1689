/* The PostgreSQL store's local cache of COMPLETED records (replay_cache.h says why it
 * is allowed and what a forget elsewhere costs).
 *
 * A chained hash table by the key's idem__key_hash (the same hash the announcements
 * carry, so a drop finds its entries in one chain) and an LRU list, under one mutex.
 * Invariants: entries <= max_entries and bytes <= max_bytes after every put; an entry
 * is answered only before its until_ms (monotonic), which is at most ttl after the
 * read that filled it BEGAN (not its answer: a slow read does not lengthen it) and
 * never past the record's expiry. An announcement bumps its
 * hash's generation, and a read that began before the bump does not fill the cache. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "replay_cache.h"

#define GENS 256 /* generation counters, by hash */

typedef struct entry {
    struct entry *chain;       /* same bucket */
    struct entry *prev, *next; /* LRU: head most recent */
    uint32_t hash;
    uint64_t until_ms;  /* monotonic: answered before this */
    int64_t db_skew_ms; /* the database clock minus the monotonic one, at the read */
    idem_record rec;    /* response NULL: it is in data, after the key */
    size_t size;        /* what counts against max_bytes */
    size_t part_len[3]; /* caller, method, key */
    char data[];        /* caller, method, key (each NUL-terminated), then the response */
} entry;

struct pg_rcache {
    pthread_mutex_t mu;
    entry **buckets;
    size_t mask; /* buckets - 1 */
    entry *head, *tail;
    size_t entries, bytes, max_entries, max_bytes;
    uint32_t ttl_ms;
    uint64_t gens[GENS];
    uint64_t hits, misses, drops;
};

idem_code idem__pg_rcache_create(pg_rcache **out, size_t entries, size_t bytes, uint32_t ttl_ms)
{
    *out = NULL;
    if (entries == 0) {
        return IDEM_OK;
    }
    pg_rcache *c = calloc(1, sizeof(*c));
    size_t n = 16;
    entries = entries > PG_RCACHE_MAX_ENTRIES ? PG_RCACHE_MAX_ENTRIES : entries;
    while (n < entries) {
        n <<= 1;
    }
    if (c == NULL || (c->buckets = calloc(n, sizeof(entry *))) == NULL) {
        free(c);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    c->mask = n - 1;
    c->max_entries = entries;
    c->max_bytes = bytes ? bytes : PG_RCACHE_DEFAULT_BYTES;
    c->ttl_ms = ttl_ms ? ttl_ms : PG_RCACHE_DEFAULT_TTL_MS;
    c->ttl_ms = c->ttl_ms > PG_RCACHE_MAX_TTL_MS ? PG_RCACHE_MAX_TTL_MS : c->ttl_ms;
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return IDEM_OK;
}

void idem__pg_rcache_destroy(pg_rcache *c)
{
    if (c == NULL) {
        return;
    }
    for (entry *e = c->head, *next; e != NULL; e = next) {
        next = e->next;
        free(e);
    }
    pthread_mutex_destroy(&c->mu);
    free(c->buckets);
    free(c);
}

static bool same_key(const entry *e, const idem_key_ref *key)
{
    const char *parts[3] = {key->caller != NULL ? key->caller : "", key->method, key->key};
    const char *at = e->data;
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(parts[i]);
        if (n != e->part_len[i] || memcmp(at, parts[i], n) != 0) {
            return false;
        }
        at += n + 1;
    }
    return true;
}

static const uint8_t *response_of(const entry *e)
{
    return (const uint8_t *)e->data + e->part_len[0] + e->part_len[1] + e->part_len[2] + 3;
}

static void lru_unlink(pg_rcache *c, entry *e)
{
    *(e->prev != NULL ? &e->prev->next : &c->head) = e->next;
    *(e->next != NULL ? &e->next->prev : &c->tail) = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push(pg_rcache *c, entry *e)
{
    e->prev = NULL;
    e->next = c->head;
    *(c->head != NULL ? &c->head->prev : &c->tail) = e;
    c->head = e;
}

/* Unlinks e from its chain (at *link) and the LRU list, and frees it. */
static void remove_at(pg_rcache *c, entry **link)
{
    entry *e = *link;
    *link = e->chain;
    lru_unlink(c, e);
    c->entries--;
    c->bytes -= e->size;
    free(e);
}

static entry **find(pg_rcache *c, uint32_t hash, const idem_key_ref *key)
{
    entry **link = &c->buckets[hash & c->mask];
    while (*link != NULL && ((*link)->hash != hash || !same_key(*link, key))) {
        link = &(*link)->chain;
    }
    return link;
}

static void remove_entry(pg_rcache *c, entry *e)
{
    entry **link = &c->buckets[e->hash & c->mask];
    while (*link != e) {
        link = &(*link)->chain;
    }
    remove_at(c, link);
}

bool idem__pg_rcache_get(pg_rcache *c, const idem_key_ref *key, idem_record *rec,
                         pg_rcache_miss *miss)
{
    if (c == NULL) {
        return false;
    }
    uint32_t hash = idem__key_hash(key);
    uint64_t now = idem__mono_ms();
    bool hit = false;
    pthread_mutex_lock(&c->mu);
    *miss = (pg_rcache_miss){.gen = c->gens[hash % GENS], .read_ms = now};
    entry **link = find(c, hash, key);
    entry *e = *link;
    if (e != NULL && now >= e->until_ms) {
        remove_at(c, link); /* ttl or the record's expiry */
        e = NULL;
    }
    void *copy = e != NULL ? malloc(e->rec.response_len ? e->rec.response_len : 1) : NULL;
    if (copy != NULL) {
        *rec = e->rec;
        rec->response = memcpy(copy, response_of(e), e->rec.response_len);
        rec->now_ms = (uint64_t)((int64_t)now + e->db_skew_ms);
        lru_unlink(c, e);
        lru_push(c, e);
        hit = true;
    }
    c->hits += hit;
    c->misses += !hit;
    pthread_mutex_unlock(&c->mu);
    return hit; /* out of memory: read the database */
}

/* A new entry holding key and rec (and its response), or NULL. */
static entry *entry_new(const idem_key_ref *key, const idem_record *rec)
{
    const char *parts[3] = {key->caller != NULL ? key->caller : "", key->method, key->key};
    size_t lens[3], total = 0;
    for (int i = 0; i < 3; i++) {
        lens[i] = strlen(parts[i]);
        total += lens[i] + 1;
    }
    entry *e = malloc(sizeof(*e) + total + rec->response_len);
    if (e == NULL) {
        return NULL;
    }
    memset(e, 0, sizeof(*e));
    char *at = e->data;
    for (int i = 0; i < 3; i++) {
        e->part_len[i] = lens[i];
        memcpy(at, parts[i], lens[i] + 1);
        at += lens[i] + 1;
    }
    if (rec->response_len > 0) {
        memcpy(at, rec->response, rec->response_len);
    }
    e->rec = *rec;
    e->rec.response = NULL;
    e->size = sizeof(*e) + total + rec->response_len;
    return e;
}

void idem__pg_rcache_put(pg_rcache *c, const idem_key_ref *key, const idem_record *rec,
                         const pg_rcache_miss *miss)
{
    if (c == NULL || rec->state != IDEM_REC_COMPLETED || rec->expires_ms <= rec->now_ms) {
        return;
    }
    uint64_t now = idem__mono_ms(), left = rec->expires_ms - rec->now_ms;
    if (miss->read_ms + c->ttl_ms <= now) {
        return; /* the read took the whole ttl */
    }
    entry *e = entry_new(key, rec);
    if (e == NULL || e->size > c->max_bytes) {
        free(e);
        return;
    }
    e->hash = idem__key_hash(key);
    e->until_ms = miss->read_ms + (left < c->ttl_ms ? left : c->ttl_ms); /* from the read */
    e->db_skew_ms = (int64_t)rec->now_ms - (int64_t)now;
    pthread_mutex_lock(&c->mu);
    entry **link = find(c, e->hash, key);
    if (c->gens[e->hash % GENS] != miss->gen) {
        free(e); /* an announcement for this hash came after the read began */
    } else {
        if (*link != NULL) {
            remove_at(c, link); /* another read filled it meanwhile */
        }
        while (c->tail != NULL &&
               (c->entries + 1 > c->max_entries || c->bytes + e->size > c->max_bytes)) {
            remove_entry(c, c->tail);
        }
        e->chain = c->buckets[e->hash & c->mask];
        c->buckets[e->hash & c->mask] = e;
        lru_push(c, e);
        c->entries++;
        c->bytes += e->size;
    }
    pthread_mutex_unlock(&c->mu);
}

void idem__pg_rcache_drop_hash(void *arg, uint32_t hash)
{
    pg_rcache *c = arg;
    if (c == NULL) {
        return;
    }
    pthread_mutex_lock(&c->mu);
    c->gens[hash % GENS]++;
    if (hash == IDEM__STORE_WATCH_ALL) { /* every key: every read in flight, every entry */
        for (size_t g = 0; g < GENS; g++) {
            c->gens[g]++;
        }
        while (c->head != NULL) {
            remove_entry(c, c->head);
            c->drops++;
        }
    }
    for (entry **link = &c->buckets[hash & c->mask]; *link != NULL;) {
        if ((*link)->hash == hash) {
            remove_at(c, link);
            c->drops++;
        } else {
            link = &(*link)->chain;
        }
    }
    pthread_mutex_unlock(&c->mu);
}

void idem__pg_rcache_stats(pg_rcache *c, pg_rcache_stats *out)
{
    memset(out, 0, sizeof(*out));
    if (c == NULL) {
        return;
    }
    pthread_mutex_lock(&c->mu);
    *out = (pg_rcache_stats){c->entries, c->bytes, c->hits, c->misses, c->drops};
    pthread_mutex_unlock(&c->mu);
}

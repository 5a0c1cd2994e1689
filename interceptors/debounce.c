/* debounce: a short Redis window in front of the result cache ("Redis 只挡连点").
 *
 * SET idem:{len}:{caller}:{len}:{method}:{len}:{key} 1 NX PX window (each part
 * length-prefixed, so a ':' in a caller or key cannot make two keys one; see
 * window_key): the first send of a key within the
 * window passes, a repeat is answered ALREADY_EXISTS "duplicate submit" before any store
 * work. It is a shield against double clicks, not the money guard: Redis may forget (a
 * restart, an eviction), and then the result cache still decides. So Redis trouble
 * never fails a call: the interceptor fails open and logs it. Retries of one logical
 * call (attempt > 1) pass, so that a client that timed out gets the first result. */
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtins.h"

#define POOL 8
#define IO_TIMEOUT_MS 100 /* connect and command timeout: Redis must not slow calls */
#define RECONNECT_MS 1000 /* after a failure, skip Redis this long (fail open, fast) */

typedef struct redis_slot {
    pthread_mutex_t mu;
    redisContext *c;
} redis_slot;

struct idem_debounce {
    char host[128];
    int port;
    uint32_t window_ms;
    redis_slot slots[POOL];
    pthread_mutex_t mu; /* guards down_until, next */
    uint64_t down_until;
    unsigned next;
};

idem_code idem_debounce_create(idem_debounce **out, const char *url, uint32_t window_ms)
{
    idem_debounce *d;
    char host[128];
    int port = 6379;
    *out = NULL;
    if (url == NULL || sscanf(url, "redis://%127[^:/]:%d", host, &port) < 1 || port <= 0 ||
        port > 65535 || window_ms == 0) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "debounce needs redis://HOST[:PORT] and a window > 0 ms");
    }
    if ((d = calloc(1, sizeof(*d))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    snprintf(d->host, sizeof(d->host), "%s", host);
    d->port = port;
    d->window_ms = window_ms;
    pthread_mutex_init(&d->mu, NULL);
    for (int i = 0; i < POOL; i++) {
        pthread_mutex_init(&d->slots[i].mu, NULL);
    }
    *out = d;
    return IDEM_OK;
}

void idem_debounce_destroy(idem_debounce *d)
{
    if (d == NULL) {
        return;
    }
    for (int i = 0; i < POOL; i++) {
        if (d->slots[i].c != NULL) {
            redisFree(d->slots[i].c);
        }
        pthread_mutex_destroy(&d->slots[i].mu);
    }
    pthread_mutex_destroy(&d->mu);
    free(d);
}

/* Locks a slot (round robin); returns NULL while Redis is known to be down. */
static redis_slot *slot_get(idem_debounce *d)
{
    pthread_mutex_lock(&d->mu);
    bool down = idem__mono_ms() < d->down_until;
    unsigned i = d->next++ % POOL;
    pthread_mutex_unlock(&d->mu);
    if (down) {
        return NULL;
    }
    redis_slot *s = &d->slots[i];
    pthread_mutex_lock(&s->mu);
    return s;
}

/* Drops a broken connection and stops using Redis for RECONNECT_MS. */
static void slot_broken(idem_debounce *d, redis_slot *s)
{
    if (s->c != NULL) {
        redisFree(s->c);
        s->c = NULL;
    }
    pthread_mutex_lock(&d->mu);
    d->down_until = idem__mono_ms() + RECONNECT_MS;
    pthread_mutex_unlock(&d->mu);
}

static bool slot_connect(idem_debounce *d, redis_slot *s)
{
    if (s->c != NULL) {
        return true;
    }
    struct timeval tv = {0, IO_TIMEOUT_MS * 1000};
    s->c = redisConnectWithTimeout(d->host, d->port, tv);
    if (s->c == NULL || s->c->err || redisSetTimeout(s->c, tv) != REDIS_OK) {
        return false;
    }
    return true;
}

typedef enum { WINDOW_FIRST, WINDOW_REPEAT, WINDOW_UNKNOWN } window_result;

/* SET key 1 NX PX window: who is first within the window? */
static window_result window_enter(idem_debounce *d, const char *key, size_t len, char *err,
                                  size_t errcap)
{
    redis_slot *s = slot_get(d);
    if (s == NULL) {
        snprintf(err, errcap, "redis marked down");
        return WINDOW_UNKNOWN;
    }
    window_result res = WINDOW_UNKNOWN;
    redisReply *r = NULL;
    if (slot_connect(d, s)) {
        r = redisCommand(s->c, "SET %b 1 NX PX %u", key, len, (unsigned)d->window_ms);
    }
    if (r == NULL) {
        snprintf(err, errcap, "%s", s->c != NULL && s->c->err ? s->c->errstr : "connect failed");
        slot_broken(d, s);
    } else if (r->type == REDIS_REPLY_STATUS) {
        res = WINDOW_FIRST; /* "OK" */
    } else if (r->type == REDIS_REPLY_NIL) {
        res = WINDOW_REPEAT;
    } else {
        snprintf(err, errcap, "unexpected reply type %d", r->type);
    }
    if (r != NULL) {
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&s->mu);
    return res;
}

static void log_fail_open(const idem_call *call, const idem_debounce *d, const char *err)
{
    char id[IDEM_LOGQ_CAP], msg[IDEM_LOGQ_CAP], detail[IDEM_LOGQ_CAP];
    snprintf(detail, sizeof(detail), "debounce: redis %s:%d unavailable (%s); failing open",
             d->host, d->port, err);
    idem__log(call->rt->obs, IDEM_LOG_ERROR, "request_id=%s msg=%s",
              idem__logfmt_quote(id, sizeof(id), call->request_id),
              idem__logfmt_quote(msg, sizeof(msg), detail));
}

/* The Redis key of a call: each part prefixed by its length, so that no choice of
 * caller, method and key spells another call's key ("a:M:b" + "c" vs "a" + "b:M:c"
 * collided under the old idem:%s:%s:%s). Returns the length. */
static size_t window_key(char *out, size_t cap, const char *caller, const char *method,
                         const char *key)
{
    int n = snprintf(out, cap, "idem:%zu:%s:%zu:%s:%zu:%s", strlen(caller), caller, strlen(method),
                     method, strlen(key), key);
    return n > 0 && (size_t)n < cap ? (size_t)n : cap - 1; /* bounded parts: never cut */
}

idem_code idem__debounce_interceptor(idem_call *call, idem_next next, void *arg)
{
    idem_debounce *d = arg;
    const idem_method *m = call->method;
    if (m == NULL || !(m->opts.flags & IDEM_METHOD_DEBOUNCE) || call->key_source == IDEM_KEY_NONE ||
        idem_call_attempt(call) > 1) {
        return idem_call_next(call, next);
    }
    char key[IDEM_MAX_CALLER + IDEM_MAX_METHOD + IDEM_MAX_KEY + 32], err[160];
    size_t n = window_key(key, sizeof(key), idem_call_caller(call), m->name, call->key);
    switch (window_enter(d, key, n, err, sizeof(err))) {
    case WINDOW_REPEAT:
        return idem__reject(call, IDEM_REASON_DEBOUNCED, IDEM_ALREADY_EXISTS,
                            "duplicate submit: the same key arrived within %u ms",
                            (unsigned)d->window_ms);
    case WINDOW_UNKNOWN:
        log_fail_open(call, d, err);
        break;
    case WINDOW_FIRST:
        break;
    }
    return idem_call_next(call, next);
}

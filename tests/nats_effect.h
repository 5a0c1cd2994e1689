/* The effect the broker tests count: effects[key] += 1 in the consume txn, so that a
 * message whose effect ran twice shows 2. The payload steers failures:
 *   "fail=N"   the first N deliveries write, then fail UNAVAILABLE (rolled back)
 *   "fail=all" every delivery does
 *   "final"    INVALID_ARGUMENT: a message no redelivery fixes
 *   "sleep=MS" the handler takes MS before writing (an ack wait shorter than that
 *              redelivers the message while it runs) */
#ifndef IDEMRPC_TEST_NATS_EFFECT_H
#define IDEMRPC_TEST_NATS_EFFECT_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <idemrpc/idemrpc.h>
#include <idemrpc/nats.h>

#define NE_DB "effects"

static inline long ne_field(const idem_nats_msg *m, const char *name)
{
    char buf[64];
    size_t n = m->len < sizeof(buf) - 1 ? m->len : sizeof(buf) - 1;
    memcpy(buf, m->data, n);
    buf[n] = '\0';
    const char *p = strstr(buf, name);
    if (p == NULL) {
        return -1;
    }
    p += strlen(name);
    return strncmp(p, "all", 3) == 0 ? 1000000 : strtol(p, NULL, 10);
}

static inline idem_code ne_effect(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    (void)arg;
    const void *v;
    size_t n;
    char buf[32];
    long count = 0, sleep_ms = ne_field(m, "sleep="), fail = ne_field(m, "fail=");
    if (m->len >= 5 && memcmp(m->data, "final", 5) == 0) {
        return IDEM_INVALID_ARGUMENT;
    }
    if (sleep_ms > 0 && m->delivered == 1) {
        struct timespec ts = {sleep_ms / 1000, (sleep_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    idem_code code = idem_txn_get(t, NE_DB, m->key, strlen(m->key), &v, &n);
    if (code == IDEM_OK) {
        snprintf(buf, sizeof(buf), "%.*s", (int)n, (const char *)v);
        count = atol(buf);
    } else if (code != IDEM_NOT_FOUND) {
        return code;
    }
    n = (size_t)snprintf(buf, sizeof(buf), "%ld", count + 1);
    if ((code = idem_txn_put(t, NE_DB, m->key, strlen(m->key), buf, n)) != IDEM_OK) {
        return code;
    }
    return fail > 0 && (long)m->delivered <= fail ? IDEM_UNAVAILABLE : IDEM_OK;
}

#endif

/* A consumer process for the broker tests: one durable pull consumer running ne_effect
 * (nats_effect.h) on a store, until it has seen the durable idle.
 *   nats_worker URL STREAM DURABLE FILTER DEAD STORE ACK_WAIT_MS CRASH
 * STORE is "lmdb:DIR" or "pg:CONNINFO"; CRASH "committed" kills the process (SIGKILL)
 * right after the first effect commits, before its ack; "none" runs to the end. Prints
 * "ready" once bound, and "stats committed=.. duplicates=.. acked=.." at exit.
 *   nats_worker relay URL STORE
 * relays the store's outbox and kills itself (SIGKILL) right after the first publish
 * the broker acked, before its removal from the outbox. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_effect.h"

#define IDLE_POLLS 10 /* consecutive empty fetches of fetch_wait_ms: the durable is idle */

static void crash_after_commit(idem_nats_event ev, const idem_nats_msg *m, const char *reason,
                               void *arg)
{
    (void)m, (void)reason, (void)arg;
    if (ev == IDEM_NATS_COMMITTED) {
        raise(SIGKILL); /* like kill -9: the effect is committed, the ack never sent */
    }
}

static idem_store *store_open(const char *spec)
{
    idem_store *st = NULL;
    idem_code code = strncmp(spec, "pg:", 3) == 0
                         ? idem_store_open_postgres(&st, spec + 3, 4)
                         : idem_store_open_lmdb(&st, spec + 5, 0, IDEM_STORE_NOSYNC);
    if (code != IDEM_OK) {
        fprintf(stderr, "nats_worker: store %s: %s\n", spec, idem_errmsg());
        exit(2);
    }
    return st;
}

static void crash_after_publish(const idem_outbox_msg *m, bool duplicate, void *arg)
{
    (void)m, (void)duplicate, (void)arg;
    raise(SIGKILL);
}

static int relay_main(const char *url, const char *store)
{
    idem_nats_relay_opts o;
    idem_nats_relay *r;
    idem_store *st = store_open(store);
    idem_nats_relay_opts_init(&o);
    o.url = url;
    o.on_published = crash_after_publish;
    if (idem_nats_relay_open(&r, st, &o) != IDEM_OK) {
        fprintf(stderr, "nats_worker: relay: %s\n", idem_errmsg());
        return 2;
    }
    printf("ready\n");
    fflush(stdout);
    idem_code code = idem_nats_relay_run_once(r, NULL);
    fprintf(stderr, "nats_worker: relay round ended without a crash: %s\n", idem_code_name(code));
    return 3;
}

int main(int argc, char **argv)
{
    idem_nats_consumer_opts o;
    idem_nats_consumer *c;
    idem_nats_stats s;
    if (argc == 4 && strcmp(argv[1], "relay") == 0) {
        return relay_main(argv[2], argv[3]);
    }
    if (argc != 9) {
        fprintf(stderr, "usage: nats_worker URL STREAM DURABLE FILTER DEAD STORE ACK_WAIT CRASH\n");
        return 2;
    }
    idem_store *st = store_open(argv[6]);
    idem_nats_consumer_opts_init(&o);
    o.url = argv[1], o.stream = argv[2], o.durable = argv[3], o.filter_subject = argv[4];
    o.dead_letter_subject = argv[5], o.ack_wait_ms = (unsigned)atoi(argv[7]);
    o.handler = ne_effect, o.fetch_wait_ms = 200, o.backoff_ms = 10;
    o.on_event = strcmp(argv[8], "committed") == 0 ? crash_after_commit : NULL;
    if (idem_nats_consumer_open(&c, st, &o) != IDEM_OK) {
        fprintf(stderr, "nats_worker: open: %s\n", idem_errmsg());
        return 2;
    }
    printf("ready\n");
    fflush(stdout);
    for (int idle = 0; idle < IDLE_POLLS;) {
        unsigned n = 0;
        idem_code code = idem_nats_consumer_poll(c, &n);
        idle = code == IDEM_OK && n == 0 ? idle + 1 : 0;
    }
    idem_nats_consumer_stats(c, &s);
    printf("stats committed=%llu duplicates=%llu acked=%llu\n", (unsigned long long)s.committed,
           (unsigned long long)s.duplicates, (unsigned long long)s.acked);
    idem_nats_consumer_close(c);
    idem_store_close(st);
    return 0;
}

/* idemrpc-demo --nats URL: the stream DEMO (demo.events, demo.dead), a consumer
 * (durable demo-ledger) counting demo.events in the store, dead letters to demo.dead,
 * and the outbox relay; both on the server's /metrics (consumer="demo-ledger",
 * relay="demo"). A message without a key (a plain NATS publish) is dead-lettered. */
#include <stdio.h>
#include <string.h>

#include <idemrpc/nats.h>

#include "demo.h"

static idem_code count_event(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    (void)arg;
    return idem_txn_put(t, "demo.events", m->key, strlen(m->key), "1", 1);
}

static bool failed(const char *what)
{
    fprintf(stderr, "idemrpc-demo: --nats: %s: %s\n", what, idem_errmsg());
    return false;
}

bool demo_nats_start(demo_nats *n, idem_server *srv, const char *url)
{
    static const char *const subjects[] = {"demo.events", "demo.dead"};
    idem_store *st = idem_server_store(srv);
    idem_nats_consumer_opts co;
    idem_nats_relay_opts ro;
    idem_nats_consumer_opts_init(&co);
    co.url = url, co.stream = "DEMO", co.durable = "demo-ledger";
    co.filter_subject = "demo.events", co.dead_letter_subject = "demo.dead";
    co.handler = count_event;
    idem_nats_relay_opts_init(&ro);
    ro.url = url;
    if (idem_nats_ensure_stream(url, "DEMO", subjects, 2) != IDEM_OK) {
        return failed("stream DEMO");
    }
    if (idem_nats_consumer_open(&n->c, st, &co) != IDEM_OK ||
        idem_nats_consumer_start(n->c) != IDEM_OK) {
        return failed("consumer demo-ledger");
    }
    if (idem_nats_relay_open(&n->r, st, &ro) != IDEM_OK || idem_nats_relay_start(n->r) != IDEM_OK) {
        return failed("relay");
    }
    if (idem_server_add_nats_consumer(srv, n->c, "demo-ledger", &n->c_id) != IDEM_OK ||
        idem_server_add_nats_relay(srv, n->r, "demo", &n->r_id) != IDEM_OK) {
        return failed("metrics");
    }
    return true;
}

void demo_nats_stop(demo_nats *n, idem_server *srv)
{
    idem_server_remove_metrics(srv, n->c_id);
    idem_server_remove_metrics(srv, n->r_id);
    idem_nats_consumer_close(n->c);
    idem_nats_relay_close(n->r);
}

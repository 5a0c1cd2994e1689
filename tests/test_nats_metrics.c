/* The consumer's and the relay's counts on a server's GET /metrics (nats.h,
 * idem_server_add_nats_consumer / _relay, on server.h's idem_server_add_metrics), against
 * a real nats-server: what the broker saw, as Prometheus reads it. Needs
 * $IDEMRPC_TEST_NATS; runs on LMDB (nats_metrics) and PostgreSQL (nats_metrics_pg). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_util.h"

static nt E;
static tu_server S;
static int http_port;

static void setup(void)
{
    nt_setup(&E, "met");
    tu_server_create(&S, NULL);
    tu_server_listen(&S);
    cr_assert_eq(idem_server_listen_http(S.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    http_port = idem_server_http_port(S.srv);
}

static void teardown(void)
{
    if (S.srv != NULL) { /* a test that destroyed it before what it reads */
        tu_server_destroy(&S, false);
    }
    nt_teardown(&E);
}

TestSuite(nats_metrics, .init = setup, .fini = teardown);

/* GET /metrics, whole (static buffer, valid until the next call). */
static const char *scrape(void)
{
    static char text[65536];
    tu_http h;
    tu_http_get(&h, http_port, "/metrics");
    cr_assert_not_null(h.body, "no /metrics answer");
    snprintf(text, sizeof(text), "%s", h.body);
    tu_http_free(&h);
    return text;
}

static int occurrences(const char *text, const char *what)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, what)) != NULL; p += strlen(what)) {
        n++;
    }
    return n;
}

Test(nats_metrics, a_consumers_deliveries_acks_and_dead_letters_are_on_metrics_per_durable)
{
    idem_nats_consumer_opts o;
    unsigned ledger_id;
    nt_opts(&E, &o, "ledger");
    idem_nats_consumer *ledger = nt_consumer(&E, &o);
    nt_opts(&E, &o, "audit");
    idem_nats_consumer *audit = nt_consumer(&E, &o);
    cr_assert_eq(idem_server_add_nats_consumer(S.srv, ledger, "ledger", &ledger_id), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(idem_server_add_nats_consumer(S.srv, audit, "audit", NULL), IDEM_OK, "%s",
                 idem_errmsg());
    nt_publish(&E, "order-1", NULL, "amount=1");
    nt_publish(&E, "order-2", NULL, "final"); /* the handler: INVALID_ARGUMENT */
    nt_drain(&E, ledger, "ledger");
    nt_drain(&E, audit, "audit");

    const char *m = scrape();
    cr_expect(strstr(m, "\nidem_nats_deliveries_total{consumer=\"ledger\"} 2\n") != NULL, "%s", m);
    cr_expect(strstr(m, "\nidem_nats_committed_total{consumer=\"ledger\"} 1\n") != NULL, "%s", m);
    cr_expect(strstr(m, "\nidem_nats_acks_total{consumer=\"ledger\"} 1\n") != NULL, "%s", m);
    cr_expect(strstr(m, "\nidem_nats_dead_letters_total{consumer=\"ledger\"} 1\n") != NULL, "%s",
              m);
    cr_expect(strstr(m, "\nidem_nats_dead_letters_total{consumer=\"audit\"} 1\n") != NULL, "%s", m);
    cr_expect(strstr(m, "\nidem_nats_dead_letter_failures_total{consumer=\"ledger\"} 0\n") != NULL,
              "%s", m);
    /* Two sources, one HELP and one TYPE per name: Prometheus refuses a repeated TYPE. */
    cr_expect_eq(occurrences(m, "# TYPE idem_nats_dead_letters_total counter\n"), 1, "%s", m);
    cr_expect_eq(occurrences(m, "# HELP idem_nats_dead_letters_total "), 1, "%s", m);

    /* Removed: gone from the next scrape; the consumer may be closed now. */
    idem_server_remove_metrics(S.srv, ledger_id);
    m = scrape();
    cr_expect(strstr(m, "consumer=\"ledger\"") == NULL, "%s", m);
    cr_expect(strstr(m, "consumer=\"audit\"") != NULL, "%s", m);
    idem_nats_consumer_close(ledger);
    /* audit stays registered: the server is destroyed first (teardown), then it closes. */
    tu_server_destroy(&S, false);
    idem_nats_consumer_close(audit);
}

static idem_code put_three(idem_txn *t, void *arg)
{
    return nt_put_orders(t, ((nt *)arg)->in, 0, 3);
}

Test(nats_metrics, a_relays_published_removed_and_kept_counts_are_on_metrics)
{
    idem_nats_relay_opts o;
    idem_nats_relay *r;
    idem_outbox_msg msg;
    size_t n = 1;
    idem_nats_relay_opts_init(&o);
    o.url = E.url;
    cr_assert_eq(idem_nats_relay_open(&r, E.st, &o), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_server_add_nats_relay(S.srv, r, "outbox", NULL), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(idem_store_run_txn(E.st, put_three, &E), IDEM_OK, "%s", idem_errmsg());
    for (int i = 0; i < 100 && n > 0; i++) {
        cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
        cr_assert_eq(idem_outbox_peek(E.st, &msg, 1, &n), IDEM_OK, "%s", idem_errmsg());
        idem_outbox_msgs_free(&msg, n);
    }
    cr_assert_eq(n, 0, "the relay emptied the outbox");
    const char *m = scrape();
    cr_expect(strstr(m, "\nidem_relay_published_total{relay=\"outbox\"} 3\n") != NULL, "%s", m);
    cr_expect(strstr(m, "\nidem_relay_removed_total{relay=\"outbox\"} 3\n") != NULL, "%s", m);
    cr_expect(strstr(m, "\nidem_relay_failures_total{relay=\"outbox\"} 0\n") != NULL, "%s", m);
    cr_expect(strstr(m, "# TYPE idem_relay_kept gauge\nidem_relay_kept{relay=\"outbox\"} ") != NULL,
              "%s", m);
    tu_server_destroy(&S, false); /* before the relay it reads */
    idem_nats_relay_close(r);
}

Test(nats_metrics, registration_refuses_a_missing_consumer_and_a_name_out_of_bounds)
{
    char long_name[IDEM_MAX_CONSUMER_GROUP + 2];
    memset(long_name, 'n', sizeof(long_name) - 1);
    long_name[sizeof(long_name) - 1] = '\0';
    cr_expect_eq(idem_server_add_nats_consumer(S.srv, NULL, "ledger", NULL), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_server_add_nats_relay(NULL, NULL, "outbox", NULL), IDEM_INVALID_ARGUMENT);
    idem_nats_consumer_opts o;
    nt_opts(&E, &o, "named");
    idem_nats_consumer *c = nt_consumer(&E, &o);
    cr_expect_eq(idem_server_add_nats_consumer(S.srv, c, "", NULL), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_server_add_nats_consumer(S.srv, c, long_name, NULL), IDEM_INVALID_ARGUMENT);
    cr_expect(strstr(idem_errmsg(), "a name of 1..64 bytes") != NULL, "%s", idem_errmsg());
    cr_expect(strstr(scrape(), "consumer=") == NULL, "nothing registered");
    idem_nats_consumer_close(c);
}

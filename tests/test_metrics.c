/* The gauges GET /metrics reads from the store after each sweep (issue 37 item 8): the
 * outbox's depth and the age of its oldest message, the records by state and the map's
 * use. Runs on LMDB (metrics) and PostgreSQL (metrics_pg). The lease counters are fired
 * by real faults in tests/test_prometheus.sh. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

#define AWAIT_ROUNDS 500 /* 10 ms each: every wait below is bounded at 5 s */

static tu_backend B;
static tu_server S;
static int http_port;

static idem_code echo(idem_call *call, void *arg)
{
    (void)arg;
    return idem_call_reply(call, IDEM_OK, "ok", 2);
}

static void setup(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = tu_backend_open(&B, "metrics");
    o.sweep_interval_ms = 20;
    tu_server_create(&S, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(S.srv, "metrics.T/Echo", echo, NULL, &m), IDEM_OK);
    tu_server_listen(&S);
    cr_assert_eq(idem_server_listen_http(S.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    http_port = idem_server_http_port(S.srv);
}

static void teardown(void)
{
    tu_server_destroy(&S, false);
    tu_backend_close(&B);
}

TestSuite(metrics, .init = setup, .fini = teardown);

/* The value of one series (name with its labels) on /metrics; -1 when absent. */
static double metric(const char *series)
{
    char needle[128];
    tu_http h;
    snprintf(needle, sizeof(needle), "\n%s ", series);
    tu_http_get(&h, http_port, "/metrics");
    const char *w = h.body != NULL ? strstr(h.body, needle) : NULL;
    double v = w != NULL ? strtod(w + strlen(needle), NULL) : -1;
    tu_http_free(&h);
    return v;
}

/* Polls until series satisfies cmp against v (bounded); the last value read. */
static double await_metric(const char *series, char cmp, double v)
{
    double got = -1;
    for (int i = 0; i < AWAIT_ROUNDS; i++) {
        got = metric(series);
        if ((cmp == '=' && got == v) || (cmp == '>' && got > v) ||
            (cmp == '<' && got < v && got >= 0)) {
            return got;
        }
        nanosleep(&(struct timespec){0, 10000000L}, NULL); /* polling a gauge, bounded */
    }
    cr_assert_fail("%s never got %c %g (last %g)", series, cmp, v, got);
    return got;
}

static idem_code put_two(idem_txn *t, void *arg)
{
    (void)arg;
    idem_code code = idem_outbox_put(t, "orders.created", "order-1", "a", 1);
    return code != IDEM_OK ? code : idem_outbox_put(t, "orders.created", "order-2", "b", 1);
}

/* Removes the outbox's oldest message (a relay's ack, without a broker). */
static void relay_one(void)
{
    idem_outbox_msg m;
    size_t n;
    cr_assert_eq(idem_outbox_peek(B.st, &m, 1, &n), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(n, 1);
    cr_assert_eq(idem_outbox_remove(B.st, &m.seq, 1), IDEM_OK, "%s", idem_errmsg());
    idem_outbox_msgs_free(&m, n);
}

Test(metrics, the_outbox_depth_and_oldest_age_follow_what_the_relay_removed)
{
    await_metric("idem_outbox_pending", '=', 0);
    cr_assert_eq(metric("idem_outbox_oldest_age_seconds"), 0);
    cr_assert_eq(idem_store_run_txn(B.st, put_two, NULL), IDEM_OK, "%s", idem_errmsg());
    await_metric("idem_outbox_pending", '=', 2);
    /* Nothing relays it: the oldest message ages from sweep to sweep. */
    double aged = await_metric("idem_outbox_oldest_age_seconds", '>', 0.1);
    /* Its removal makes the second the oldest, seen since the next sweep only. */
    relay_one();
    await_metric("idem_outbox_pending", '=', 1);
    await_metric("idem_outbox_oldest_age_seconds", '<', aged);
    relay_one();
    await_metric("idem_outbox_pending", '=', 0);
    await_metric("idem_outbox_oldest_age_seconds", '=', 0);
}

Test(metrics, the_records_by_state_and_the_store_use_are_read_after_each_sweep)
{
    await_metric("idem_store_records{state=\"completed\"}", '=', 0);
    idem_client *c = tu_client(S.url, 5000);
    idem_request q = {.method = "metrics.T/Echo", .idempotency_key = "k1"};
    idem_result r;
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s", r.message);
    idem_result_clear(&r);
    idem_client_close(c);
    await_metric("idem_store_records{state=\"completed\"}", '=', 1);
    cr_assert_eq(metric("idem_store_records{state=\"in_progress\"}"), 0);
    cr_assert_eq(metric("idem_store_read_failures_total"), 0);
    if (!tu_backend_is_pg()) { /* an LMDB map; PostgreSQL has none (0) */
        cr_assert_gt(metric("idem_store_size_bytes"), 0);
        cr_assert_gt(metric("idem_store_used_bytes"), 0);
    } else {
        cr_assert_eq(metric("idem_store_size_bytes"), 0);
    }
}

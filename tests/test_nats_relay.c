/* The outbox relay (nats.h) against a real nats-server -js: a message exists iff its
 * txn committed, leaves the outbox only after the broker acked it, and a crash between
 * the ack and the removal publishes it again without a second stored message or effect.
 * Needs $IDEMRPC_TEST_NATS; runs on LMDB (nats_relay) and PostgreSQL (nats_relay_pg). */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_util.h"

typedef struct put_args {
    const char *subject;
    int from, to;
    idem_code result; /* what the txn returns after its puts */
} put_args;

static idem_code put_orders(idem_txn *t, void *arg)
{
    put_args *a = arg;
    idem_code code = nt_put_orders(t, a->subject, a->from, a->to);
    return code != IDEM_OK ? code : a->result;
}

static uint64_t pending(nt *e)
{
    uint64_t n;
    cr_assert_eq(idem_outbox_pending(e->st, &n), IDEM_OK, "%s", idem_errmsg());
    return n;
}

static uint64_t stream_msgs(nt *e)
{
    jsStreamInfo *si = NULL;
    cr_assert_eq(js_GetStreamInfo(&si, e->js, e->stream, NULL, NULL), NATS_OK);
    uint64_t n = si->State.Msgs;
    jsStreamInfo_Destroy(si);
    return n;
}

static idem_nats_relay *relay_open(nt *e)
{
    idem_nats_relay_opts o;
    idem_nats_relay *r;
    idem_nats_relay_opts_init(&o);
    o.url = e->url;
    o.batch = 7; /* several rounds for 20 messages */
    cr_assert_eq(idem_nats_relay_open(&r, e->st, &o), IDEM_OK, "%s", idem_errmsg());
    return r;
}

static void relay_all(nt *e, idem_nats_relay *r)
{
    for (int i = 0; i < 100 && pending(e) > 0; i++) {
        cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
    }
    cr_assert_eq(pending(e), 0);
}

static void consume_all(nt *e, int n)
{
    idem_nats_consumer_opts o;
    char key[32];
    nt_opts(e, &o, "credit");
    idem_nats_consumer *c = nt_consumer(e, &o);
    nt_drain(e, c, "credit");
    idem_nats_consumer_close(c);
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        cr_expect_eq(nt_effects(e, key), 1, "%s", key);
    }
}

typedef struct big_put {
    const char *subject, *msg_id;
    size_t len;
} big_put;

static idem_code put_big(idem_txn *t, void *arg)
{
    big_put *a = arg;
    char *data = malloc(a->len);
    cr_assert_not_null(data);
    memset(data, 'x', a->len);
    idem_code code = idem_outbox_put(t, a->subject, a->msg_id, data, a->len);
    free(data);
    return code;
}

/* The most data a message with msg_id can carry: NATS counts the headers the relay adds
 * (Nats-Msg-Id and Idem-Key, both msg_id) against the connection's max_payload. */
static size_t data_limit(nt *e, const char *msg_id)
{
    char hdr[600];
    int n = snprintf(hdr, sizeof(hdr), "NATS/1.0\r\nNats-Msg-Id: %s\r\nIdem-Key: %s\r\n\r\n",
                     msg_id, msg_id);
    return (size_t)(natsConnection_GetMaxPayload(e->nc) - n);
}

Test(nats_relay, publishes_data_at_the_brokers_limit_and_refuses_one_byte_over_at_put)
{
    nt e;
    idem_nats_relay_counts s;
    nt_setup(&e, "limit");
    idem_nats_relay *r = relay_open(&e); /* learns the broker's max_payload */
    big_put at = {e.in, "order-0", data_limit(&e, "order-0")};
    big_put under = {e.in, "order-1", data_limit(&e, "order-1") - 1};
    big_put over = {e.in, "order-2", data_limit(&e, "order-2") + 1};
    cr_assert_eq(idem_store_run_txn(e.st, put_big, &at), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_run_txn(e.st, put_big, &under), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_run_txn(e.st, put_big, &over), IDEM_INVALID_ARGUMENT);
    cr_expect(strstr(idem_errmsg(), "max_payload") != NULL, "%s", idem_errmsg());
    cr_assert_eq(pending(&e), 2);
    relay_all(&e, r);
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.published, 2);
    cr_expect_eq(stream_msgs(&e), 2);
    idem_nats_relay_close(r);
    nt_teardown(&e);
}

/* The stream takes at most 1000 bytes a message: order-0 (2000) can never be stored. */
Test(nats_relay, a_message_the_broker_refuses_for_good_is_parked_and_the_rest_flow)
{
    nt e;
    jsStreamInfo *si = NULL;
    jsStreamConfig sc;
    idem_nats_relay_counts s;
    nt_setup(&e, "park");
    const char *subjects[] = {e.in, e.dead};
    jsStreamConfig_Init(&sc);
    sc.Name = e.stream;
    sc.Subjects = subjects;
    sc.SubjectsLen = 2;
    sc.MaxMsgSize = 1000;
    cr_assert_eq(js_UpdateStream(&si, e.js, &sc, NULL, NULL), NATS_OK);
    jsStreamInfo_Destroy(si);
    big_put too_big = {e.in, "order-0", 2000};
    put_args rest = {e.in, 1, 4, IDEM_OK};
    cr_assert_eq(idem_store_run_txn(e.st, put_big, &too_big), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &rest), IDEM_OK, "%s", idem_errmsg());
    idem_nats_relay *r = relay_open(&e);
    relay_all(&e, r); /* never stuck behind order-0 */
    cr_expect_eq(stream_msgs(&e), 3);
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.parked, 1);
    cr_expect_eq(s.published, 3);
    idem_nats_relay_close(r);
    uint8_t k[9] = {'p', 0, 0, 0, 0, 0, 0, 0, 0}; /* order-0 was put first: seq 0 */
    void *v = NULL;
    size_t n = 0;
    cr_expect_eq(idem_store_app_get(e.st, IDEM_OUTBOX_DB, k, sizeof(k), &v, &n), IDEM_OK,
                 "the parked message is kept");
    cr_expect_eq(n, 4 + strlen(e.in) + strlen("order-0") + 2000);
    free(v);
    nt_teardown(&e);
}

Test(nats_relay, relays_committed_messages_and_removes_them_after_the_ack)
{
    nt e;
    idem_nats_relay_counts s;
    nt_setup(&e, "relay");
    put_args ok = {e.in, 0, 20, IDEM_OK}, rolled_back = {e.in, 20, 25, IDEM_ABORTED};
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &ok), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &rolled_back), IDEM_ABORTED);
    cr_assert_eq(pending(&e), 20); /* the rolled-back txn left no message */
    idem_nats_relay *r = relay_open(&e);
    relay_all(&e, r);
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.published, 20);
    cr_expect_eq(s.removed, 20);
    cr_expect_eq(stream_msgs(&e), 20);
    idem_nats_relay_close(r);
    consume_all(&e, 20); /* keyed by the msg_id the relay put in Idem-Key */
    cr_expect_eq(nt_effects(&e, "order-20"), 0);
    nt_teardown(&e);
}

Test(nats_relay, a_publish_the_broker_refuses_keeps_the_message)
{
    nt e;
    idem_nats_relay_counts s;
    nt_setup(&e, "refuse");
    put_args nowhere = {"nostream.anywhere", 0, 1, IDEM_OK};
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &nowhere), IDEM_OK);
    idem_nats_relay *r = relay_open(&e);
    cr_expect_neq(idem_nats_relay_run_once(r, NULL), IDEM_OK); /* no stream: no ack */
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.failures, 1);
    cr_expect_eq(s.removed, 0);
    cr_expect_eq(pending(&e), 1);
    idem_nats_relay_close(r);
    nt_teardown(&e);
}

Test(nats_relay, a_crash_between_the_publish_ack_and_the_removal_stores_one_message)
{
    nt e;
    idem_nats_relay_counts s;
    tu_child w;
    nt_setup(&e, "crash");
    put_args ok = {e.in, 0, 10, IDEM_OK};
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &ok), IDEM_OK, "%s", idem_errmsg());
    const char *argv[] = {getenv("NATS_WORKER"), "relay", e.url, nt_store_spec(&e), NULL};
    cr_assert_not_null(argv[0], "NATS_WORKER not set (meson test sets it)");
    tu_spawn(&w, argv);
    cr_assert_eq(tu_reap(&w), SIGKILL);
    cr_assert_eq(stream_msgs(&e), 1, "order-0 published");
    cr_assert_eq(pending(&e), 10, "and not removed");
    idem_nats_relay *r = relay_open(&e);
    relay_all(&e, r);
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.duplicates, 1); /* order-0 again: the broker's window dropped it */
    cr_expect_eq(s.published, 9);
    cr_expect_eq(stream_msgs(&e), 10);
    idem_nats_relay_close(r);
    consume_all(&e, 10);
    nt_teardown(&e);
}

Test(nats_relay, the_outbox_refuses_messages_out_of_bounds)
{
    tu_backend b;
    idem_store *st = tu_backend_open(&b, "bounds");
    char big[300];
    memset(big, 'x', 256);
    big[256] = '\0';
    put_args no_subject = {"", 0, 1, IDEM_OK}, long_subject = {big, 0, 1, IDEM_OK};
    cr_expect_eq(idem_store_run_txn(st, put_orders, &no_subject), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_store_run_txn(st, put_orders, &long_subject), IDEM_INVALID_ARGUMENT);
    /* No relay told it the broker's limit: nats-server's default max_payload, headers in. */
    big_put at_old_max = {"orders.in", "order-0", IDEM_OUTBOX_MAX_DATA};
    cr_expect_eq(idem_store_run_txn(st, put_big, &at_old_max), IDEM_INVALID_ARGUMENT);
    uint64_t n = 1;
    cr_expect_eq(idem_outbox_pending(st, &n), IDEM_OK);
    cr_expect_eq(n, 0);
    tu_backend_close(&b);
}

/* Review (issue 35 item 3, "a message the broker refuses for good must never block the
 * rest of the outbox"): put takes any subject, but one no stream listens on is refused
 * by the broker on every round (no responders), is not parked, and because the relay
 * keeps order every message committed after it is stranded. */
Test(nats_relay, a_message_on_a_subject_no_stream_takes_does_not_strand_the_rest)
{
    nt e;
    idem_nats_relay_counts s;
    char nowhere[64];
    nt_setup(&e, "nowhere");
    snprintf(nowhere, sizeof(nowhere), "%s.nowhere", e.stream);
    put_args lost = {nowhere, 0, 1, IDEM_OK}, rest = {e.in, 1, 4, IDEM_OK};
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &lost), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &rest), IDEM_OK, "%s", idem_errmsg());
    idem_nats_relay *r = relay_open(&e);
    idem_code last = IDEM_OK;
    for (int i = 0; i < 10 && pending(&e) > 0; i++) {
        last = idem_nats_relay_run_once(r, NULL);
    }
    idem_nats_relay_stats(r, &s);
    fprintf(stderr,
            "after 10 rounds: pending %llu, stream %llu, parked %llu, failures %llu, "
            "last %s: %s\n",
            (unsigned long long)pending(&e), (unsigned long long)stream_msgs(&e),
            (unsigned long long)s.parked, (unsigned long long)s.failures, idem_code_name(last),
            idem_errmsg());
    cr_expect_eq(stream_msgs(&e), 3, "the messages behind order-0 were never published");
    idem_nats_relay_close(r);
    nt_teardown(&e);
}

/* Starts a nats-server WITHOUT JetStream on a free port (its ports file in dir): it answers
 * every publish, and every JetStream API call, with "no responders", as a broker whose
 * JetStream is not up yet does. Its client url into url; end it with SIGTERM to b. */
static void broker_without_jetstream(tu_child *b, const char *dir, char *url, size_t cap)
{
    const char *script = /* $0: dir; it ends nats-server at a TERM or when the test died */
        "nats-server -a 127.0.0.1 -p -1 --ports_file_dir \"$0\" -l \"$0/log\" & pid=$!;"
        "trap 'kill $pid; exit 0' TERM; ports=\"$0/nats-server_$pid.ports\";"
        "for i in $(seq 200); do [ -s \"$ports\" ] && break; sleep 0.05; done; echo ready;"
        "sed -n 's/.*\"\\(nats:[^\"]*\\)\".*/\\1/p' \"$ports\"; echo;"
        "while kill -0 $PPID 2>/dev/null; do sleep 0.2; done; kill $pid";
    const char *argv[] = {"/bin/sh", "-c", script, dir, NULL};
    tu_spawn(b, argv);
    cr_assert_not_null(fgets(url, (int)cap, b->out), "no ports file from nats-server");
    url[strcspn(url, "\n")] = '\0';
    cr_assert(strncmp(url, "nats://", 7) == 0, "url %s", url);
}

/* "No responders" is also what a broker answers while its JetStream is away (restarting,
 * not up yet): then no lookup says that no stream takes the subject, and nothing is
 * parked however many rounds fail. */
Test(nats_relay, a_broker_whose_jetstream_is_away_parks_nothing)
{
    tu_backend b;
    tu_child broker;
    idem_nats_relay_opts o;
    idem_nats_relay_counts s;
    idem_nats_relay *r;
    char url[128];
    uint64_t n = 0;
    if (getenv("IDEMRPC_TEST_NATS") == NULL) {
        cr_skip_test("IDEMRPC_TEST_NATS not set: no nats-server here");
    }
    char *dir = tu_tempdir("nojs");
    broker_without_jetstream(&broker, dir, url, sizeof(url));
    idem_store *st = tu_backend_open(&b, "nojs");
    put_args orders = {"orders.in", 0, 3, IDEM_OK};
    cr_assert_eq(idem_store_run_txn(st, put_orders, &orders), IDEM_OK, "%s", idem_errmsg());
    idem_nats_relay_opts_init(&o);
    o.url = url;
    cr_assert_eq(idem_nats_relay_open(&r, st, &o), IDEM_OK, "%s", idem_errmsg());
    for (int i = 0; i < 12; i++) { /* over twice the rounds that park a subject no stream takes */
        cr_expect_eq(idem_nats_relay_run_once(r, NULL), IDEM_UNAVAILABLE, "%s", idem_errmsg());
    }
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.parked, 0);
    cr_expect_eq(s.failures, 12);
    cr_expect_eq(idem_outbox_pending(st, &n), IDEM_OK);
    cr_expect_eq(n, 3);
    idem_nats_relay_close(r);
    tu_backend_close(&b);
    kill(broker.pid, SIGTERM);
    tu_reap(&broker);
    tu_rmtree(dir);
}

static bool broker_stopped; /* by the test running: started again in its fini */

static void services(const char *what)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s %s", getenv("IDEMRPC_SERVICES"), what);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    broker_stopped = strcmp(what, "stop-nats") == 0;
}

static void broker_back(void)
{
    if (broker_stopped) {
        services("start-nats");
    }
}

/* Issue 37 item 2: an API embedding the relay could not start during a broker outage
 * (open answered UNAVAILABLE). The broker "lost" the three messages a first relay left
 * kept (their stream deleted and made again): the lazy open's first connect must find
 * that before publishing anything, so every message is in the stream once. */
Test(nats_relay, opens_while_the_broker_is_down_and_publishes_each_message_once_it_is_back,
     .fini = broker_back)
{
    nt e;
    idem_nats_relay_counts s;
    unsigned relayed = 0;
    if (getenv("IDEMRPC_SERVICES") == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set: cannot stop nats-server");
    }
    nt_setup(&e, "lazy");
    const char *subjects[] = {e.in, e.dead};
    put_args kept = {e.in, 0, 3, IDEM_OK}, before = {e.in, 3, 6, IDEM_OK},
             during = {e.in, 6, 10, IDEM_OK};
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &kept), IDEM_OK, "%s", idem_errmsg());
    idem_nats_relay *r = relay_open(&e);
    relay_all(&e, r);
    idem_nats_relay_close(r);
    cr_assert_eq(js_DeleteStream(e.js, e.stream, NULL, NULL), NATS_OK);
    cr_assert_eq(idem_nats_ensure_stream(e.url, e.stream, subjects, 2), IDEM_OK);
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &before), IDEM_OK, "%s", idem_errmsg());
    services("stop-nats");
    r = relay_open(&e);
    cr_expect_eq(idem_nats_relay_run_once(r, &relayed), IDEM_UNAVAILABLE, "%s", idem_errmsg());
    cr_expect(strstr(idem_errmsg(), "unreachable") != NULL, "%s", idem_errmsg());
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.connected, 0);
    cr_assert_eq(idem_store_run_txn(e.st, put_orders, &during), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(pending(&e), 7, "the outbox keeps filling");
    services("start-nats");
    for (int i = 0; i < 1000 && pending(&e) > 0; i++) {
        if (idem_nats_relay_run_once(r, NULL) != IDEM_OK) {
            nats_Sleep(10); /* reconnecting: each round asks again */
        }
    }
    cr_assert_eq(pending(&e), 0, "%s", idem_errmsg());
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.connected, 1);
    cr_expect_eq(s.losses, 1, "the first connect checked the kept messages");
    cr_expect_eq(s.restored, 3);
    cr_expect_eq(stream_msgs(&e), 10);
    idem_nats_relay_close(r);
    consume_all(&e, 10);
    nt_teardown(&e);
}

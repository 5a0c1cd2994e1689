/* The JetStream consumer binding (nats.h) against a real nats-server -js: each message's
 * effect exactly once, every message acked or dead-lettered, none lost, through
 * redeliveries, crashes, a broker restart and consumers sharing one durable. Needs
 * $IDEMRPC_TEST_NATS (scripts/services.sh exports it); skipped without it. Runs on the
 * store $IDEMRPC_TEST_BACKEND names (nats: LMDB, nats_pg: PostgreSQL). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_util.h"

Test(nats, acks_each_message_after_its_effect_commits)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s;
    char key[32];
    nt_setup(&e, "ack");
    nt_opts(&e, &o, "credit");
    idem_nats_consumer *c = nt_consumer(&e, &o);
    for (int i = 0; i < 50; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        nt_publish(&e, key, NULL, "amount=1");
    }
    nt_drain(&e, c, "credit");
    for (int i = 0; i < 50; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        cr_expect_eq(nt_effects(&e, key), 1, "%s", key);
    }
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.committed, 50);
    cr_expect_eq(s.acked, 50);
    cr_expect_eq(s.dead_lettered, 0);
    idem_nats_consumer_close(c);
    nt_teardown(&e);
}

Test(nats, a_message_published_again_takes_effect_once)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s;
    nt_setup(&e, "dup");
    nt_opts(&e, &o, "credit");
    idem_nats_consumer *c = nt_consumer(&e, &o);
    /* Two msg ids: the broker's window does not drop the second; idem_consume must. */
    nt_publish(&e, "order-7", "pub-1", "amount=1");
    nt_publish(&e, "order-7", "pub-2", "amount=1");
    /* No Idem-Key: the key is Nats-Msg-Id, the same both times (inside the window the
     * broker drops the second publish itself). */
    nt_publish(&e, NULL, "order-8", "amount=1");
    nt_drain(&e, c, "credit");
    cr_expect_eq(nt_effects(&e, "order-7"), 1);
    cr_expect_eq(nt_effects(&e, "order-8"), 1);
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.committed, 2);
    cr_expect_eq(s.duplicates, 1);
    cr_expect_eq(s.acked, 3);
    idem_nats_consumer_close(c);
    nt_teardown(&e);
}

/* The business number from the payload: "order=<id>&..."; undecodable without "order=". */
static idem_code order_key(const void *data, size_t len, char *key, size_t cap, void *arg)
{
    (void)arg;
    if (len < 6 || memcmp(data, "order=", 6) != 0) {
        return memmem(data, len, "order", 5) != NULL ? IDEM_NOT_FOUND : IDEM_INVALID_ARGUMENT;
    }
    const char *p = (const char *)data + 6, *end = memchr(p, '&', len - 6);
    size_t n = end != NULL ? (size_t)(end - p) : len - 6;
    n = n < cap - 1 ? n : cap - 1;
    memcpy(key, p, n);
    key[n] = '\0';
    return IDEM_OK;
}

Test(nats, dead_letters_bad_input_with_its_reason)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s;
    char reasons[8][256], long_key[300];
    nt_setup(&e, "bad");
    memset(long_key, 'k', 256);
    long_key[256] = '\0';
    nt_publish(&e, NULL, NULL, "amount=1");     /* no key */
    nt_publish(&e, long_key, NULL, "amount=1"); /* 256 bytes: over the bound */
    nt_publish(&e, "order-1", NULL, "final");   /* the handler: INVALID_ARGUMENT */
    nt_opts(&e, &o, "headers");
    idem_nats_consumer *c = nt_consumer(&e, &o);
    nt_drain(&e, c, "headers");
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.dead_lettered, 3);
    cr_expect_eq(s.acked, 0);
    idem_nats_consumer_close(c);
    /* A second durable on the same messages keys them from the payload instead. */
    nt_opts(&e, &o, "payload");
    o.key_fn = order_key;
    c = nt_consumer(&e, &o);
    nt_drain(&e, c, "payload");
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.dead_lettered, 3);
    idem_nats_consumer_close(c);
    cr_assert_eq(nt_dead_letters(&e, reasons, 8), 6);
    cr_expect(strstr(reasons[0], "no key") != NULL, "%s", reasons[0]);
    cr_expect(strstr(reasons[1], "key over 255 bytes") != NULL, "%s", reasons[1]);
    cr_expect(strstr(reasons[2], "final failure") != NULL, "%s", reasons[2]);
    cr_expect(strstr(reasons[3], "undecodable payload") != NULL, "%s", reasons[3]);
    cr_expect_eq(nt_effects(&e, "order-1"), 0);
    nt_teardown(&e);
}

Test(nats, naks_a_transient_failure_and_dead_letters_after_max_deliveries)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s;
    char reasons[4][256];
    nt_setup(&e, "nak");
    nt_opts(&e, &o, "credit");
    o.max_deliver = 3;
    idem_nats_consumer *c = nt_consumer(&e, &o);
    nt_publish(&e, "flaky", NULL, "fail=2");    /* fails twice, then takes effect */
    nt_publish(&e, "broken", NULL, "fail=all"); /* fails every time */
    nt_drain(&e, c, "credit");
    cr_expect_eq(nt_effects(&e, "flaky"), 1);  /* the failed deliveries' writes rolled back */
    cr_expect_eq(nt_effects(&e, "broken"), 0); /* never acked, never committed */
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.acked, 1);
    cr_expect_eq(s.naked, 4); /* flaky 2, broken 2; broken's third is the dead letter */
    cr_expect_eq(s.dead_lettered, 1);
    cr_assert_eq(nt_dead_letters(&e, reasons, 4), 1);
    cr_expect(strstr(reasons[0], "max deliveries (delivery 3): UNAVAILABLE") != NULL, "%s",
              reasons[0]);
    idem_nats_consumer_close(c);
    nt_teardown(&e);
}

/* Issue 35's long campaign, finding 7: a message id the relays published twice (two
 * stream copies past the broker's duplicate window) whose handler fails each copy's
 * first 2 deliveries. max_deliver counts per copy (stream sequence): each copy stays
 * under it, the first to succeed takes effect, the other is a duplicate; no dead letter.
 * Counted per message id, the copies' failures added up to max_deliver at a copy's
 * second delivery: "max deliveries (delivery 2)". */
Test(nats, each_stream_copy_of_a_message_id_has_its_own_max_deliver)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s;
    char reasons[4][256];
    nt_setup(&e, "copies");
    nt_opts(&e, &o, "credit");
    o.max_deliver = 3;
    idem_nats_consumer *c = nt_consumer(&e, &o);
    nt_publish(&e, "flaky-2", "pub-1", "fail=2");
    nt_publish(&e, "flaky-2", "pub-2", "fail=2");
    nt_drain(&e, c, "credit");
    int dead = nt_dead_letters(&e, reasons, 4);
    cr_expect_eq(dead, 0, "dead-lettered: %s", dead > 0 ? reasons[0] : "");
    cr_expect_eq(nt_effects(&e, "flaky-2"), 1);
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.committed, 1);
    cr_expect_eq(s.duplicates, 1);
    cr_expect_eq(s.naked, 4); /* each copy's first 2 deliveries */
    idem_nats_consumer_close(c);
    nt_teardown(&e);
}

static idem_code no_effect(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    (void)t, (void)m, (void)arg;
    return IDEM_OK;
}

Test(nats, open_refuses_bad_options_a_missing_stream_and_an_unreachable_broker)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_consumer *c = NULL;
    nt_setup(&e, "open");
    nt_opts(&e, &o, "credit");
    o.handler = no_effect;
    o.durable = "has.dot";
    cr_expect_eq(idem_nats_consumer_open(&c, e.st, &o), IDEM_INVALID_ARGUMENT);
    o.durable = "credit";
    o.batch = IDEM_NATS_MAX_BATCH + 1;
    cr_expect_eq(idem_nats_consumer_open(&c, e.st, &o), IDEM_INVALID_ARGUMENT);
    o.batch = 16;
    o.dead_letter_subject = NULL;
    cr_expect_eq(idem_nats_consumer_open(&c, e.st, &o), IDEM_INVALID_ARGUMENT);
    o.dead_letter_subject = e.dead;
    o.stream = "NOSUCHSTREAM";
    cr_expect_eq(idem_nats_consumer_open(&c, e.st, &o), IDEM_NOT_FOUND, "%s", idem_errmsg());
    o.stream = e.stream;
    o.url = "nats://127.0.0.1:1"; /* nothing listens there */
    cr_expect_eq(idem_nats_consumer_open(&c, e.st, &o), IDEM_UNAVAILABLE, "%s", idem_errmsg());
    cr_expect_null(c);
    nt_teardown(&e);
}

/* The one dead letter on the stream's dead subject (the test fails without one). */
static natsMsg *dead_letter_of(nt *e)
{
    natsSubscription *sub = NULL;
    natsMsgList list = {0};
    cr_assert_eq(js_PullSubscribe(&sub, e->js, e->dead, NULL, NULL, NULL, NULL), NATS_OK);
    cr_assert_eq(natsSubscription_Fetch(&list, sub, 1, 2000, NULL), NATS_OK, "no dead letter");
    cr_assert_eq(list.Count, 1);
    natsMsg *m = list.Msgs[0];
    list.Msgs[0] = NULL;
    natsMsgList_Destroy(&list);
    natsSubscription_Unsubscribe(sub);
    natsSubscription_Destroy(sub);
    return m;
}

/* A message as large as the broker takes fails for good: its dead letter, with six headers
 * of its own, cannot carry all of it; it carries a bounded part and says so. */
Test(nats, a_final_failure_at_the_brokers_limit_is_dead_lettered_with_a_bounded_part)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s = {0};
    const char *truncated = NULL;
    char original[24];
    nt_setup(&e, "bigdead");
    size_t len = (size_t)natsConnection_GetMaxPayload(e.nc) - strlen("NATS/1.0\r\n"
                                                                     "Idem-Key: big-0\r\n\r\n");
    char *payload = malloc(len + 1);
    cr_assert_not_null(payload);
    memset(payload, 'x', len);
    memcpy(payload, "final", 5);
    payload[len] = '\0';
    nt_publish(&e, "big-0", NULL, payload); /* at the limit: the broker takes it */
    nt_opts(&e, &o, "credit");
    idem_nats_consumer *c = nt_consumer(&e, &o);
    for (int i = 0; i < 20 && !nt_settled(&e, "credit"); i++) { /* a hang guard */
        cr_assert_eq(idem_nats_consumer_poll(c, NULL), IDEM_OK, "%s", idem_errmsg());
    }
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.dead_lettered, 1, "%llu dead-letter failures",
                 (unsigned long long)s.dead_failures);
    cr_assert(nt_settled(&e, "credit"), "the message is redelivered for ever");
    natsMsg *d = dead_letter_of(&e);
    snprintf(original, sizeof(original), "%zu", len);
    cr_assert_eq(natsMsgHeader_Get(d, "Idem-Truncated", &truncated), NATS_OK);
    cr_expect_str_eq(truncated, original);
    cr_expect_lt((size_t)natsMsg_GetDataLength(d), len);
    cr_expect_eq(memcmp(natsMsg_GetData(d), payload, (size_t)natsMsg_GetDataLength(d)), 0);
    natsMsg_Destroy(d);
    idem_nats_consumer_close(c);
    free(payload);
    nt_teardown(&e);
}

/* Sets the test stream's max_msg_size (taking subjects[0..n)). */
static void stream_bound(nt *e, const char **subjects, int n, int32_t max_msg_size)
{
    jsStreamInfo *si = NULL;
    jsStreamConfig sc;
    jsStreamConfig_Init(&sc);
    sc.Name = e->stream;
    sc.Subjects = subjects;
    sc.SubjectsLen = n;
    sc.MaxMsgSize = max_msg_size;
    cr_assert_eq(js_UpdateStream(&si, e->js, &sc, NULL, NULL), NATS_OK);
    jsStreamInfo_Destroy(si);
}

/* A payload for key that, with its Idem-Key header, is exactly bound bytes (free it). */
static char *final_payload(const char *key, size_t bound)
{
    char hdr[128];
    size_t len =
        bound - (size_t)snprintf(hdr, sizeof(hdr), "NATS/1.0\r\nIdem-Key: %s\r\n\r\n", key);
    char *payload = malloc(len + 1);
    cr_assert_not_null(payload);
    memset(payload, 'x', len);
    memcpy(payload, "final", 5);
    payload[len] = '\0';
    return payload;
}

/* Polls c until the durable is settled or 20 polls passed (a hang guard); its stats. */
static void poll_settled(nt *e, idem_nats_consumer *c, idem_nats_stats *s)
{
    for (int i = 0; i < 20 && !nt_settled(e, "credit"); i++) {
        cr_assert_eq(idem_nats_consumer_poll(c, NULL), IDEM_OK, "%s", idem_errmsg());
    }
    idem_nats_consumer_stats(c, s);
}

/* Review (issue 35 item 3): the relay treats a stream's max_msg_size as "refused for
 * good" (it parks), but the dead letter is sized by the connection's max_payload only.
 * A stream whose max_msg_size is below max_payload stores a message near its limit; when
 * that message fails for good its dead letter (six headers more) is refused by the same
 * stream, so it is naked and its handler re-run on every delivery, for ever. */
Test(nats, a_final_failure_near_the_streams_max_msg_size_is_dead_lettered)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s = {0};
    nt_setup(&e, "msgsize");
    const char *subjects[] = {e.in, e.dead};
    stream_bound(&e, subjects, 2, 1000);
    char *payload = final_payload("big-0", 1000);
    nt_publish(&e, "big-0", NULL, payload); /* within max_msg_size: the stream takes it */
    nt_opts(&e, &o, "credit");
    idem_nats_consumer *c = nt_consumer(&e, &o);
    poll_settled(&e, c, &s);
    fprintf(stderr, "dead_lettered %llu, dead_failures %llu, settled %d\n",
            (unsigned long long)s.dead_lettered, (unsigned long long)s.dead_failures,
            (int)nt_settled(&e, "credit"));
    cr_expect_eq(s.dead_lettered, 1, "%llu dead-letter failures",
                 (unsigned long long)s.dead_failures);
    cr_assert(nt_settled(&e, "credit"), "the message is redelivered for ever");
    idem_nats_consumer_close(c);
    free(payload);
    nt_teardown(&e);
}

/* The dead letters' stream's bound is read at the first dead letter: one lowered after it
 * refuses the next (10054), is read again, and that dead letter is cut to it. */
Test(nats, a_dead_letter_follows_its_streams_max_msg_size_lowered_after_the_first)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s = {0};
    nt_setup(&e, "lowered");
    nt_publish(&e, "small-0", NULL, "final");
    nt_opts(&e, &o, "credit");
    idem_nats_consumer *c = nt_consumer(&e, &o);
    poll_settled(&e, c, &s);
    cr_assert_eq(s.dead_lettered, 1); /* its stream's bound read: none */
    const char *subjects[] = {e.in, e.dead};
    stream_bound(&e, subjects, 2, 1000);
    char *payload = final_payload("big-1", 1000);
    nt_publish(&e, "big-1", NULL, payload);
    poll_settled(&e, c, &s);
    cr_expect_eq(s.dead_lettered, 2, "%llu dead-letter failures",
                 (unsigned long long)s.dead_failures);
    cr_expect_eq(s.dead_failures, 0);
    cr_assert(nt_settled(&e, "credit"), "the message is redelivered for ever");
    idem_nats_consumer_close(c);
    free(payload);
    nt_teardown(&e);
}

/* Dead letters captured by a stream that takes less than their headers: refused for good
 * even without payload. The message is terminated (said, counted), not re-run for ever. */
Test(nats, a_dead_letter_refused_for_good_ends_its_message_and_says_so)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s = {0};
    char dead_stream[48];
    jsStreamInfo *si = NULL;
    jsStreamConfig sc;
    nt_setup(&e, "nodead");
    const char *in[] = {e.in}, *dead[] = {e.dead};
    stream_bound(&e, in, 1, -1);
    snprintf(dead_stream, sizeof(dead_stream), "%sD", e.stream);
    jsStreamConfig_Init(&sc);
    sc.Name = dead_stream;
    sc.Subjects = dead;
    sc.SubjectsLen = 1;
    sc.MaxMsgSize = 64; /* below the dead letter's headers */
    cr_assert_eq(js_AddStream(&si, e.js, &sc, NULL, NULL), NATS_OK);
    jsStreamInfo_Destroy(si);
    nt_publish(&e, "k-0", NULL, "final");
    nt_opts(&e, &o, "credit");
    idem_nats_consumer *c = nt_consumer(&e, &o);
    poll_settled(&e, c, &s);
    cr_expect_eq(s.dead_refused, 1, "%llu dead-letter failures",
                 (unsigned long long)s.dead_failures);
    cr_expect_eq(s.dead_lettered, 0);
    cr_expect(nt_settled(&e, "credit"), "the message is redelivered for ever");
    cr_expect_eq(nt_effects(&e, "k-0"), 0);
    idem_nats_consumer_close(c);
    js_DeleteStream(e.js, dead_stream, NULL, NULL);
    nt_teardown(&e);
}

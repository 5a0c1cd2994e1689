/* The JetStream consumer binding (nats.h) against a real nats-server -js: each message's
 * effect exactly once, every message acked or dead-lettered, none lost, through
 * redeliveries, crashes, a broker restart and consumers sharing one durable. Needs
 * $IDEMRPC_TEST_NATS (scripts/services.sh exports it); skipped without it. Runs on the
 * store $IDEMRPC_TEST_BACKEND names (nats: LMDB, nats_pg: PostgreSQL). */
#include <criterion/criterion.h>
#include <nats/nats.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nats_effect.h"
#include "testutil.h"

#define SETTLE_POLLS 3000 /* a hang guard, not a timing assertion */

typedef struct nt {
    tu_backend b;
    idem_store *st;
    natsConnection *nc;
    jsCtx *js;
    const char *url;
    char stream[32], in[48], dead[48];
} nt;

static void nt_connect(nt *e)
{
    natsOptions *o;
    cr_assert_eq(natsOptions_Create(&o), NATS_OK);
    cr_assert_eq(natsOptions_SetURL(o, e->url), NATS_OK);
    cr_assert_eq(natsOptions_SetMaxReconnect(o, -1), NATS_OK);
    cr_assert_eq(natsOptions_SetReconnectWait(o, 100), NATS_OK);
    natsStatus s = natsConnection_Connect(&e->nc, o);
    natsOptions_Destroy(o);
    cr_assert_eq(s, NATS_OK, "connect %s: %s", e->url, natsStatus_GetText(s));
    cr_assert_eq(natsConnection_JetStream(&e->js, e->nc, NULL), NATS_OK);
}

static void nt_setup(nt *e, const char *tag)
{
    jsStreamConfig sc;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    memset(e, 0, sizeof(*e));
    if ((e->url = getenv("IDEMRPC_TEST_NATS")) == NULL) {
        cr_skip_test("IDEMRPC_TEST_NATS not set (bash scripts/services.sh start exports it)");
    }
    srand((unsigned)(getpid() ^ time(NULL)));
    snprintf(e->stream, sizeof(e->stream), "T%s%08x", tag, (unsigned)rand());
    snprintf(e->in, sizeof(e->in), "%s.in", e->stream);
    snprintf(e->dead, sizeof(e->dead), "%s.dead", e->stream);
    nt_connect(e);
    const char *subjects[] = {e->in, e->dead};
    jsStreamConfig_Init(&sc);
    sc.Name = e->stream;
    sc.Subjects = subjects;
    sc.SubjectsLen = 2;
    cr_assert_eq(js_AddStream(&si, e->js, &sc, NULL, &jerr), NATS_OK, "stream: %d", (int)jerr);
    jsStreamInfo_Destroy(si);
    e->st = tu_backend_open(&e->b, tag);
}

static void nt_teardown(nt *e)
{
    js_DeleteStream(e->js, e->stream, NULL, NULL);
    jsCtx_Destroy(e->js);
    natsConnection_Destroy(e->nc);
    tu_backend_close(&e->b);
}

/* Publishes payload to the stream's input subject; key and msg_id may be NULL (no such
 * header). Retries while the broker is away (a restart test). */
static void nt_publish(nt *e, const char *key, const char *msg_id, const char *payload)
{
    natsMsg *m;
    jsPubAck *ack = NULL;
    natsStatus s = NATS_ERR;
    cr_assert_eq(natsMsg_Create(&m, e->in, NULL, payload, (int)strlen(payload)), NATS_OK);
    if (key != NULL) {
        cr_assert_eq(natsMsgHeader_Set(m, IDEM_NATS_KEY_HEADER, key), NATS_OK);
    }
    if (msg_id != NULL) {
        cr_assert_eq(natsMsgHeader_Set(m, IDEM_NATS_MSG_ID_HEADER, msg_id), NATS_OK);
    }
    for (int i = 0; i < 300 && s != NATS_OK; i++) {
        if ((s = js_PublishMsg(&ack, e->js, m, NULL, NULL)) != NATS_OK) {
            nats_Sleep(100);
        }
    }
    cr_assert_eq(s, NATS_OK, "publish: %s", natsStatus_GetText(s));
    jsPubAck_Destroy(ack);
    natsMsg_Destroy(m);
}

static void nt_opts(nt *e, idem_nats_consumer_opts *o, const char *durable)
{
    idem_nats_consumer_opts_init(o);
    o->url = e->url;
    o->stream = e->stream;
    o->durable = durable;
    o->filter_subject = e->in;
    o->dead_letter_subject = e->dead;
    o->handler = ne_effect;
    o->fetch_wait_ms = 100;
    o->backoff_ms = 10;
    o->backoff_max_ms = 50;
}

/* True when the durable has nothing left to deliver and nothing delivered unacked. */
static bool nt_settled(nt *e, const char *durable)
{
    jsConsumerInfo *ci = NULL;
    if (js_GetConsumerInfo(&ci, e->js, e->stream, durable, NULL, NULL) != NATS_OK) {
        return false; /* the broker is away: not settled yet */
    }
    bool settled = ci->NumPending == 0 && ci->NumAckPending == 0;
    jsConsumerInfo_Destroy(ci);
    return settled;
}

/* Polls c until the durable is settled. */
static void nt_drain(nt *e, idem_nats_consumer *c, const char *durable)
{
    int i = 0;
    while (!nt_settled(e, durable) && i++ < SETTLE_POLLS) {
        idem_nats_consumer_poll(c, NULL);
    }
    cr_assert(nt_settled(e, durable), "durable %s never settled", durable);
}

static long nt_effects(nt *e, const char *key)
{
    return atol(tu_app_value(e->st, NE_DB, key));
}

/* Reads every dead letter so far: their reasons (at most max) and the count. */
static int nt_dead_letters(nt *e, char reasons[][256], int max)
{
    natsSubscription *sub = NULL;
    natsMsgList list = {0};
    int n = 0;
    cr_assert_eq(js_PullSubscribe(&sub, e->js, e->dead, NULL, NULL, NULL, NULL), NATS_OK);
    while (natsSubscription_Fetch(&list, sub, 64, 500, NULL) == NATS_OK && list.Count > 0) {
        for (int i = 0; i < list.Count; i++, n++) {
            const char *r = "";
            natsMsgHeader_Get(list.Msgs[i], IDEM_NATS_DEAD_REASON, &r);
            if (n < max) {
                snprintf(reasons[n], 256, "%s", r);
            }
            natsMsg_Ack(list.Msgs[i], NULL);
        }
        natsMsgList_Destroy(&list);
    }
    natsMsgList_Destroy(&list);
    natsSubscription_Unsubscribe(sub);
    natsSubscription_Destroy(sub);
    return n;
}

static idem_nats_consumer *nt_consumer(nt *e, idem_nats_consumer_opts *o)
{
    idem_nats_consumer *c;
    cr_assert_eq(idem_nats_consumer_open(&c, e->st, o), IDEM_OK, "%s", idem_errmsg());
    return c;
}

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
    nt_publish(&e, "flaky", NULL, "fail=2");   /* fails twice, then takes effect */
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

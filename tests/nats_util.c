/* Helpers of the broker tests: see nats_util.h. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nats_util.h"

#define SETTLE_POLLS 3000 /* a hang guard, not a timing assertion */

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

void nt_setup(nt *e, const char *tag)
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

void nt_teardown(nt *e)
{
    js_DeleteStream(e->js, e->stream, NULL, NULL);
    jsCtx_Destroy(e->js);
    natsConnection_Destroy(e->nc);
    tu_backend_close(&e->b);
}

/* Publishes payload to the stream's input subject; key and msg_id may be NULL (no such
 * header). Retries while the broker is away (a restart test). */
void nt_publish(nt *e, const char *key, const char *msg_id, const char *payload)
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

void nt_opts(nt *e, idem_nats_consumer_opts *o, const char *durable)
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
bool nt_settled(nt *e, const char *durable)
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
void nt_drain(nt *e, idem_nats_consumer *c, const char *durable)
{
    int i = 0;
    while (!nt_settled(e, durable) && i++ < SETTLE_POLLS) {
        idem_nats_consumer_poll(c, NULL);
    }
    cr_assert(nt_settled(e, durable), "durable %s never settled", durable);
}

long nt_effects(nt *e, const char *key)
{
    return atol(tu_app_value(e->st, NE_DB, key));
}

/* Reads every dead letter so far: their reasons (at most max) and the count. */
int nt_dead_letters(nt *e, char reasons[][256], int max)
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

idem_nats_consumer *nt_consumer(nt *e, idem_nats_consumer_opts *o)
{
    idem_nats_consumer *c;
    cr_assert_eq(idem_nats_consumer_open(&c, e->st, o), IDEM_OK, "%s", idem_errmsg());
    return c;
}

const char *nt_store_spec(nt *e)
{
    static char spec[512];
    if (e->b.conninfo != NULL) {
        snprintf(spec, sizeof(spec), "pg:%s", e->b.conninfo);
    } else {
        snprintf(spec, sizeof(spec), "lmdb:%s", e->b.dir);
    }
    return spec;
}

idem_code nt_put_orders(idem_txn *t, const char *subject, int from, int to)
{
    char id[32];
    idem_code code = IDEM_OK;
    for (int i = from; code == IDEM_OK && i < to; i++) {
        snprintf(id, sizeof(id), "order-%d", i);
        code = idem_outbox_put(t, subject, id, "amount=1", 8);
    }
    return code;
}

typedef struct orders {
    const char *subject;
    int from, to;
} orders;

static idem_code put_orders_txn(idem_txn *t, void *arg)
{
    const orders *o = arg;
    return nt_put_orders(t, o->subject, o->from, o->to);
}

void nt_commit_orders(idem_store *st, const char *subject, int from, int to)
{
    orders o = {subject, from, to};
    cr_assert_eq(idem_store_run_txn(st, put_orders_txn, &o), IDEM_OK, "%s", idem_errmsg());
}

void nt_commit_and_relay(nt *e, idem_nats_relay *r, const char *subject, int from, int to)
{
    uint64_t pending = 1;
    nt_commit_orders(e->st, subject, from, to);
    for (int i = 0; i < NT_RELAY_ROUNDS && pending > 0; i++) {
        if (idem_nats_relay_run_once(r, NULL) != IDEM_OK) {
            nats_Sleep(20);
        }
        cr_assert_eq(idem_outbox_pending(e->st, &pending), IDEM_OK, "%s", idem_errmsg());
    }
    cr_assert_eq(pending, 0, "the broker never acked orders %d..%d", from, to - 1);
}

uint64_t nt_stream_msgs(nt *e)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    cr_assert_eq(js_GetStreamInfo(&si, e->js, e->stream, NULL, &jerr), NATS_OK, "%d", (int)jerr);
    uint64_t n = si->State.Msgs;
    jsStreamInfo_Destroy(si);
    return n;
}

void nt_forget_stream(nt *e)
{
    jsStreamConfig sc;
    jsStreamInfo *si = NULL;
    const char *subjects[] = {e->in, e->dead};
    cr_assert_eq(js_DeleteStream(e->js, e->stream, NULL, NULL), NATS_OK);
    jsStreamConfig_Init(&sc);
    sc.Name = e->stream;
    sc.Subjects = subjects;
    sc.SubjectsLen = 2;
    cr_assert_eq(js_AddStream(&si, e->js, &sc, NULL, NULL), NATS_OK);
    jsStreamInfo_Destroy(si);
}

idem_nats_relay *nt_relay(nt *e)
{
    idem_nats_relay_opts ro;
    idem_nats_relay *r;
    idem_nats_relay_opts_init(&ro);
    ro.url = e->url;
    cr_assert_eq(idem_nats_relay_open(&r, e->st, &ro), IDEM_OK, "%s", idem_errmsg());
    return r;
}

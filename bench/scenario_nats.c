/* w: messages/s through the JetStream consumer binding (nats.h) next to a bare JetStream
 * consume-and-ack loop, in the same run, at 1 and 8 consumers ($IDEMRPC_BENCH_NATS, a
 * nats-server -js URL).
 *
 * Each cell publishes M messages (untimed; --count N sets M, default 5000) to a stream
 * of its own, then times K consumers on one durable until all M are acked:
 *   bare       K threads, each its own connection: Fetch(64) and AckSync, nothing else
 *   idem       K idem_nats_consumers: each message in idem_consume on an LMDB store
 *              (the effect: one idem_txn_put), AckSync after the commit; durable store
 *   idem-nosync the same on an IDEM_STORE_NOSYNC store (what the fsync costs)
 * Prints its own table: consumers, msgs/s of each, and idem over bare. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <idemrpc/nats.h>
#include <nats/nats.h>

#include "bench.h"

#define DEFAULT_MESSAGES 5000
#define FETCH_BATCH 64
#define MAX_CONSUMERS 8
#define CELL_CAP_S 120 /* a cell that takes longer is reported as failed */

typedef struct nats_cell {
    const char *url;
    char stream[32], in[48], dead[48];
    uint64_t messages;
    _Atomic uint64_t acked;
} nats_cell;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A stream of its own with M messages, each with its Idem-Key. */
static int cell_fill(nats_cell *c, natsConnection *nc, jsCtx *js)
{
    jsStreamConfig sc;
    jsStreamInfo *si = NULL;
    const char *subjects[] = {c->in, c->dead};
    char key[32];
    (void)nc;
    snprintf(c->stream, sizeof(c->stream), "BENCHW%08x", (unsigned)(rand() ^ getpid()));
    snprintf(c->in, sizeof(c->in), "%s.in", c->stream);
    snprintf(c->dead, sizeof(c->dead), "%s.dead", c->stream);
    jsStreamConfig_Init(&sc);
    sc.Name = c->stream;
    sc.Subjects = subjects;
    sc.SubjectsLen = 2;
    if (js_AddStream(&si, js, &sc, NULL, NULL) != NATS_OK) {
        return -1;
    }
    jsStreamInfo_Destroy(si);
    for (uint64_t i = 0; i < c->messages; i++) {
        natsMsg *m = NULL;
        jsPubAck *ack = NULL;
        snprintf(key, sizeof(key), "order-%llu", (unsigned long long)i);
        if (natsMsg_Create(&m, c->in, NULL, "amount=1", 8) != NATS_OK ||
            natsMsgHeader_Set(m, IDEM_NATS_KEY_HEADER, key) != NATS_OK ||
            js_PublishMsg(&ack, js, m, NULL, NULL) != NATS_OK) {
            natsMsg_Destroy(m);
            return -1;
        }
        jsPubAck_Destroy(ack);
        natsMsg_Destroy(m);
    }
    return 0;
}

static void *bare_main(void *arg)
{
    nats_cell *c = arg;
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    natsSubscription *sub = NULL;
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = c->stream;
    so.Consumer = "bare";
    if (natsConnection_ConnectTo(&nc, c->url) != NATS_OK ||
        natsConnection_JetStream(&js, nc, NULL) != NATS_OK ||
        js_PullSubscribe(&sub, js, c->in, "bare", NULL, &so, NULL) != NATS_OK) {
        goto out;
    }
    double end = now_s() + CELL_CAP_S;
    while (c->acked < c->messages && now_s() < end) {
        natsMsgList list = {0};
        natsSubscription_Fetch(&list, sub, FETCH_BATCH, 200, NULL);
        for (int i = 0; i < list.Count; i++) {
            if (natsMsg_AckSync(list.Msgs[i], NULL, NULL) == NATS_OK) {
                c->acked++;
            }
        }
        natsMsgList_Destroy(&list);
    }
out:
    natsSubscription_Destroy(sub);
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return NULL;
}

/* K bare consumers on the durable "bare"; msgs/s, or -1. */
static double run_bare(nats_cell *c, jsCtx *js, int k)
{
    jsConsumerConfig cc;
    jsConsumerInfo *ci = NULL;
    pthread_t t[MAX_CONSUMERS];
    jsConsumerConfig_Init(&cc);
    cc.Durable = "bare";
    cc.AckPolicy = js_AckExplicit;
    cc.FilterSubject = c->in;
    if (js_AddConsumer(&ci, js, c->stream, &cc, NULL, NULL) != NATS_OK) {
        return -1;
    }
    jsConsumerInfo_Destroy(ci);
    c->acked = 0;
    double start = now_s();
    for (int i = 0; i < k; i++) {
        pthread_create(&t[i], NULL, bare_main, c);
    }
    for (int i = 0; i < k; i++) {
        pthread_join(t[i], NULL);
    }
    return c->acked == c->messages ? (double)c->messages / (now_s() - start) : -1;
}

static idem_code effect(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    (void)arg;
    return idem_txn_put(t, "bench", m->key, strlen(m->key), "1", 1);
}

static uint64_t acked_sum(idem_nats_consumer *const *cs, int k)
{
    idem_nats_stats s;
    uint64_t sum = 0;
    for (int i = 0; i < k; i++) {
        idem_nats_consumer_stats(cs[i], &s);
        sum += s.acked;
    }
    return sum;
}

/* K idem_nats_consumers on the durable "idem", on a fresh LMDB store; msgs/s, or -1. */
static double run_idem(nats_cell *c, int k, unsigned store_flags)
{
    idem_nats_consumer *cs[MAX_CONSUMERS] = {0};
    idem_nats_consumer_opts o;
    idem_store *st = NULL;
    const char *dir = tmp_dir_create();
    double rate = -1;
    if (dir == NULL || idem_store_open_lmdb(&st, dir, LMDB_MAP_SIZE, store_flags) != IDEM_OK) {
        return -1;
    }
    idem_nats_consumer_opts_init(&o);
    o.url = c->url, o.stream = c->stream, o.durable = store_flags != 0 ? "idemnosync" : "idem";
    o.filter_subject = c->in, o.dead_letter_subject = c->dead, o.handler = effect;
    o.batch = FETCH_BATCH, o.fetch_wait_ms = 200;
    for (int i = 0; i < k; i++) {
        if (idem_nats_consumer_open(&cs[i], st, &o) != IDEM_OK) {
            fprintf(stderr, "w: consumer: %s\n", idem_errmsg());
            goto out;
        }
    }
    double start = now_s(), end = start + CELL_CAP_S;
    for (int i = 0; i < k; i++) {
        idem_nats_consumer_start(cs[i]);
    }
    while (acked_sum(cs, k) < c->messages && now_s() < end) {
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
    if (acked_sum(cs, k) == c->messages) {
        rate = (double)c->messages / (now_s() - start);
    }
out:
    for (int i = 0; i < k; i++) {
        idem_nats_consumer_close(cs[i]);
    }
    idem_store_close(st);
    tmp_dir_remove();
    return rate;
}

int run_nats(void)
{
    static const int consumers[] = {1, 8};
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    nats_cell c = {.url = getenv("IDEMRPC_BENCH_NATS")};
    int rc = 0;
    if (c.url == NULL || c.url[0] == '\0') {
        fprintf(stderr, "w: set $IDEMRPC_BENCH_NATS to a nats-server -js URL\n");
        return -1;
    }
    c.messages = cfg.count != 0 ? cfg.count : DEFAULT_MESSAGES;
    if (natsConnection_ConnectTo(&nc, c.url) != NATS_OK ||
        natsConnection_JetStream(&js, nc, NULL) != NATS_OK) {
        fprintf(stderr, "w: cannot reach %s\n", c.url);
        return -1;
    }
    printf("\nw: JetStream consume, %llu messages per cell (msgs/s; acked after the effect)\n",
           (unsigned long long)c.messages);
    printf("%-10s %12s %12s %12s %10s\n", "consumers", "bare", "idem", "idem-nosync", "idem/bare");
    for (size_t i = 0; i < sizeof(consumers) / sizeof(consumers[0]); i++) {
        if (cell_fill(&c, nc, js) != 0) {
            fprintf(stderr, "w: cannot fill a stream on %s\n", c.url);
            rc = -1;
            break;
        }
        double bare = run_bare(&c, js, consumers[i]);
        double idem = run_idem(&c, consumers[i], 0);
        double nosync = run_idem(&c, consumers[i], IDEM_STORE_NOSYNC);
        printf("%-10d %12.0f %12.0f %12.0f %10.2f\n", consumers[i], bare, idem, nosync,
               bare > 0 ? idem / bare : 0);
        rc |= bare < 0 || idem < 0 || nosync < 0 ? -1 : 0;
        js_DeleteStream(js, c.stream, NULL, NULL);
    }
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return rc;
}

/* The broker topology's run (--topology nats; processes and faults in chaos_nats.c):
 *
 *   1. the broker, the stream CHAOS (subjects chaos.commission and chaos.dead), the two
 *      producers (payments + relay) and the two consumers (one durable);
 *   2. K client threads charge payments through chaos.Pay/Charge, each under a key of
 *      its own, retried with that key until OK (or 30 s), while the fault schedule runs;
 *      kinds: 90 % ok, 6 % flaky, 2 % final, 2 % poison (chaos_nats_proc.c); one
 *      payment in 500 (ok or final) has a commission message at the broker's size limit
 *      (big_sizes: its max_payload, asked at the start, and around it), which the
 *      outbox may refuse at put (a definitive answer, not retried);
 *   3. the faults are healed and the run waits (at most 120 s) until the outbox is empty
 *      and the durable has nothing pending or unacked, three looks in a row;
 *   4. every message of the stream goes to DIR/stream.tsv (SEQ SUBJECT KEY REASON
 *      PAYLOAD, tab-separated), the processes and the broker stop, the broker's store
 *      DIR/nats is removed (everything else is kept), and the checker runs. */
#include <ftw.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nats/nats.h>

#include <idemrpc/idemrpc.h>
#include <idemrpc/nats.h>

#include "chaos.h"
#include "chaos_nats.h"

#define OP_PATIENCE_MS 30000 /* one payment retried with its key this long at most */
#define SETTLE_MS 120000

static int64_t max_payload; /* the broker's, asked once the stream is made */

typedef struct client_thread {
    const chaos_cfg *cfg;
    const volatile bool *stop;
    size_t id;
    uint64_t calls, ops, undecided;
} client_thread;

static const char *pick_kind(uint64_t *rng)
{
    uint64_t p = chaos_between(rng, 0, 99);
    return p < 2 ? "final" : p < 4 ? "poison" : p < 10 ? "flaky" : "ok";
}

/* The payload of a payment: "KIND AMOUNT", or with a third field, the size of its
 * commission message (chaos_nats_proc.c pads it): the broker's max_payload, one byte
 * over and under, less room for the relay's headers, or the outbox's documented maximum. */
static int payment_payload(uint64_t *rng, char *out, size_t cap, const char **kind)
{
    uint64_t amount = chaos_between(rng, 1, 100);
    if (max_payload <= 0 || chaos_between(rng, 0, 499) != 0) {
        *kind = pick_kind(rng);
        return snprintf(out, cap, "%s %" PRIu64, *kind, amount);
    }
    const int64_t big_sizes[] = {max_payload,       max_payload + 1,      max_payload - 1,
                                 max_payload - 256, IDEM_OUTBOX_MAX_DATA, IDEM_OUTBOX_MAX_DATA - 1};
    *kind = chaos_between(rng, 0, 3) == 0 ? "final" : "ok";
    return snprintf(out, cap, "%s %" PRIu64 " %" PRId64, *kind, amount,
                    big_sizes[chaos_between(rng, 0, 5)]);
}

/* A definitive refusal of a payment (not retried): only for a big message, at put. */
static bool refused(idem_code code)
{
    return code == IDEM_INVALID_ARGUMENT || code == IDEM_FAILED_PRECONDITION;
}

/* One payment under its own key, retried with that key until OK, a definitive refusal
 * or OP_PATIENCE_MS. */
static void one_payment(client_thread *ct, idem_client *cl, uint64_t *rng)
{
    char key[96], payload[48], code_name[32];
    const char *kind;
    snprintf(key, sizeof(key), "%s-%zu-%" PRIu64, ct->cfg->run, ct->id, ct->ops++);
    int n = payment_payload(rng, payload, sizeof(payload), &kind);
    const char *sf[] = {"key", key, "kind", kind, "payload", payload};
    if (strchr(payload, ' ') != strrchr(payload, ' ')) { /* a third field: its size */
        const char *bf[] = {"kind", "big_message", "key", key, "payload", payload};
        chaos_history_event("fault", 3, bf);
    }
    chaos_history_event("send", 3, sf);
    idem_request rq = {.method = CHAOS_METHOD_PAY,
                       .idempotency_key = key,
                       .payload = payload,
                       .payload_len = (size_t)n};
    idem_code code = IDEM_UNAVAILABLE;
    for (uint64_t end = chaos_now_ms() + OP_PATIENCE_MS;
         code != IDEM_OK && !refused(code) && chaos_now_ms() < end;) {
        idem_result r = {0};
        code = idem_client_call(cl, &rq, &r);
        ct->calls += r.attempts > 0 ? r.attempts : 1;
        idem_result_clear(&r);
        if (code != IDEM_OK && !refused(code)) {
            chaos_sleep_ms(50);
        }
    }
    snprintf(code_name, sizeof(code_name), "%s", idem_code_name(code));
    const char *rf[] = {"key", key, "code", code_name};
    chaos_history_event("recv", 2, rf);
    ct->undecided += code != IDEM_OK && !refused(code);
}

static void *client_main(void *arg)
{
    client_thread *ct = arg;
    idem_client_opts o;
    idem_client *cl = NULL;
    uint64_t rng = ct->cfg->seed * 0x2545f4914f6cdd1dull + ct->id + 1;
    const char *urls[] = {chaos_nats_producer_url(0), chaos_nats_producer_url(1)};
    idem_client_opts_init(&o);
    o.caller = ct->cfg->run;
    o.attempt_timeout_ms = 1000;
    o.deadline_ms = 4000;
    if (idem_client_open(&cl, urls, 2, &o) != IDEM_OK) {
        fprintf(stderr, "idemrpc-chaos: client: %s\n", idem_errmsg());
        return NULL;
    }
    while (!*ct->stop) {
        one_payment(ct, cl, &rng);
    }
    idem_client_close(cl);
    return NULL;
}

/* The load and the faults for cfg->seconds; *calls, *undecided: the clients' totals. */
static uint64_t load(const chaos_cfg *cfg, uint64_t *calls, uint64_t *ops, uint64_t *undecided)
{
    static volatile bool stop_clients, stop_faults;
    size_t k = (size_t)cfg->clients;
    client_thread *ct = calloc(k, sizeof(*ct));
    pthread_t *th = calloc(k, sizeof(*th)), fth;
    chaos_fault_thread ft = {chaos_nats_faults, cfg, &stop_faults, 0};
    if (ct == NULL || th == NULL) {
        free(ct);
        free(th);
        return 0;
    }
    pthread_create(&fth, NULL, chaos_fault_thread_main, &ft);
    for (size_t i = 0; i < k; i++) {
        ct[i] = (client_thread){.cfg = cfg, .stop = &stop_clients, .id = i};
        pthread_create(&th[i], NULL, client_main, &ct[i]);
    }
    chaos_sleep_ms(cfg->seconds * 1000);
    stop_clients = true;
    for (size_t i = 0; i < k; i++) {
        pthread_join(th[i], NULL);
        *calls += ct[i].calls, *ops += ct[i].ops, *undecided += ct[i].undecided;
    }
    stop_faults = true;
    pthread_join(fth, NULL);
    free(ct);
    free(th);
    return ft.faults;
}

static bool broker_connect(natsConnection **nc, jsCtx **js)
{
    natsOptions *o = NULL;
    natsStatus s = natsOptions_Create(&o);
    if (s == NATS_OK && (s = natsOptions_SetURL(o, chaos_nats_url())) == NATS_OK) {
        s = natsConnection_Connect(nc, o);
    }
    natsOptions_Destroy(o);
    if (s == NATS_OK && (s = natsConnection_JetStream(js, *nc, NULL)) != NATS_OK) {
        natsConnection_Destroy(*nc);
    }
    if (s != NATS_OK) {
        fprintf(stderr, "idemrpc-chaos: broker %s: %s\n", chaos_nats_url(), natsStatus_GetText(s));
    }
    return s == NATS_OK;
}

/* One look: the outbox's pending messages and the durable's pending and unacked ones. */
static bool look(jsCtx *js, idem_store *prod, uint64_t v[3])
{
    jsConsumerInfo *ci = NULL;
    if (idem_outbox_pending(prod, &v[0]) != IDEM_OK ||
        js_GetConsumerInfo(&ci, js, CHAOS_NATS_STREAM, CHAOS_NATS_DURABLE, NULL, NULL) != NATS_OK) {
        return false;
    }
    v[1] = ci->NumPending;
    v[2] = (uint64_t)ci->NumAckPending;
    jsConsumerInfo_Destroy(ci);
    return v[0] == 0 && v[1] == 0 && v[2] == 0;
}

/* Waits until three looks in a row find nothing left; records the last look. */
static void settle(const chaos_cfg *cfg, jsCtx *js)
{
    char dir[600], f[3][24];
    idem_store *prod = NULL;
    uint64_t v[3] = {UINT64_MAX, UINT64_MAX, UINT64_MAX};
    int quiet = 0;
    snprintf(dir, sizeof(dir), "%s/producer", cfg->dir);
    if (idem_store_open_lmdb(&prod, dir, 0, IDEM_STORE_READONLY) != IDEM_OK) {
        fprintf(stderr, "idemrpc-chaos: %s: %s\n", dir, idem_errmsg());
    }
    for (uint64_t end = chaos_now_ms() + SETTLE_MS;
         prod != NULL && chaos_now_ms() < end && quiet < 3;) {
        quiet = look(js, prod, v) ? quiet + 1 : 0;
        chaos_sleep_ms(250);
    }
    if (prod != NULL) {
        idem_store_close(prod);
    }
    for (int i = 0; i < 3; i++) {
        snprintf(f[i], sizeof(f[i]), "%" PRIu64, v[i]);
    }
    const char *ev[] = {"outbox", f[0], "pending", f[1], "unacked", f[2]};
    chaos_history_event("settled", 3, ev);
    printf("chaos: settled: outbox %s, durable %s pending and %s unacked\n", f[0], f[1], f[2]);
}

/* One stream message as a line of stream.tsv. */
static void dump_one(FILE *out, natsMsg *m, uint64_t seq)
{
    const char *key = NULL, *reason = NULL; /* "-": the header is absent */
    if (natsMsgHeader_Get(m, IDEM_NATS_KEY_HEADER, &key) != NATS_OK || key == NULL) {
        key = "-";
    }
    if (natsMsgHeader_Get(m, IDEM_NATS_DEAD_REASON, &reason) != NATS_OK || reason == NULL) {
        reason = "-";
    }
    int len = natsMsg_GetDataLength(m); /* the payload's first 64 bytes: it may be 1 MiB */
    fprintf(out, "%" PRIu64 "\t%s\t%s\t%s\t%.*s\n", seq, natsMsg_GetSubject(m), key, reason,
            len < 64 ? len : 64, natsMsg_GetData(m));
}

/* Every message of the stream into DIR/stream.tsv. */
static bool dump_stream(const chaos_cfg *cfg, jsCtx *js)
{
    char path[700];
    jsStreamInfo *si = NULL;
    snprintf(path, sizeof(path), "%s/stream.tsv", cfg->dir);
    FILE *out = fopen(path, "w");
    if (out == NULL || js_GetStreamInfo(&si, js, CHAOS_NATS_STREAM, NULL, NULL) != NATS_OK) {
        fprintf(stderr, "idemrpc-chaos: cannot dump the stream to %s\n", path);
        if (out != NULL) {
            fclose(out);
        }
        return false;
    }
    uint64_t first = si->State.FirstSeq, last = si->State.LastSeq, missing = 0;
    jsStreamInfo_Destroy(si);
    for (uint64_t seq = first; seq > 0 && seq <= last; seq++) {
        natsMsg *m = NULL;
        if (js_GetMsg(&m, js, CHAOS_NATS_STREAM, seq, NULL, NULL) != NATS_OK) {
            missing++;
            continue;
        }
        dump_one(out, m, seq);
        natsMsg_Destroy(m);
    }
    bool ok = fclose(out) == 0;
    char n[24], miss[24];
    snprintf(n, sizeof(n), "%" PRIu64, last);
    snprintf(miss, sizeof(miss), "%" PRIu64, missing);
    const char *ev[] = {"last_seq", n, "unreadable", miss};
    chaos_history_event("stream", 2, ev);
    return ok && missing == 0;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* The stream: file storage, the campaign's duplicate window (chaos.h). */
static natsStatus add_stream(jsCtx *js)
{
    const char *subjects[] = {CHAOS_NATS_SUBJECT, CHAOS_NATS_DEAD};
    jsStreamConfig sc;
    jsStreamInfo *si = NULL;
    jsStreamConfig_Init(&sc);
    sc.Name = CHAOS_NATS_STREAM;
    sc.Subjects = subjects;
    sc.SubjectsLen = 2;
    sc.Storage = js_FileStorage;
    sc.Duplicates = (int64_t)CHAOS_NATS_DUP_WINDOW_MS * 1000000;
    natsStatus s = js_AddStream(&si, js, &sc, NULL, NULL);
    jsStreamInfo_Destroy(si);
    return s;
}

/* Starts the producers and the consumers (the stream first: they bind to it). */
static bool start_all(const chaos_cfg *cfg)
{
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    natsStatus s = NATS_ERR;
    if (broker_connect(&nc, &js)) {
        for (int i = 0; i < 50 && (s = add_stream(js)) != NATS_OK; i++) {
            chaos_sleep_ms(200); /* JetStream is starting */
        }
        max_payload = natsConnection_GetMaxPayload(nc);
        printf("chaos: the broker's max_payload: %" PRId64 " bytes\n", max_payload);
        jsCtx_Destroy(js);
        natsConnection_Destroy(nc);
    }
    if (s != NATS_OK) {
        fprintf(stderr, "idemrpc-chaos: stream %s: %s\n", CHAOS_NATS_STREAM, natsStatus_GetText(s));
        return false;
    }
    for (size_t i = 0; i < NP_BROKER; i++) {
        if (!chaos_nats_start(i)) {
            fprintf(stderr, "idemrpc-chaos: process %zu did not start (logs in %s)\n", i, cfg->dir);
            return false;
        }
    }
    return true;
}

/* Heals, settles, dumps the stream and stops everything; false when the end could not
 * be read (a violation). */
static bool finish(const chaos_cfg *cfg)
{
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    bool ok = false;
    chaos_nats_heal();
    const char *f[] = {"phase", "begin"};
    chaos_history_event("settle", 1, f);
    if (broker_connect(&nc, &js)) {
        settle(cfg, js);
        ok = dump_stream(cfg, js);
        jsCtx_Destroy(js);
        natsConnection_Destroy(nc);
    }
    chaos_nats_stop(true);
    f[1] = "end";
    chaos_history_event("settle", 1, f);
    char store[600];
    snprintf(store, sizeof(store), "%s/nats", cfg->dir);
    nftw(store, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return ok;
}

int chaos_nats_run(const chaos_cfg *cfg)
{
    uint64_t calls = 0, ops = 0, undecided = 0;
    if (!chaos_nats_setup(cfg) || !start_all(cfg)) {
        chaos_nats_stop(true);
        chaos_history_close();
        return 1;
    }
    printf("chaos: broker %s, 2 producers with relays, 2 consumers on durable %s\n",
           chaos_nats_url(), CHAOS_NATS_DURABLE);
    fflush(stdout);
    uint64_t faults = load(cfg, &calls, &ops, &undecided);
    printf("chaos: %" PRIu64 " payments, %" PRIu64 " calls, %" PRIu64 " faults; %" PRIu64
           " payments undecided; settling\n",
           ops, calls, faults, undecided);
    fflush(stdout);
    bool ok = finish(cfg);
    chaos_history_close();
    uint64_t v = chaos_nats_check(cfg);
    if (!ok) {
        printf("chaos: the end state could not be read (the stream's dump): a violation\n");
    }
    return v == 0 && ok ? 0 : 1;
}

/* The processes of the broker topology (chaos_nats.c), this binary run in a role:
 *
 *   idemrpc-chaos --nats-producer --listen URL --db DIR --nats URL [--lease-ms N]
 *     a payments server and its outbox relay in one process (the "relay" the campaign
 *     kills): chaos.Pay/Charge (transactional, key required) writes the payment in app
 *     db "payments" and its commission message in the outbox, in the record's
 *     transaction; the relay publishes the outbox to CHAOS_NATS_SUBJECT.
 *   idemrpc-chaos --nats-consumer --db DIR --nats URL
 *     the commission service: the durable CHAOS_NATS_DURABLE through idem_consume, one
 *     effect per message id in app db "effects" (a count, so a second effect shows 2)
 *     and the sum of the credited amounts in app db "credit" (key "total").
 *
 * Payload "KIND AMOUNT": ok; flaky (the first 2 deliveries fail UNAVAILABLE after
 * writing: rolled back, then credited); final (INVALID_ARGUMENT: dead-lettered at once);
 * poison (every delivery fails UNAVAILABLE: dead-lettered after max_deliver). Both print
 * "ready" once serving and stop on SIGTERM. */
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>
#include <idemrpc/nats.h>

#include "chaos.h"
#include "cli.h"

#define OPEN_TRIES 100 /* 200 ms apart: a broker restart takes at most a few seconds */

static int events_fd = -1;

typedef struct proc_opts {
    const char *listen, *db, *nats, *events;
    uint64_t lease_ms;
} proc_opts;

static bool proc_parse(int argc, char **argv, proc_opts *po)
{
    static const struct option longs[] = {
        {"nats-producer", no_argument, NULL, 'P'}, {"nats-consumer", no_argument, NULL, 'C'},
        {"listen", required_argument, NULL, 'l'},  {"db", required_argument, NULL, 'd'},
        {"nats", required_argument, NULL, 'n'},    {"lease-ms", required_argument, NULL, 'L'},
        {"events", required_argument, NULL, 'e'},  {NULL, 0, NULL, 0}};
    int c;
    optind = 1;
    po->lease_ms = 500;
    while ((c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
        if (c == 'l') {
            po->listen = optarg;
        } else if (c == 'd') {
            po->db = optarg;
        } else if (c == 'n') {
            po->nats = optarg;
        } else if (c == 'e') {
            po->events = optarg;
        } else if (c == 'L') {
            if (!cli_parse_u64("idemrpc-chaos", "--lease-ms", optarg, 1, 600000, &po->lease_ms)) {
                return false;
            }
        } else if (c != 'P' && c != 'C') {
            return false;
        }
    }
    if (po->db == NULL || po->nats == NULL || po->events == NULL) {
        fprintf(stderr, "usage: idemrpc-chaos --nats-producer --listen URL --db DIR --nats URL "
                        "--events FILE\n"
                        "       idemrpc-chaos --nats-consumer --db DIR --nats URL --events FILE\n");
        return false;
    }
    if ((events_fd = open(po->events, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600)) < 0) {
        perror(po->events);
        return false;
    }
    return true;
}

/* One line "WHAT KEY PID MONOTONIC_MS" of the events file (one write on an O_APPEND fd): the
 * checker's evidence that the faults hit the windows the guards are for. */
static void event_line(const char *what, const char *key)
{
    char line[400];
    int n = snprintf(line, sizeof(line), "%s %s %d %" PRIu64 "\n", what, key, (int)getpid(),
                     chaos_now_ms());
    if (n > 0 && (size_t)n < sizeof(line) && write(events_fd, line, (size_t)n) != n) {
        perror("events"); /* evidence only: the run goes on */
    }
}

/* The relay's publish was acked as a duplicate: the broker's dedupe dropped a copy. */
static void on_published(const idem_outbox_msg *m, bool duplicate, void *arg)
{
    (void)arg;
    if (duplicate) {
        event_line("relay_dup", m->msg_id);
    }
}

/* A delivery acked without running (its marker was found), or one dead-lettered. */
static void on_event(idem_nats_event ev, const idem_nats_msg *m, const char *reason, void *arg)
{
    (void)reason, (void)arg;
    if (ev == IDEM_NATS_DUPLICATE || ev == IDEM_NATS_DEAD_LETTERED) {
        event_line(ev == IDEM_NATS_DUPLICATE ? "consumer_dup" : "dead", m->key);
    }
}

/* Blocks SIGTERM (sigwait takes it), prints "ready", waits for it. */
static void ready_then_wait(const sigset_t *term)
{
    int sig;
    printf("ready\n");
    fflush(stdout);
    sigwait(term, &sig);
}

static void block_term(sigset_t *term)
{
    sigemptyset(term);
    sigaddset(term, SIGTERM);
    pthread_sigmask(SIG_BLOCK, term, NULL);
}

/* The commission message of payment p ("KIND AMOUNT [SIZE]"): p itself, or p padded
 * with spaces to SIZE bytes (a message at the broker's size limit); malloc'd, *len. */
static char *commission(const char *p, size_t n, size_t *len)
{
    char buf[72] = {0};
    unsigned long long size = 0;
    memcpy(buf, p, n < sizeof(buf) - 1 ? n : sizeof(buf) - 1);
    *len = sscanf(buf, "%*s %*d %llu", &size) == 1 && size > n && size <= (64u << 20) ? size : n;
    char *data = malloc(*len);
    if (data != NULL) {
        memset(data, ' ', *len);
        memcpy(data, p, n);
    }
    return data;
}

/* chaos.Pay/Charge: the payment and its commission message, one transaction. */
static idem_code charge(idem_call *call, void *arg)
{
    (void)arg;
    size_t n, len;
    const char *p = idem_call_payload(call, &n);
    const char *key = idem_call_key(call);
    char msg_id[IDEM_OUTBOX_MAX_MSG_ID + 1];
    if (n == 0 || n > 64) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "bad payment");
    }
    char *data = commission(p, n, &len);
    if (data == NULL) {
        return idem_call_fail(call, IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    snprintf(msg_id, sizeof(msg_id), "%s", key);
    idem_txn *t = idem_call_txn(call);
    idem_code code = idem_txn_put(t, "payments", key, strlen(key), p, n);
    if (code == IDEM_OK) {
        code = idem_outbox_put(t, CHAOS_NATS_SUBJECT, msg_id, data, len);
    }
    free(data);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    char out[128];
    int rl = snprintf(out, sizeof(out), "pid=%d key=%s", (int)getpid(), key);
    return idem_call_reply(call, IDEM_OK, out, (size_t)rl);
}

int chaos_nats_producer(int argc, char **argv)
{
    proc_opts po = {0};
    idem_server_opts o;
    idem_server *srv = NULL;
    idem_nats_relay_opts ro;
    idem_nats_relay *relay = NULL;
    sigset_t term;
    if (!proc_parse(argc, argv, &po) || po.listen == NULL) {
        return CLI_USAGE_ERROR;
    }
    block_term(&term);
    idem_server_opts_init(&o);
    o.lease_ms = po.lease_ms;
    o.workers = 4;
    o.sweep_interval_ms = 3600 * 1000;
    o.db_path = po.db;
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    if (idem_server_create(&srv, &o) != IDEM_OK ||
        idem_server_register(srv, CHAOS_METHOD_PAY, charge, NULL, &tx) != IDEM_OK ||
        idem_server_listen(srv, po.listen) != IDEM_OK) {
        fprintf(stderr, "chaos producer: %s\n", idem_errmsg());
        return 1;
    }
    idem_nats_relay_opts_init(&ro);
    ro.url = po.nats;
    ro.idle_ms = 20;
    ro.publish_wait_ms = 2000;
    ro.on_published = on_published;
    idem_code code;
    for (int i = 0;
         (code = idem_nats_relay_open(&relay, idem_server_store(srv), &ro)) == IDEM_UNAVAILABLE &&
         i < OPEN_TRIES;
         i++) {
        chaos_sleep_ms(200); /* the broker is restarting */
    }
    if (code != IDEM_OK || idem_nats_relay_start(relay) != IDEM_OK) {
        fprintf(stderr, "chaos producer: relay: %s\n", idem_errmsg());
        return 1;
    }
    ready_then_wait(&term);
    idem_nats_relay_close(relay);
    idem_server_destroy(srv);
    return 0;
}

static long long ll_get(idem_txn *t, const char *db, const char *key, idem_code *code)
{
    const void *v;
    size_t n;
    long long x = 0;
    *code = idem_txn_get(t, db, key, strlen(key), &v, &n);
    if (*code == IDEM_OK && n == sizeof(x)) {
        memcpy(&x, v, sizeof(x));
    } else if (*code == IDEM_OK) {
        *code = IDEM_INTERNAL;
    }
    if (*code == IDEM_NOT_FOUND) {
        *code = IDEM_OK;
    }
    return x;
}

static idem_code ll_add(idem_txn *t, const char *db, const char *key, long long d)
{
    idem_code code;
    long long x = ll_get(t, db, key, &code) + d;
    return code != IDEM_OK ? code : idem_txn_put(t, db, key, strlen(key), &x, sizeof(x));
}

/* The commission's effect: counted per message id, its amount added to the total; then
 * the payload's kind decides whether the delivery fails (rolling both back). */
static idem_code credit(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    (void)arg;
    char buf[72] = {0}, kind[16] = "";
    long long amount = 0;
    memcpy(buf, m->data, m->len < sizeof(buf) - 1 ? m->len : sizeof(buf) - 1);
    if (sscanf(buf, "%15s %lld", kind, &amount) != 2 || amount <= 0) {
        return IDEM_INVALID_ARGUMENT;
    }
    if (strcmp(kind, "final") == 0) {
        return IDEM_INVALID_ARGUMENT;
    }
    idem_code code = ll_add(t, "effects", m->key, 1);
    if (code == IDEM_OK) {
        code = ll_add(t, "credit", "total", amount);
    }
    if (code != IDEM_OK) {
        return code;
    }
    if (strcmp(kind, "poison") == 0 || (strcmp(kind, "flaky") == 0 && m->delivered <= 2)) {
        return IDEM_UNAVAILABLE;
    }
    return IDEM_OK;
}

int chaos_nats_consumer(int argc, char **argv)
{
    proc_opts po = {0};
    idem_store *st = NULL;
    idem_nats_consumer_opts o;
    idem_nats_consumer *c = NULL;
    sigset_t term;
    if (!proc_parse(argc, argv, &po)) {
        return CLI_USAGE_ERROR;
    }
    block_term(&term);
    if (idem_store_open_lmdb(&st, po.db, 0, 0) != IDEM_OK) {
        fprintf(stderr, "chaos consumer: %s: %s\n", po.db, idem_errmsg());
        return 1;
    }
    idem_nats_consumer_opts_init(&o);
    o.url = po.nats;
    o.stream = CHAOS_NATS_STREAM;
    o.durable = CHAOS_NATS_DURABLE;
    o.filter_subject = CHAOS_NATS_SUBJECT;
    o.dead_letter_subject = CHAOS_NATS_DEAD;
    o.handler = credit;
    o.max_deliver = CHAOS_NATS_MAX_DELIVER;
    o.ack_wait_ms = CHAOS_NATS_ACK_WAIT_MS;
    o.backoff_ms = 50;
    o.backoff_max_ms = 1000;
    o.fetch_wait_ms = 200;
    o.on_event = on_event;
    idem_code code;
    for (int i = 0;
         (code = idem_nats_consumer_open(&c, st, &o)) == IDEM_UNAVAILABLE && i < OPEN_TRIES; i++) {
        chaos_sleep_ms(200); /* the broker is restarting */
    }
    if (code != IDEM_OK || idem_nats_consumer_start(c) != IDEM_OK) {
        fprintf(stderr, "chaos consumer: %s\n", idem_errmsg());
        return 1;
    }
    ready_then_wait(&term);
    idem_nats_consumer_close(c);
    idem_store_close(st);
    return 0;
}

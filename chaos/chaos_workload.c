/* The workload: cfg->clients threads, each with a patient idem_client (retries inside,
 * then retried again with the same key until a definitive answer or the operation's
 * deadline) and an impatient one (one attempt of 30 ms: a caller that gives up).
 *
 * A logical operation (one caller, one key or token, one payload) is queued in copies:
 * one, two (a double click), ten (a payment callback redelivered), or one impatient
 * copy; a cached add is sometimes also sent by a second caller under the same key
 * (keys are scoped by caller: each must get its own result). A journaled Book is
 * abandoned four times in ten (one impatient copy, mode "abandoned"): its client never
 * comes back, so when a kill lands between its steps only the servers' re-driver can
 * finish it. Idle threads take copies from the queue, so the copies of one operation
 * run concurrently. Every operation stays in `ops` for the settle pass, which retries
 * the undecided ones, except abandoned Books (the checker reads their outcome from the
 * store: the re-driver's work). One patient call in GRPC_SHARE (any copy, any retry) goes
 * through a server's gRPC front instead of nng, in a build with it: the history names
 * each call's front, and the checker wants one effect and one answer per key across
 * both. */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idemrpc/idemrpc.h>

#include "chaos.h"

typedef enum op_kind { OP_TRANSFER, OP_ORDER, OP_ADD, OP_BOOK } op_kind;

typedef struct op {
    op_kind kind;
    uint64_t id;
    char caller[64], key[160], payload[64]; /* key: the idempotency key or the token */
    bool decided;
    bool abandoned; /* a Book whose client gave up: the settle pass leaves it alone */
} op;

typedef struct copy {
    op *o;
    bool impatient;
} copy;

#define QUEUE_CAP 4096

static struct {
    pthread_mutex_t mu;
    copy queue[QUEUE_CAP];
    size_t head, len;
    op **ops;
    size_t n_ops, cap_ops;
    uint64_t calls, next_id;
} wl = {.mu = PTHREAD_MUTEX_INITIALIZER};

static const chaos_cfg *cfg;

#define GRPC_SHARE 4
static _Thread_local uint64_t front_rng; /* the thread's draws of a front: from its seed */

typedef struct worker {
    pthread_t th;
    size_t index;
    uint64_t rng;
    idem_client *patient, *impatient;
    const volatile bool *stop;
} worker;

static const char *method_of(op_kind k)
{
    return k == OP_TRANSFER ? CHAOS_METHOD_TRANSFER
           : k == OP_ORDER  ? CHAOS_METHOD_ORDER
           : k == OP_ADD    ? CHAOS_METHOD_ADD
                            : CHAOS_METHOD_BOOK;
}

static bool definitive(idem_code c)
{
    return c == IDEM_OK || c == IDEM_FAILED_PRECONDITION || c == IDEM_INVALID_ARGUMENT ||
           c == IDEM_PERMISSION_DENIED;
}

static void push(op *o, bool impatient)
{
    pthread_mutex_lock(&wl.mu);
    if (wl.len < QUEUE_CAP) {
        wl.queue[(wl.head + wl.len++) % QUEUE_CAP] = (copy){o, impatient};
    }
    pthread_mutex_unlock(&wl.mu);
}

static bool pop(copy *out)
{
    pthread_mutex_lock(&wl.mu);
    bool got = wl.len > 0;
    if (got) {
        *out = wl.queue[wl.head];
        wl.head = (wl.head + 1) % QUEUE_CAP;
        wl.len--;
    }
    pthread_mutex_unlock(&wl.mu);
    return got;
}

static op *op_new(op_kind kind, const char *caller)
{
    op *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&wl.mu);
    if (wl.n_ops == wl.cap_ops) {
        size_t cap = wl.cap_ops ? wl.cap_ops * 2 : 4096;
        op **grown = realloc(wl.ops, cap * sizeof(*grown));
        if (grown == NULL) {
            pthread_mutex_unlock(&wl.mu);
            free(o);
            return NULL;
        }
        wl.ops = grown;
        wl.cap_ops = cap;
    }
    wl.ops[wl.n_ops++] = o;
    o->id = wl.next_id++;
    pthread_mutex_unlock(&wl.mu);
    o->kind = kind;
    snprintf(o->caller, sizeof(o->caller), "%s", caller);
    return o;
}

static void record_send(const op *o, const char *mode, const char *front)
{
    char id[24];
    snprintf(id, sizeof(id), "%" PRIu64, o->id);
    const char *f[] = {"op",    id,     "method",  method_of(o->kind), "caller", o->caller,
                       "key",   o->key, "payload", o->payload,         "mode",   mode,
                       "front", front};
    chaos_history_event("send", 7, f);
}

static void record_recv(const op *o, const idem_result *r, idem_code code, const char *front)
{
    char id[24], digest[24], attempts[16], body[512];
    const char *text = code == IDEM_OK ? NULL : r->message;
    if (text == NULL) {
        size_t n = r->payload_len < sizeof(body) - 1 ? r->payload_len : sizeof(body) - 1;
        memcpy(body, r->payload != NULL ? r->payload : "", n);
        body[n] = '\0';
    } else {
        snprintf(body, sizeof(body), "%s", text);
    }
    snprintf(id, sizeof(id), "%" PRIu64, o->id);
    snprintf(digest, sizeof(digest), "%016" PRIx64, chaos_digest(body, strlen(body)));
    snprintf(attempts, sizeof(attempts), "%u", r->attempts);
    const char *f[] = {"op",       id,
                       "method",   method_of(o->kind),
                       "caller",   o->caller,
                       "key",      o->key,
                       "code",     idem_code_name(code),
                       "replayed", r->replayed ? "true" : "false",
                       "digest",   digest,
                       "body",     body,
                       "attempts", attempts,
                       "front",    front};
    chaos_history_event("recv", 10, f);
}

/* A gRPC front's port one time in GRPC_SHARE (a build with it, a server that has one),
 * else 0: the call goes through nng. */
static int grpc_port(void)
{
    int port = 0;
    uint64_t x = chaos_rand(&front_rng);
#ifdef CHAOS_HAVE_GRPC
    if (x % GRPC_SHARE == 0) {
        sscanf(chaos_server_grpc((size_t)(x / GRPC_SHARE) % CHAOS_SERVERS), "tcp://127.0.0.1:%d",
               &port);
    }
#endif
    (void)x;
    return port;
}

/* One idem_client_call of o; true when the answer was definitive. *debounced: the
 * answer was the debounce window's "duplicate submit" (worth waiting out). */
static bool call_once_(idem_client *c, op *o, const char *mode, uint32_t deadline_ms,
                       bool *debounced)
{
    idem_request q = {.method = method_of(o->kind),
                      .caller = o->caller,
                      .payload = o->payload,
                      .payload_len = strlen(o->payload),
                      .deadline_ms = deadline_ms};
    if (o->kind == OP_ORDER) {
        q.token = o->key;
    } else {
        q.idempotency_key = o->key;
    }
    idem_result r;
    bool patient = strcmp(mode, "impatient") != 0 && strcmp(mode, "abandoned") != 0;
    int port = patient ? grpc_port() : 0;
    const char *front = port > 0 ? "grpc" : "nng";
    record_send(o, mode, front);
    idem_code code;
#ifdef CHAOS_HAVE_GRPC
    code = port > 0 ? chaos_grpc_call(port, &q, &r) : idem_client_call(c, &q, &r);
#else
    code = idem_client_call(c, &q, &r);
#endif
    record_recv(o, &r, code, front);
    if (debounced != NULL) {
        *debounced = code == IDEM_ALREADY_EXISTS;
    }
    idem_result_clear(&r);
    pthread_mutex_lock(&wl.mu);
    wl.calls++;
    bool done = definitive(code);
    o->decided = o->decided || done;
    pthread_mutex_unlock(&wl.mu);
    return done;
}

static bool call_once(idem_client *c, op *o, const char *mode, uint32_t deadline_ms)
{
    return call_once_(c, o, mode, deadline_ms, NULL);
}

/* Retries o with the same key until it is decided or budget_ms has passed. */
static void run_patiently(idem_client *c, op *o, uint64_t budget_ms, const char *mode)
{
    uint64_t end = chaos_now_ms() + budget_ms;
    bool debounced = false;
    while (chaos_now_ms() < end && !call_once_(c, o, mode, 4000, &debounced)) {
        chaos_sleep_ms(debounced ? 150 : 50); /* a window of 200 ms: the next try passes */
    }
}

static bool issue_token(worker *w, op *o)
{
    uint64_t expires, end = chaos_now_ms() + 5000;
    while (chaos_now_ms() < end && !*w->stop) {
        if (idem_client_issue_token(w->patient, o->caller, o->key, sizeof(o->key), &expires) ==
            IDEM_OK) {
            return true;
        }
        chaos_sleep_ms(50);
    }
    return false;
}

/* Makes a new operation, queues its extra copies and returns the one to run now. */
static op *generate(worker *w, bool *impatient)
{
    char caller[64];
    uint64_t pick = chaos_between(&w->rng, 0, 99), copies = chaos_between(&w->rng, 0, 99);
    op_kind kind = pick < 35 ? OP_TRANSFER : pick < 57 ? OP_ORDER : pick < 80 ? OP_ADD : OP_BOOK;
    snprintf(caller, sizeof(caller), "%s-c%zu", cfg->run, w->index);
    op *o = op_new(kind, caller);
    if (o == NULL) {
        return NULL;
    }
    if (kind == OP_ORDER && !issue_token(w, o)) {
        o->decided = true; /* nothing was submitted */
        return NULL;
    }
    if (kind != OP_ORDER) {
        snprintf(o->key, sizeof(o->key), "%s-k%" PRIu64, cfg->run, o->id);
    }
    if (kind == OP_TRANSFER) {
        uint64_t a = chaos_between(&w->rng, 0, CHAOS_ACCOUNTS - 1);
        uint64_t b = (a + chaos_between(&w->rng, 1, CHAOS_ACCOUNTS - 1)) % CHAOS_ACCOUNTS;
        snprintf(o->payload, sizeof(o->payload), "%" PRIu64 " %" PRIu64 " %" PRIu64, a, b,
                 chaos_between(&w->rng, 1, 300));
    } else { /* a Book in four is declined: its hold is undone (chaos_server.c) */
        bool decline = kind == OP_BOOK && chaos_between(&w->rng, 0, 3) == 0;
        snprintf(o->payload, sizeof(o->payload), "%s%" PRIu64, decline ? "decline " : "",
                 chaos_between(&w->rng, 1, 9));
    }
    *impatient = copies < 10 || (kind == OP_BOOK && copies < 40);
    o->abandoned = kind == OP_BOOK && *impatient;
    if (copies >= 70 && copies < 85) {
        push(o, false); /* a double click */
    } else if (copies >= 85 && copies < 90) {
        for (int i = 0; i < 9; i++) {
            push(o, false); /* a callback delivered ten times */
        }
    } else if (copies >= 90 && kind == OP_ADD) {
        snprintf(caller, sizeof(caller), "%s-c%zu-other", cfg->run, w->index);
        op *other = op_new(OP_ADD, caller);
        if (other != NULL) {
            memcpy(other->key, o->key, sizeof(o->key));
            memcpy(other->payload, o->payload, sizeof(o->payload));
            push(other, false); /* another caller, the same key string */
        }
    }
    return o;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    front_rng = w->rng ^ 0x9e3779b97f4a7c15ull;
    while (!*w->stop) {
        copy c = {0};
        if (!pop(&c) && (c.o = generate(w, &c.impatient)) == NULL) {
            continue;
        }
        if (c.impatient) {
            call_once(w->impatient, c.o, c.o->abandoned ? "abandoned" : "impatient", 30);
        } else {
            run_patiently(w->patient, c.o, 8000, "patient");
        }
    }
    return NULL;
}

static bool clients_open(worker *w)
{
    const char *urls[CHAOS_SERVERS];
    idem_client_opts p, q;
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        urls[i] = chaos_server_url(i);
    }
    idem_client_opts_init(&p);
    p.attempt_timeout_ms = 1000;
    p.deadline_ms = 4000;
    p.retry.period_ms = 50;
    p.retry.max_period_ms = 400;
    idem_client_opts_init(&q);
    q.attempt_timeout_ms = 30;
    q.deadline_ms = 30;
    q.retry.max_attempts = 1;
    return idem_client_open(&w->patient, urls, CHAOS_SERVERS, &p) == IDEM_OK &&
           idem_client_open(&w->impatient, urls, CHAOS_SERVERS, &q) == IDEM_OK;
}

static void tally(chaos_totals *out)
{
    pthread_mutex_lock(&wl.mu);
    out->calls = wl.calls;
    out->ops = wl.n_ops;
    out->decided = out->undecided = out->abandoned = 0;
    for (size_t i = 0; i < wl.n_ops; i++) {
        if (wl.ops[i]->abandoned && !wl.ops[i]->decided) {
            out->abandoned++; /* left to the re-driver, judged from the store */
        } else {
            (wl.ops[i]->decided ? &out->decided : &out->undecided)[0]++;
        }
    }
    pthread_mutex_unlock(&wl.mu);
}

static void run_workers(size_t n, void *(*fn)(void *), const volatile bool *stop)
{
    worker *ws = calloc(n, sizeof(*ws));
    for (size_t i = 0; ws != NULL && i < n; i++) {
        ws[i] = (worker){.index = i, .rng = cfg->seed * 1000003 + i + 1, .stop = stop};
        if (!clients_open(&ws[i]) || pthread_create(&ws[i].th, NULL, fn, &ws[i]) != 0) {
            fprintf(stderr, "idemrpc-chaos: client %zu did not start\n", i);
            ws[i].th = 0;
        }
    }
    for (size_t i = 0; ws != NULL && i < n; i++) {
        if (ws[i].th != 0) {
            pthread_join(ws[i].th, NULL);
        }
        idem_client_close(ws[i].patient);
        idem_client_close(ws[i].impatient);
    }
    free(ws);
}

void chaos_workload_run(const chaos_cfg *c, const volatile bool *stop, chaos_totals *out)
{
    cfg = c;
    run_workers(c->clients, worker_main, stop);
    tally(out);
}

static size_t settle_next;
static uint64_t settle_deadline; /* the settle pass is bounded too */

static void *settle_main(void *arg)
{
    worker *w = arg;
    front_rng = w->rng ^ 0x9e3779b97f4a7c15ull;
    for (;;) {
        pthread_mutex_lock(&wl.mu);
        op *o = settle_next < wl.n_ops ? wl.ops[settle_next++] : NULL;
        pthread_mutex_unlock(&wl.mu);
        if (o == NULL) {
            return NULL;
        }
        if (!o->decided && !o->abandoned && chaos_now_ms() < settle_deadline) {
            run_patiently(w->patient, o, 15000, "settle");
        }
    }
}

void chaos_workload_settle(const chaos_cfg *c, chaos_totals *out)
{
    static const bool never = false;
    cfg = c;
    settle_next = 0;
    settle_deadline = chaos_now_ms() + 90000;
    run_workers(8, settle_main, &never);
    tally(out);
}

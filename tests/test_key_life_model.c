/* A key's life checked against a model, exhaustively up to a depth (issue 36, item 2):
 * `key_life_model` on LMDB, `key_life_model_pg` on PostgreSQL (IDEMRPC_TEST_BACKEND=
 * postgres; skipped when IDEMRPC_TEST_PG is unset). A real server process
 * (model_server.c) runs a journaled method whose step reserves at an inventory this test
 * runs and counts; every event below goes through it, and after each one the answer
 * (code, replayed, idem-compensated, idem-result-gone, or "the server died") and the
 * counts (reservations held, undos run, handler runs) are compared with a small
 * reference model (model_request / model_event).
 *
 * The alphabet, one key, two requests under it (A and B: same key, other payloads):
 *   A ok, A fail (final error, no step), A transient (UNAVAILABLE, no step), A undo ok (a
 *   step, then a validation error; the undo runs), A undo stuck (the same; the undo meets
 *   the inventory down), B ok; A ok killed -9 at each store write of its call: after the
 *   claim's commit, after the step's effect (before its record), after the step's record,
 *   after the outcome's commit (the server restarts on the store and the dead claim's
 *   lease lapses before the next event: a live dead owner's lease only parks a
 *   duplicate, test_lease's subject); a re-driver pass (the inventory up); the TTL
 *   sweep (on LMDB with a tombstone horizon: results become tombstones); an operator's
 *   forget (idem_store_delete, as idemctl delete). B's other outcomes are A's with the
 *   roles swapped: what distinguishes B is only that the key is another request's.
 *
 * Exhaustive up to state equivalence: the model state (record: none / in progress with a
 * lapsed lease / completed / tombstone, whose, its outcome class; the journal: none /
 * listed / a step recorded / compensating, whose, and whether its reservation was made)
 * is explored breadth first, each distinct state's successors once, from the first
 * sequence that reached it; the counts are not state (they are compared, not explored).
 * Depth 4 by default: the shortest sequence to the abandoned compensation is 3 (A undo
 * stuck, B ok, a re-driver pass) and the fourth event checks what is left of it (A's
 * retry, a sweep, a forget). Every reachable model state is reached within 3 events
 * (22 on LMDB, 19 on PostgreSQL), so depth 4 checks every event from every state. Past
 * 4 (IDEMRPC_MODEL_DEPTH, the campaign's), a state at another depth is another node:
 * each state's successors are checked again from sequences of every length up to the
 * depth, for state the model does not have (a forget that left the tombstone behind
 * showed up that way, in the harness).
 *
 * Crash points are in the server at the boundaries of the call's writes, not an
 * interposed commit: the PostgreSQL store writes most of a call in single autocommit
 * statements (no COMMIT to count), and on LMDB a lease renewal may commit in the middle
 * of a call, so "the Nth commit" would not name the same write in every run. */
#include <criterion/criterion.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "idemrpc.pb-c.h"
#include "key_life_model.h"
#include "testutil.h"

#define PLACE "model.Order/Place"
#define MAX_DEPTH 8
#define MAX_NODES 1024

/* ---- the real system ---- */

static tu_server inv;
static atomic_int inventory_down;
static pthread_mutex_t key_mu = PTHREAD_MUTEX_INITIALIZER;
static char key[32];           /* this sequence's key (one store serves them all) */
static int reserved, released; /* this key's, under key_mu */
static char *pg_conninfo;      /* the test's schema; NULL on LMDB */
static char pg_schema[32];
static char *dir, url[300], inv_url[64];
static tu_child child;
static int run_no;

/* Whether the downstream payload p names this sequence's key ("KEY" or "KEY R<n>"). */
static bool this_key(const char *p, size_t n)
{
    size_t k = strlen(key);
    return n >= k && memcmp(p, key, k) == 0 && (n == k || p[k] == ' ');
}

/* inv.Stock/Reserve KEY → "KEY R<n>", once per (derived) key: the inventory caches. */
static idem_code inv_reserve(idem_call *call, void *arg)
{
    char out[64];
    size_t n;
    const char *p = idem_call_payload(call, &n);
    (void)arg;
    pthread_mutex_lock(&key_mu);
    int r = this_key(p, n) ? ++reserved : 0;
    pthread_mutex_unlock(&key_mu);
    int len = snprintf(out, sizeof(out), "%.*s R%d", (int)(n < 32 ? n : 32), p, r);
    return idem_call_reply(call, IDEM_OK, out, (size_t)len);
}

/* inv.Stock/Release "KEY R<n>": gives it back, unless the inventory is down. */
static idem_code inv_release(idem_call *call, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    (void)arg;
    if (atomic_load(&inventory_down)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "inventory down");
    }
    pthread_mutex_lock(&key_mu);
    released += this_key(p, n);
    pthread_mutex_unlock(&key_mu);
    return idem_call_reply(call, IDEM_OK, "released", 8);
}

static void setup(void)
{
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    tu_server_create(&inv, NULL);
    cr_assert_eq(idem_server_register(inv.srv, "inv.Stock/Reserve", inv_reserve, NULL, &m),
                 IDEM_OK);
    cr_assert_eq(idem_server_register(inv.srv, "inv.Stock/Release", inv_release, NULL, &m),
                 IDEM_OK);
    tu_server_listen(&inv);
    snprintf(inv_url, sizeof(inv_url), "%s", inv.url);
}

static void store_end(void);

static void teardown(void)
{
    if (dir != NULL) { /* a test that failed half way */
        store_end();
    }
    tu_server_destroy(&inv, false);
}

TestSuite(key_life_model, .init = setup, .fini = teardown, .timeout = 280);

static void spawn(void)
{
    const char *argv[] = {getenv("MODEL_SERVER"),
                          "--listen",
                          url,
                          "--db",
                          dir,
                          "--inv",
                          inv_url,
                          "--tombstone-ms",
                          pg_conninfo != NULL ? "0" : "604800000",
                          pg_conninfo != NULL ? "--pg" : NULL,
                          pg_conninfo,
                          NULL};
    tu_spawn(&child, argv);
}

static void aio_done(void *arg)
{
    atomic_store((atomic_bool *)arg, true);
}

/* One exchange with the server: the response, or NULL when it died first (died) or
 * did not answer. Waits on the reply and on the server's stdout (EOF: it died). */
static Idem__V1__Response *exchange(const char *method, const char *k, const char *payload,
                                    bool *died)
{
    size_t len;
    void *frame = tu_pack_request(method, k, NULL, payload, &len);
    nng_socket s;
    nng_aio *aio;
    nng_msg *m;
    Idem__V1__Response *r = NULL;
    *died = false;
    cr_assert_eq(nng_req0_open(&s), 0);
    cr_assert_eq(nng_dial(s, url, NULL, 0), 0, "dial %s", url);
    atomic_bool done = false;
    cr_assert_eq(nng_aio_alloc(&aio, aio_done, &done), 0);
    nng_aio_set_timeout(aio, 10000);
    cr_assert_eq(nng_msg_alloc(&m, 0), 0);
    cr_assert_eq(nng_msg_append(m, frame, len), 0);
    free(frame);
    cr_assert_eq(nng_sendmsg(s, m, 0), 0);
    nng_recv_aio(s, aio);
    struct pollfd pfd = {.fd = fileno(child.out), .events = POLLIN};
    for (int i = 0; i < 1100 && !atomic_load(&done) && !*died; i++) { /* bounded: 11 s */
        *died = poll(&pfd, 1, 10) == 1;
    }
    if (*died) {
        nng_aio_cancel(aio);
    }
    nng_aio_wait(aio);
    if (nng_aio_result(aio) == 0) {
        m = nng_aio_get_msg(aio);
        r = idem__v1__response__unpack(NULL, nng_msg_len(m), nng_msg_body(m));
        nng_msg_free(m);
        *died = false;
    }
    nng_aio_free(aio);
    nng_close(s);
    return r;
}

static void control(const char *method, const char *payload)
{
    bool died;
    Idem__V1__Response *r = exchange(method, NULL, payload, &died);
    cr_assert_not_null(r, "%s: no answer", method);
    cr_assert_eq(r->code, IDEM__V1__CODE__OK, "%s: %s", method, r->message);
    idem__v1__response__free_unpacked(r, NULL);
}

static bool lease_live(void)
{
    bool died;
    Idem__V1__Response *r = exchange("model.Ctl/Lease", NULL, key, &died);
    cr_assert_not_null(r);
    bool live = r->payload.len == 4 && memcmp(r->payload.data, "live", 4) == 0;
    idem__v1__response__free_unpacked(r, NULL);
    return live;
}

/* After a kill -9: the server again on the store, and the dead claim's lease lapsed. */
static void restart_after_crash(void)
{
    cr_assert_eq(tu_reap(&child), SIGKILL, "model_server was killed at its crash point");
    spawn();
    struct timespec pause = {0, 5 * 1000000};
    for (int i = 0; i < 2000 && lease_live(); i++) { /* bounded: 10 s, for a 150 ms lease */
        nanosleep(&pause, NULL);
    }
    cr_assert_not(lease_live(), "the dead claim's lease lapsed");
}

static const char *meta(const Idem__V1__Response *r, const char *name)
{
    for (size_t i = 0; i < r->n_metadata; i++) {
        if (strcmp(r->metadata[i]->key, name) == 0) {
            return r->metadata[i]->value;
        }
    }
    return NULL;
}

static answer real_request(const char *who, const char *outcome, const char *point, bool down)
{
    char set[40];
    bool died;
    snprintf(set, sizeof(set), "%s %s", outcome, point);
    control("model.Ctl/Set", set);
    atomic_store(&inventory_down, down);
    Idem__V1__Response *r = exchange(PLACE, key, who, &died);
    atomic_store(&inventory_down, 0);
    if (died) {
        restart_after_crash();
        return (answer){.code = -1}; /* the server died */
    }
    cr_assert_not_null(r, "%s: no answer, and the server lives", who);
    const char *comp = meta(r, "idem-compensated");
    answer a = {.code = (int)r->code,
                .replayed = r->replayed,
                .compensated = comp != NULL && strcmp(comp, "all") == 0,
                .gone = meta(r, "idem-result-gone") != NULL};
    if (a.code != IDEM_OK) {
        cr_log_info("  %s: %s: %s", who, idem_code_name(a.code), r->message);
    }
    idem__v1__response__free_unpacked(r, NULL);
    return a;
}

static answer real_event(int e)
{
    static const char *const outcomes[] = {"ok", "fail", "transient", "refuse", "refuse"};
    static const char *const points[] = {"after_claim", "after_effect", "after_step",
                                         "after_commit"};
    if (e <= E_A_UNDO_STUCK) {
        return real_request("A", outcomes[e], "none", e == E_A_UNDO_STUCK);
    }
    if (e == E_B_OK) {
        return real_request("B", "ok", "none", false);
    }
    if (e <= E_CRASH_COMMIT) {
        return real_request("A", "ok", points[e - E_CRASH_CLAIM], false);
    }
    control("model.Ctl/Set", "ok none");
    control(e == E_REDRIVE ? "model.Ctl/Redrive"
            : e == E_SWEEP ? "model.Ctl/Sweep"
                           : "model.Ctl/Forget",
            key);
    return (answer){.code = IDEM_OK};
}

/* This key's handler runs: its lines in DIR/runs. */
static int runs_of_key(void)
{
    char path[512], line[80], want[40];
    snprintf(path, sizeof(path), "%s/runs", dir);
    snprintf(want, sizeof(want), "%s\n", key);
    FILE *f = fopen(path, "r");
    int n = 0;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        n += strcmp(line, want) == 0;
    }
    if (f != NULL) {
        fclose(f);
    }
    return n;
}

static mcount real_counts(void)
{
    pthread_mutex_lock(&key_mu);
    mcount c = {.held = reserved - released, .undos = released, .runs = runs_of_key()};
    pthread_mutex_unlock(&key_mu);
    return c;
}

/* A fresh key for one sequence, on the test's store and server: a key's life is all
 * under that key (the re-driver's pass and the sweep also meet earlier sequences' keys,
 * whose effects are not counted). */
static void sequence_begin(void)
{
    pthread_mutex_lock(&key_mu);
    snprintf(key, sizeof(key), "k%d", ++run_no);
    reserved = released = 0;
    pthread_mutex_unlock(&key_mu);
}

static void store_begin(void)
{
    dir = tu_tempdir("model");
    snprintf(url, sizeof(url), "ipc://%s/server.sock", dir);
    pg_conninfo = tu_backend_is_pg() ? tu_pg_schema_create(pg_schema) : NULL;
    spawn();
}

static void store_end(void)
{
    if (child.pid > 0) {
        kill(child.pid, SIGTERM);
        cr_expect_eq(tu_reap(&child), 0, "clean shutdown");
    }
    tu_rmtree(dir);
    dir = NULL;
    if (pg_conninfo != NULL) {
        tu_pg_schema_drop(pg_schema);
        free(pg_conninfo);
        pg_conninfo = NULL;
    }
}

/* ---- the exploration ---- */

typedef struct node {
    mstate s;
    uint8_t path[MAX_DEPTH];
    int len;
    uint16_t tried; /* bit e: this state's successor under event e was checked */
} node;

typedef struct explorer {
    node nodes[MAX_NODES];
    int n, depth, checked, disagreements;
    bool tombstones;
    bool by_level; /* past depth 4: a state at another depth is another node */
} explorer;

/* Whether node i is state s at depth len (any depth unless by_level). */
static bool same_node(const explorer *x, int i, const mstate *s, int len)
{
    return memcmp(&x->nodes[i].s, s, sizeof(*s)) == 0 && (!x->by_level || x->nodes[i].len == len);
}

static int node_of(explorer *x, const mstate *s, const node *from, int e)
{
    for (int i = 0; i < x->n; i++) {
        if (same_node(x, i, s, from->len + 1)) {
            return i;
        }
    }
    cr_assert_lt(x->n, MAX_NODES, "more model states than MAX_NODES");
    node *n = &x->nodes[x->n];
    *n = (node){.s = *s, .len = from->len + 1};
    memcpy(n->path, from->path, (size_t)from->len);
    n->path[from->len] = (uint8_t)e;
    return x->n++;
}

static void print_sequence(const uint8_t *path, int len, int e)
{
    char line[1024] = "";
    for (int i = 0; i <= len; i++) {
        int ev = i < len ? path[i] : e;
        snprintf(line + strlen(line), sizeof(line) - strlen(line), "%s%s", i ? " → " : "",
                 klm_event_names[ev]);
    }
    cr_log_error("  sequence: %s", line);
}

static const char *answer_text(answer a, char *buf, size_t cap)
{
    if (a.code < 0) {
        return "the server died";
    }
    snprintf(buf, cap, "%s%s%s%s", idem_code_name((idem_code)a.code), a.replayed ? " replayed" : "",
             a.compensated ? " compensated" : "", a.gone ? " result-gone" : "");
    return buf;
}

/* Applies e to the model and to the server; false (reported) when they disagree. */
static bool step(explorer *x, mstate *s, mcount *c, const uint8_t *path, int len, int e)
{
    answer want = klm_event(s, c, e, x->tombstones);
    answer got = real_event(e);
    mcount real = real_counts();
    x->checked++;
    bool same = want.code == got.code && want.replayed == got.replayed &&
                want.compensated == got.compensated && want.gone == got.gone;
    if (same && memcmp(c, &real, sizeof(real)) == 0) {
        return true;
    }
    char a[96], b[96];
    x->disagreements++;
    cr_log_error("model and server disagree after %s:", klm_event_names[e]);
    print_sequence(path, len, e);
    cr_log_error("  answer: model %s, server %s", answer_text(want, a, sizeof(a)),
                 answer_text(got, b, sizeof(b)));
    cr_log_error("  held/undos/runs: model %d/%d/%d, server %d/%d/%d", c->held, c->undos, c->runs,
                 real.held, real.undos, real.runs);
    return false;
}

/* Node i is within the depth and has an event not checked yet. */
static bool open_node(const explorer *x, int i)
{
    return x->nodes[i].len < x->depth && x->nodes[i].tried != (1u << N_EVENTS) - 1;
}

/* The first open node, breadth first. */
static int next_open(const explorer *x)
{
    for (int i = 0; i < x->n; i++) {
        if (open_node(x, i)) {
            return i;
        }
    }
    return -1;
}

/* The event to check next from node i in state s: an untried one, else one (tried)
 * whose successor has untried events, so the sequence goes on instead of starting over;
 * -1: none. */
static int next_event(explorer *x, int i, const mstate *s, const mcount *c)
{
    for (int e = 0; e < N_EVENTS && x->nodes[i].len < x->depth; e++) {
        if (!(x->nodes[i].tried & (1u << e))) {
            return e;
        }
    }
    for (int e = 0; e < N_EVENTS; e++) {
        mstate t = *s;
        mcount d = *c;
        (void)klm_event(&t, &d, e, x->tombstones);
        for (int j = 0; j < x->n; j++) {
            if (same_node(x, j, &t, x->nodes[i].len + 1) && open_node(x, j)) {
                return e;
            }
        }
    }
    return -1;
}

/* One sequence: to node i by its path, then on while next_event finds one. */
static void explore_from(explorer *x, int i)
{
    mstate s = {0};
    mcount c = {0};
    uint8_t path[64];
    int len = 0, e;
    bool agree = true;
    sequence_begin();
    for (int k = 0; k < x->nodes[i].len && agree; k++) {
        agree = step(x, &s, &c, path, len, x->nodes[i].path[k]);
        path[len++] = x->nodes[i].path[k];
    }
    while (agree && len < (int)sizeof(path) && (e = next_event(x, i, &s, &c)) >= 0) {
        x->nodes[i].tried |= 1u << e;
        agree = step(x, &s, &c, path, len, e);
        path[len++] = (uint8_t)e;
        i = node_of(x, &s, &x->nodes[i], e);
    }
}

static int model_depth(void)
{
    const char *d = getenv("IDEMRPC_MODEL_DEPTH");
    int v = d != NULL ? atoi(d) : 4;
    cr_assert(v >= 1 && v <= MAX_DEPTH, "IDEMRPC_MODEL_DEPTH=%s: 1..%d", d, MAX_DEPTH);
    return v;
}

static void explore(void)
{
    static explorer x;
    memset(&x, 0, sizeof(x));
    x.depth = model_depth();
    x.tombstones = !tu_backend_is_pg(); /* PostgreSQL keeps no tombstones yet */
    x.by_level = x.depth > 4;
    x.n = 1;
    int sequences = 0;
    store_begin();
    for (int i; (i = next_open(&x)) >= 0 && x.disagreements < 20; sequences++) {
        explore_from(&x, i);
    }
    store_end();
    cr_log_info("key_life_model: depth %d, %d model states, %d sequences, %d events checked, "
                "%d disagreements",
                x.depth, x.n, sequences, x.checked, x.disagreements);
    cr_expect_eq(x.disagreements, 0, "the server disagrees with the model (sequences above)");
}

Test(key_life_model, every_sequence_of_events_agrees_with_the_model)
{
    explore();
}

/* Found by the model on a74836e: the first request's undo fails transiently; its retry
 * answers a transient error before reaching its step (a downstream it reads first is
 * down). That answer was stored as the compensation's failure and the undo never ran:
 * the retry that reaches the step replayed FAILED_PRECONDITION, 1 reservation held, 0
 * undos. A transient answer is never stored (docs/semantics.md): the compensation stays
 * unfinished, and the next run that reaches the step gives the reservation back. */
Test(key_life_model, a_transient_retry_keeps_a_compensation_unfinished)
{
    store_begin();
    sequence_begin();
    cr_assert_eq(real_event(E_A_UNDO_STUCK).code, IDEM_UNAVAILABLE);
    (void)real_event(E_A_TRANSIENT);
    answer a = real_event(E_A_UNDO_OK);
    cr_expect_eq(a.code, IDEM_FAILED_PRECONDITION);
    cr_expect(a.compensated && !a.replayed, "the retry that reaches the step compensates");
    mcount c = real_counts();
    cr_expect_eq(c.undos, 1, "the reservation is given back");
    cr_expect_eq(c.held, 0, "none held");
    store_end();
}

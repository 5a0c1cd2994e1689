/* A lease counts from the moment its request left, never from its answer (issue 35).
 *
 * A slow store answers a claim late: the store's lease began when the request reached it,
 * so an owner that starts its own count at the answer believes it holds the key for up to
 * a round trip after the store would let another instance take it. Here the owner's
 * store is slow: on PostgreSQL every chunk between the server and the database waits
 * SLOW_MS in a proxy (pgproxy.c); on LMDB every fdatasync waits SLOW_MS (this program's
 * fdatasync wins over libc's for liblmdb, as in failing_disk.c). The handler compares its
 * own view of its claim (the server's lease keeper) with the record the store holds, read
 * straight from the store. Runs on both stores (`lease`, `lease_pg`). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "call.h"
#include "inflight.h"
#include "testutil.h"
#if TU_HAVE_PG
#include "pgproxy.h"
#endif

#define LEASE_MS 600      /* the watched claim's */
#define LOCK_LEASE_MS 300 /* the lock's: shorter than one slow round trip */
#define SLOW_MS 400       /* per proxied chunk (a round trip: twice), or per fdatasync */

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* LMDB's disk: each fdatasync waits this long first (0: none). */
static atomic_uint slow_sync_ms;

int fdatasync(int fd)
{
    unsigned ms = atomic_load(&slow_sync_ms);
    if (ms > 0) {
        sleep_ms(ms);
    }
    return (int)syscall(SYS_fdatasync, fd);
}

/* The owner's store, which can be made slow, and a handle that reads the same records
 * at full speed (PostgreSQL: a second store straight to the database; LMDB: the same
 * one, whose reads never wait for a commit). */
static struct {
    idem_store *st, *direct;
    char *dir, *conninfo;
    char schema[32];
#if TU_HAVE_PG
    pgproxy *proxy;
#endif
} S;

static void slow_store_open(void)
{
    memset(&S, 0, sizeof(S));
    if (!tu_backend_is_pg()) {
        S.dir = tu_tempdir("lease");
        cr_assert_eq(idem_store_open_lmdb(&S.st, S.dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
        S.direct = S.st;
        return;
    }
#if TU_HAVE_PG
    char *via;
    S.conninfo = tu_pg_schema_create(S.schema);
    S.proxy = pgproxy_start(S.conninfo);
    cr_assert_gt(asprintf(&via, "%s host=127.0.0.1 port=%d", S.conninfo, pgproxy_port(S.proxy)), 0);
    cr_assert_eq(tu_pg_open(&S.st, via, 4), IDEM_OK, "%s", idem_errmsg());
    free(via);
    cr_assert_eq(tu_pg_open(&S.direct, S.conninfo, 2), IDEM_OK, "%s", idem_errmsg());
#else
    cr_skip_test("built without libpq");
#endif
}

static void slow_store_set(bool slow)
{
    atomic_store(&slow_sync_ms, slow && S.dir != NULL ? SLOW_MS : 0);
#if TU_HAVE_PG
    if (S.proxy != NULL) {
        pgproxy_delay(S.proxy, slow ? SLOW_MS : 0);
    }
#endif
}

static void slow_store_close(void)
{
    slow_store_set(false);
    if (S.direct != S.st) {
        idem_store_close(S.direct);
    }
    idem_store_close(S.st);
#if TU_HAVE_PG
    if (S.proxy != NULL) {
        pgproxy_stop(S.proxy);
    }
#endif
    if (S.dir != NULL) {
        tu_rmtree(S.dir);
    }
    if (S.conninfo != NULL) {
        tu_pg_schema_drop(S.schema);
        free(S.conninfo);
    }
}

TestSuite(lease, .init = slow_store_open, .fini = slow_store_close, .timeout = 120);

/* What a watch saw, one look every 10 ms for three leases: how often the store's record
 * no longer held the claim (another could take the key), and how often its owner's own
 * view said it held the key all the same. */
static struct {
    atomic_int looks, unstored, believed;
} W;

/* Whether the store's record of key is this claim's, with its lease running at wall
 * time t (the records' clock: the caller's on LMDB, the database's on PostgreSQL). */
static bool stored(const idem_key_ref *key, uint64_t owner, uint64_t t)
{
    idem_record rec;
    idem_code code = idem_store_get(S.direct, key, &rec);
    bool held = code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS && rec.owner == owner &&
                rec.lease_until_ms >= t;
    idem_record_clear(&rec);
    return held;
}

/* Watches the claim (key, owner): a look every 10 ms for three leases, comparing
 * held(arg), the owner's view, with the store's record; at most ten leases of time (a look
 * may wait for the slow disk: a read answers only from a durable state). */
static void watch(const idem_key_ref *key, uint64_t owner, uint64_t lease_ms,
                  bool (*held)(const void *arg), const void *arg)
{
    uint64_t end = idem__mono_ms() + 10 * lease_ms;
    for (uint64_t i = 0; i < 3 * lease_ms / 10 && idem__mono_ms() < end; i++) {
        uint64_t t = idem__now_ms(); /* before the owner's look: its view is as of t or later */
        bool believed = held(arg);
        if (!stored(key, owner, t)) {
            atomic_fetch_add(&W.unstored, 1);
            atomic_fetch_add(&W.believed, believed);
        }
        atomic_fetch_add(&W.looks, 1);
        sleep_ms(10); /* the next look: a sample every 10 ms, not a synchronisation */
    }
}

static void watch_expect_none_believed(void)
{
    cr_assert_gt(atomic_load(&W.unstored), 0,
                 "the store never let the claim go (%d looks): the case did not happen",
                 atomic_load(&W.looks));
    cr_expect_eq(atomic_load(&W.believed), 0,
                 "%d of %d looks: the owner believed it held the key while the store would "
                 "let another take it",
                 atomic_load(&W.believed), atomic_load(&W.unstored));
}

/* The owner's view of its claim: the server's lease keeper's. */
static bool claim_held(const void *arg)
{
    const idem_call *call = arg;
    return !idem__keeper_lost(idem__inflight_keeper(call->rt->inflight), call->claim_keep);
}

static idem_code h_watch(idem_call *call, void *arg)
{
    (void)arg;
    idem_key_ref key = {idem_call_caller(call), idem_call_method(call), idem_call_key(call)};
    slow_store_set(true); /* from the first renewal on (a claim answered after its lease
                           * does not start its handler) */
    watch(&key, call->fence, LEASE_MS, claim_held, call);
    return idem_call_reply(call, IDEM_OK, "watched", 7);
}

static bool lock_held(const void *arg)
{
    return idem_lock_held(arg);
}

/* Takes a lock through the call and watches it. */
static idem_code h_lock(idem_call *call, void *arg)
{
    (void)arg;
    idem_lock_opts o = {.lease_ms = LOCK_LEASE_MS, .wait_ms = 10000};
    idem_lock *l;
    idem_code code = idem_call_lock(call, "late", &o, &l);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "acquire: %s", idem_errmsg());
    }
    idem_key_ref key = {idem_lock_scope(l), IDEM_LOCK_METHOD, idem_lock_name(l)};
    watch(&key, idem_lock_token(l), LOCK_LEASE_MS, lock_held, l);
    return idem_call_reply(call, IDEM_OK, "locked", 6); /* released as the handler returns */
}

static void server_start(tu_server *ts)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = S.st;
    o.log_level = IDEM_LOG_OFF;
    tu_server_create(ts, &o);
    /* LMDB: a journaled method's claim commits alone, so its answer waits for the disk
     * (a cached one's is answered from the open txn). PostgreSQL: a cached method, one
     * statement between the read and the handler. */
    idem_method_opts m = {.flags = S.dir != NULL ? IDEM_METHOD_STEPS : IDEM_METHOD_CACHED,
                          .lease_ms = LEASE_MS};
    cr_assert_eq(idem_server_register(ts->srv, "lease.T/Watch", h_watch, NULL, &m), IDEM_OK);
    idem_method_opts lock = {.flags = IDEM_METHOD_CACHED};
    cr_assert_eq(idem_server_register(ts->srv, "lease.T/Lock", h_lock, NULL, &lock), IDEM_OK);
    tu_server_listen(ts);
}

static idem_code call_key(const char *url, const char *method, const char *key)
{
    idem_client *c = tu_client_attempts(url, 20000, 1);
    idem_request q = {.method = method, .idempotency_key = key, .deadline_ms = 60000};
    idem_result r;
    idem_code code = idem_client_call(c, &q, &r);
    cr_expect_eq(code, IDEM_OK, "%s %s: %s", method, key, r.message);
    idem_result_clear(&r);
    idem_client_close(c);
    return code;
}

/* Calls method once on a fast store (its connections open), then once more, on a slow
 * one from the start (slow) or from its handler's (h_watch). */
static void call_slow(const char *method, bool slow)
{
    tu_server ts;
    server_start(&ts);
    call_key(ts.url, method, "warm");
    memset(&W, 0, sizeof(W));
    slow_store_set(slow);
    call_key(ts.url, method, "k-late");
    slow_store_set(false);
    tu_server_destroy(&ts, false);
}

/* The case: renewals answered late (a slow database, a slow disk). The store may
 * let another instance take the key from the end of the lease it started when the last
 * renewal reached it; from then until a renewal lands the owner must not believe it
 * still holds the key (a handler's steps ask it before running one). A claim answered
 * after its lease: a_handler_does_not_start_on_a_claim_whose_lease_ran_out_before_it_started. */
Test(lease, an_owner_never_believes_it_holds_a_claim_the_store_would_let_another_take)
{
    call_slow("lease.T/Watch", false);
    watch_expect_none_believed();
}

/* The same for a lease lock taken in a handler: idem_lock_held never says held while
 * the store would let another holder acquire the lock. */
Test(lease, a_lock_holder_never_believes_it_holds_a_lock_the_store_would_let_another_take)
{
    call_slow("lease.T/Lock", true);
    watch_expect_none_believed();
}

/* ---- a handler does not start on a claim whose lease already ran out (issue 35) ---- */

#define SHORT_LEASE_MS 300 /* shorter than one slow answer: every slow claim's is late */

static atomic_int effects; /* handlers started */

static idem_code h_effect(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&effects, 1);
    return idem_call_reply(call, IDEM_OK, "done", 4);
}

/* A server on st. LMDB: a journaled method, before its first step (its claim commits
 * alone, so its answer waits for the disk); PostgreSQL: a cached one (the campaign's
 * Counter/Add). */
static void effect_server(tu_server *ts, idem_store *st)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = st;
    o.log_level = IDEM_LOG_OFF;
    tu_server_create(ts, &o);
    idem_method_opts m = {.flags = S.dir != NULL ? IDEM_METHOD_STEPS : IDEM_METHOD_CACHED,
                          .lease_ms = SHORT_LEASE_MS};
    cr_assert_eq(idem_server_register(ts->srv, "lease.T/Effect", h_effect, NULL, &m), IDEM_OK);
    tu_server_listen(ts);
}

static idem_code call_effect(const char *url, const char *key, uint32_t attempts, idem_result *r)
{
    idem_client *c = tu_client_attempts(url, 20000, attempts);
    idem_request q = {.method = "lease.T/Effect", .idempotency_key = key};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

/* The first server's call, sent from a thread of its own while the store is slow. */
static struct {
    const char *url;
    idem_code code;
    idem_result r;
} late;

static void *call_late(void *arg)
{
    (void)arg;
    late.code = call_effect(late.url, "k-lapsed", 1, &late.r);
    return NULL;
}

/* Whether the store would let another run take key (its lease has run out). */
static bool lapsed_in_store(const idem_key_ref *key)
{
    idem_record rec;
    idem_code code = idem_store_get(S.direct, key, &rec);
    bool lapsed =
        code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS && rec.lease_until_ms < idem__now_ms();
    idem_record_clear(&rec);
    return lapsed;
}

/* A claim answered after its owner's own count of its lease ran out (a slow database, a
 * slow disk: the campaign's finding 2). Meanwhile the store lets another run take the
 * key: a second server, on the fast handle of the same store, is called with it. The
 * late owner must not start its handler: its client hears ABORTED "claim lost", and the
 * retry with the same key gets the outcome of the one run that started. */
Test(lease, a_handler_does_not_start_on_a_claim_whose_lease_ran_out_before_it_started)
{
    tu_server a, b;
    idem_result r;
    pthread_t t;
    idem_key_ref key = {"", "lease.T/Effect", "k-lapsed"};
    effect_server(&a, S.st);
    effect_server(&b, S.direct);
    cr_assert_eq(call_effect(a.url, "warm", 1, &r), IDEM_OK, "%s", r.message);
    idem_result_clear(&r);
    atomic_store(&effects, 0);

    slow_store_set(true);
    late.url = a.url;
    cr_assert_eq(pthread_create(&t, NULL, call_late, NULL), 0);
    for (int i = 0; i < 2000 && !lapsed_in_store(&key); i++) {
        sleep_ms(5); /* one look every 5 ms, for up to 10 s */
    }
    idem_code code = call_effect(b.url, "k-lapsed", 1, &r); /* its own claim may be late too */
    cr_expect(code == IDEM_OK || code == IDEM_ABORTED, "the other run: %s", r.message);
    idem_result_clear(&r);
    pthread_join(t, NULL);
    slow_store_set(false);
    cr_expect_eq(late.code, IDEM_ABORTED, "the late claim's run answered %s: %s",
                 idem_code_name(late.code), late.r.message);
    idem_result_clear(&late.r);
    cr_assert_eq(call_effect(a.url, "k-lapsed", 5, &r), IDEM_OK, "retry: %s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&effects), 1,
                 "%d handlers started: one on a claim whose lease had run out, while another run "
                 "took the key",
                 atomic_load(&effects));
    tu_server_destroy(&b, false);
    tu_server_destroy(&a, false);
}

/* ---- the lapse's log line names its key and when it ran out ---- */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char lapse[1024], call[1024]; /* the lapse's line; the call's own (its key=) */
    char lost[1024];              /* the line of a claim lost while the handler ran */
} L = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void keep_lines(void *arg, idem_log_level level, const char *line)
{
    (void)arg;
    (void)level;
    pthread_mutex_lock(&L.mu);
    if (strstr(line, "lease lapsed") != NULL && L.lapse[0] == '\0') {
        snprintf(L.lapse, sizeof(L.lapse), "%s", line);
        pthread_cond_broadcast(&L.cv);
    } else if (strstr(line, "claim lost while the handler ran") != NULL) {
        snprintf(L.lost, sizeof(L.lost), "%s", line);
    } else if (strstr(line, "method=\"lease.T/Lapse\"") != NULL && strstr(line, "outcome=")) {
        snprintf(L.call, sizeof(L.call), "%s", line);
    }
    pthread_mutex_unlock(&L.mu);
}

/* Makes the store slow until the keeper has logged the lapse of this run's lease (for up
 * to 10 s): no renewal lands in time. */
static idem_code h_lapse(idem_call *call, void *arg)
{
    (void)arg;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    slow_store_set(true);
    pthread_mutex_lock(&L.mu);
    while (L.lapse[0] == '\0' && pthread_cond_timedwait(&L.cv, &L.mu, &until) == 0) {
    }
    pthread_mutex_unlock(&L.mu);
    slow_store_set(false);
    return idem_call_reply(call, IDEM_OK, "lapsed", 6);
}

/* The value of logfmt field name in line (unquoted values only), or "". */
static const char *field(const char *line, const char *name, char *out, size_t cap)
{
    char pat[64];
    snprintf(pat, sizeof(pat), " %s=", name);
    const char *p = strstr(line, pat);
    size_t n = p != NULL ? strcspn(p + strlen(pat), " ") : 0;
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), p != NULL ? p + strlen(pat) : "");
    return out;
}

/* "lease lapsed" names the method, the key's hash as the call's own line prints it, and
 * the wall time its lease ran out (between the call's start and the line), so that a
 * log reader (the campaign's checker) can match it to the call. */
/* A server logging into L, with h as lease.T/Lapse (lease SHORT_LEASE_MS), called once
 * with key; *before and *after: the wall time around the call. */
static idem_code logged_call(idem_handler_fn h, const char *key, uint64_t *before, uint64_t *after)
{
    tu_server ts;
    idem_server_opts o;
    idem_result r;
    idem_server_opts_init(&o);
    o.store = S.st;
    o.log_level = IDEM_LOG_INFO;
    o.log_fn = keep_lines;
    tu_server_create(&ts, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED, .lease_ms = SHORT_LEASE_MS};
    cr_assert_eq(idem_server_register(ts.srv, "lease.T/Lapse", h, NULL, &m), IDEM_OK);
    tu_server_listen(&ts);
    *before = idem__now_ms();
    idem_client *c = tu_client_attempts(ts.url, 20000, 1);
    idem_request q = {.method = "lease.T/Lapse", .idempotency_key = key, .deadline_ms = 60000};
    idem_code code = idem_client_call(c, &q, &r);
    cr_log_info("%s: %s", idem_code_name(code), r.message);
    idem_result_clear(&r);
    idem_client_close(c);
    *after = idem__now_ms();
    tu_server_destroy(&ts, false);
    return code;
}

/* line names the key of the call's own line and a lapsed_at_ms within [before, after]. */
static void expect_key_and_lapse(const char *line, uint64_t before, uint64_t after)
{
    char key[32], want[32], at[32];
    cr_assert_neq(line[0], '\0', "no such line was logged");
    cr_log_info("%s", line);
    cr_expect_neq(strstr(line, " method=\"lease.T/Lapse\""), NULL, "%s", line);
    field(L.call, "key", want, sizeof(want));
    cr_expect(want[0] != '\0' && strcmp(field(line, "key", key, sizeof(key)), want) == 0,
              "the line names key=%s, the call's line key=%s", key, want);
    unsigned long long t = strtoull(field(line, "lapsed_at_ms", at, sizeof(at)), NULL, 10);
    cr_expect(t >= before && t <= after, "lapsed_at_ms=%s, not within the call [%llu, %llu]", at,
              (unsigned long long)before, (unsigned long long)after);
}

Test(lease, the_lapse_line_names_the_method_the_key_and_when_the_lease_ran_out)
{
    uint64_t before, after;
    cr_expect_eq(logged_call(h_lapse, "k-logged", &before, &after), IDEM_OK);
    expect_key_and_lapse(L.lapse, before, after);
}

/* Lets the store stall until the run's lease has run out in the store's own view, then
 * takes the key over there (as another instance would) and lets the store go: the run's
 * completion finds its claim lost. */
static idem_code h_taken(idem_call *call, void *arg)
{
    (void)arg;
    idem_key_ref key = {"", "lease.T/Lapse", "k-taken"};
    idem_record rec;
    idem_claim_outcome out = 0;
    slow_store_set(true);
    for (int i = 0; i < 2000 && !lapsed_in_store(&key); i++) {
        sleep_ms(5); /* one look every 5 ms, for up to 10 s */
    }
    if (idem_store_get(S.direct, &key, &rec) == IDEM_OK) {
        idem_claim_req q = {.key = key, .now_ms = idem__now_ms()};
        memcpy(q.fingerprint, rec.fingerprint, sizeof(q.fingerprint));
        q.lease_until_ms = q.expires_ms = q.now_ms + 60000;
        idem_record_clear(&rec);
        (void)idem_store_claim(S.direct, &q, &out, &rec);
    }
    idem_record_clear(&rec);
    slow_store_set(false);
    cr_expect_eq(out, IDEM_CLAIM_TAKEN_OVER, "the other instance's claim: %d", (int)out);
    return idem_call_reply(call, IDEM_OK, "taken", 5);
}

/* The line of a claim lost while its handler ran names the key's hash and when the lease
 * ran out by this owner's own count, so that a log reader (the campaign's checker) tells
 * a lapse of this owner (a pause, a slow store: the documented at-least-once edge) from a
 * claim taken while it held (lapsed_at_ms=0, which no store should allow). */
Test(lease, a_claim_lost_while_its_handler_ran_is_logged_with_its_key_and_its_lapse)
{
    uint64_t before, after;
    if (S.dir != NULL) { /* a slow LMDB disk delays renewals' sync, not their effect */
        cr_skip_test("PostgreSQL only: on LMDB no other instance can take a held key");
    }
    cr_expect_eq(logged_call(h_taken, "k-taken", &before, &after), IDEM_ABORTED);
    expect_key_and_lapse(L.lost, before, after);
}

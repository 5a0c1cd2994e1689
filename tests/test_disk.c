/* A disk that fails: LMDB commits whose fdatasync answers EIO, through the real server
 * and client. Nothing the disk may not keep is answered: a fence is handed out only once
 * its claim is on disk and is never held by two claims, and a stored outcome (OK above
 * all) reaches its client only once it is on disk; meanwhile the client hears
 * UNAVAILABLE and its retry waits for the outcome, recorded in the background. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "call.h"
#include "lmdb_internal.h"
#include "failing_disk.h"
#include "testutil.h"

/* failing_syncs: the next commits whose fdatasync answers EIO (failing_disk.c). */
static char *dir;
static idem_store *store;
static tu_server srv;
static atomic_int runs;
static uint64_t fences[8];
static int fails_at_run; /* the syncs that fail once the first run has its fence */

/* A server on a store of its own whose batches stay open for their shared claims (30 s):
 * what the handler does next meets its claim in the open txn. */
static void setup(void)
{
    dir = tu_tempdir("disk");
    cr_assert_eq(idem_store_open_lmdb(&store, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    ((lmdb_store *)store)->gc.hold_us = 30u * 1000 * 1000; /* before its first write */
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = store;
    tu_server_create(&srv, &o);
    atomic_store(&runs, 0);
    atomic_store(&failing_syncs, 0);
    memset(fences, 0, sizeof(fences));
}

static void teardown(void)
{
    atomic_store(&failing_syncs, 0);
    tu_server_destroy(&srv, false);
    idem_store_close(store);
    tu_rmtree(dir);
}

TestSuite(disk, .init = setup, .fini = teardown, .timeout = 60);

static idem_client *client(uint32_t attempts)
{
    return tu_client_attempts(srv.url, 5000, attempts);
}

static idem_code call(idem_client *c, const char *method, const char *key, idem_result *r)
{
    idem_request q = {.method = method, .idempotency_key = key, .payload = "100", .payload_len = 3};
    return idem_client_call(c, &q, r);
}

static void listen_with(const char *method, idem_handler_fn fn, uint64_t lease_ms,
                        uint64_t max_run_ms)
{
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED,
                          .lease_ms = lease_ms,
                          .max_run_ms = max_run_ms};
    cr_assert_eq(idem_server_register(srv.srv, method, fn, NULL, &m), IDEM_OK, "%s", idem_errmsg());
    tu_server_listen(&srv);
}

/* ---- item 2: a fence is on disk before it leaves, and never held by two claims ---- */

/* The first run makes the next fail_syncs commits fail (its claim's batch, then the redo
 * of it) and asks for its fence; every run answers with the fence it was handed. */
static idem_code fence_handler(idem_call *c, void *arg)
{
    (void)arg;
    int run = atomic_fetch_add(&runs, 1);
    if (run == 0) {
        atomic_store(&failing_syncs, fails_at_run);
    }
    uint64_t fence = idem_call_fence(c);
    char out[40];
    int n = snprintf(out, sizeof(out), "fence %" PRIu64, fence);
    if (run < 8) {
        fences[run] = fence;
    }
    return idem_call_reply(c, IDEM_OK, out, (size_t)n); /* even with no fence: not kept */
}

Test(disk, a_fence_whose_claim_and_its_redo_fail_to_commit_is_refused_not_handed_out_twice)
{
    fails_at_run = 2;
    listen_with("d.Fence/Draw", fence_handler, 0, 0);
    idem_client *once = client(1), *retrying = client(5);
    idem_result r1, r2;
    idem_code c1 = call(once, "d.Fence/Draw", "k1", &r1);
    cr_expect_eq(atomic_load(&failing_syncs), 0, "the batch and its redo met the failures");
    cr_expect_eq(fences[0], 0, "run 1 was handed fence %" PRIu64 " for a claim not on disk",
                 fences[0]);
    cr_expect_neq(c1, IDEM_OK, "run 1 had no durable fence, yet its client got OK: %.*s",
                  (int)r1.payload_len, (const char *)r1.payload);
    cr_assert_eq(call(retrying, "d.Fence/Draw", "k1", &r2), IDEM_OK, "%s",
                 r2.message ? r2.message : "");
    cr_expect_eq(atomic_load(&runs), 2);
    cr_expect_neq(fences[1], 0);
    cr_expect(fences[0] == 0 || fences[0] != fences[1], "fence %" PRIu64 " handed to two runs",
              fences[1]);
    cr_expect_gt(fences[1], 1,
                 "fence 1 (drawn for run 1, whose claim never reached the disk) "
                 "was drawn again");
    char want[40];
    snprintf(want, sizeof(want), "fence %" PRIu64, fences[1]);
    cr_expect(r2.payload_len == strlen(want) && memcmp(r2.payload, want, r2.payload_len) == 0);
    idem_result_clear(&r1);
    idem_result_clear(&r2);
    idem_client_close(once);
    idem_client_close(retrying);
}

/* Between a failed commit and its redo another writer (here: as another process would)
 * draws the next fence from the counter the failed commit rolled back: the redo must
 * not apply the claim with that same fence. */
static void draw_a_fence(void *arg)
{
    lmdb_store *st = arg;
    MDB_txn *txn;
    MDB_val k = {5, "fence"}, v;
    uint8_t b[8];
    cr_assert_eq(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    int rc = mdb_get(txn, st->meta, &k, &v);
    uint64_t last = rc == 0 && v.mv_size == 8 ? idem__get_be64(v.mv_data) : 0;
    idem__put_be64(b, last + 1);
    v = (MDB_val){8, b};
    cr_assert_eq(mdb_put(txn, st->meta, &k, &v, 0), 0);
    cr_assert_eq(mdb_txn_commit(txn), 0);
    fences[7] = last + 1; /* the other writer's */
}

Test(disk, a_redo_never_applies_a_fence_another_writer_drew_meanwhile)
{
    fails_at_run = 1; /* the batch's commit fails; the redo could commit */
    ((lmdb_store *)store)->gc.on_failed_commit_arg = store;
    ((lmdb_store *)store)->gc.on_failed_commit = draw_a_fence;
    listen_with("d.Fence/Draw", fence_handler, 0, 0);
    idem_client *retrying = client(5);
    idem_result r;
    cr_assert_eq(call(retrying, "d.Fence/Draw", "k2", &r), IDEM_OK, "%s",
                 r.message ? r.message : "");
    cr_assert_neq(fences[7], 0, "the other writer drew a fence");
    cr_expect_neq(fences[0], fences[7], "fence %" PRIu64 " held by two claims", fences[7]);
    cr_expect_neq(fences[1], fences[7]);
    cr_expect_neq(fences[1], 0);
    idem_result_clear(&r);
    idem_client_close(retrying);
}

/* ---- item 3: no OK for an outcome that is not on disk ---- */

/* Its claim on disk first (the fence commits it), then the completion's commit and the
 * redo of it fail (fails_at_run syncs); each run says a larger balance. */
static idem_code balance_handler(idem_call *c, void *arg)
{
    (void)arg;
    int run = atomic_fetch_add(&runs, 1) + 1;
    if (idem_call_fence(c) == 0) { /* a later run on a disk that still fails */
        return idem_call_fail(c, IDEM_UNAVAILABLE, "no fence: %s", idem_errmsg());
    }
    if (run == 1) {
        atomic_store(&failing_syncs, fails_at_run);
    }
    char out[32];
    int n = snprintf(out, sizeof(out), "balance %d", run * 100);
    return idem_call_reply(c, IDEM_OK, out, (size_t)n);
}

static bool says(const idem_result *r, const char *text)
{
    return r->payload_len == strlen(text) && memcmp(r->payload, text, r->payload_len) == 0;
}

Test(disk, an_outcome_that_fails_to_commit_is_not_answered_ok_and_its_retry_replays_it)
{
    fails_at_run = 2; /* the completion's batch, then the completion alone */
    listen_with("d.Bank/Pay", balance_handler, 300, 10000);
    idem_client *once = client(1), *retrying = client(5);
    idem_result r1, r2, r3;
    idem_code c1 = call(once, "d.Bank/Pay", "p1", &r1);
    cr_expect_eq(atomic_load(&failing_syncs), 0, "the completion and its redo met the failures");
    cr_expect_eq(c1, IDEM_UNAVAILABLE, "the first caller was told %s %.*s", idem_code_name(c1),
                 (int)r1.payload_len, (const char *)r1.payload);
    /* The retry waits for the outcome recorded in the background and replays it. */
    cr_assert_eq(call(retrying, "d.Bank/Pay", "p1", &r2), IDEM_OK, "%s",
                 r2.message ? r2.message : "");
    cr_expect(says(&r2, "balance 100"), "%.*s", (int)r2.payload_len, (const char *)r2.payload);
    cr_expect(r2.replayed);
    /* Long after the lease (300 ms): still that one outcome, never a second run. */
    idem__sleep_ms(700);
    cr_assert_eq(call(retrying, "d.Bank/Pay", "p1", &r3), IDEM_OK, "%s",
                 r3.message ? r3.message : "");
    cr_expect(says(&r3, "balance 100") && r3.replayed, "%.*s replayed=%d", (int)r3.payload_len,
              (const char *)r3.payload, r3.replayed);
    cr_expect_eq(atomic_load(&runs), 1);
    idem_result_clear(&r1);
    idem_result_clear(&r2);
    idem_result_clear(&r3);
    idem_client_close(once);
    idem_client_close(retrying);
}

/* The disk keeps failing past max_run_ms: the background record gives up, the lease runs
 * out, and a retry once the disk is back runs again. Its client was never told OK, so
 * every OK anyone got for the key is the same one. */
Test(disk, an_outcome_that_never_reaches_the_disk_is_never_answered_ok)
{
    fails_at_run = 1 << 30;
    listen_with("d.Bank/Pay", balance_handler, 300, 600);
    idem_client *once = client(1);
    idem_result r1, r2;
    idem_code c1 = call(once, "d.Bank/Pay", "p2", &r1);
    cr_expect_neq(c1, IDEM_OK, "the first caller was told OK %.*s", (int)r1.payload_len,
                  (const char *)r1.payload);
    idem_result_clear(&r1);
    idem__sleep_ms(600 + 300 + 200); /* past max_run_ms and the lease after it */
    atomic_store(&failing_syncs, 0);
    idem_client *retrying = client(10);
    cr_assert_eq(call(retrying, "d.Bank/Pay", "p2", &r1), IDEM_OK, "%s",
                 r1.message ? r1.message : "");
    cr_assert_eq(call(retrying, "d.Bank/Pay", "p2", &r2), IDEM_OK);
    cr_expect(r1.payload_len == r2.payload_len &&
                  memcmp(r1.payload, r2.payload, r1.payload_len) == 0,
              "two different OKs for one key");
    cr_expect(r2.replayed);
    cr_expect_eq(atomic_load(&runs), 2, "the outcome given up on was not answered: it ran again");
    idem_result_clear(&r1);
    idem_result_clear(&r2);
    idem_client_close(once);
    idem_client_close(retrying);
}

/* ---- what a shared claim meets in an open batch whose commit then fails ---- */

static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool first_running, first_may_answer;

/* Payload "100" (the first request) waits at the gate; any other answers at once. */
static idem_code gated_handler(idem_call *c, void *arg)
{
    (void)arg;
    size_t n;
    const char *p = idem_call_payload(c, &n);
    atomic_fetch_add(&runs, 1);
    if (n == 3 && memcmp(p, "100", 3) == 0) {
        pthread_mutex_lock(&gate_mu);
        first_running = true;
        pthread_cond_broadcast(&gate_cv);
        while (!first_may_answer) {
            pthread_cond_wait(&gate_cv, &gate_mu);
        }
        pthread_mutex_unlock(&gate_mu);
    }
    char out[32];
    int len = snprintf(out, sizeof(out), "ran %.*s", (int)n, p);
    return idem_call_reply(c, IDEM_OK, out, (size_t)len);
}

typedef struct first_call {
    idem_client *c;
    idem_result r;
    idem_code code;
} first_call;

static void *send_first(void *arg)
{
    first_call *f = arg;
    f->code = call(f->c, "d.Gate/Pay", "m1", &f->r);
    return NULL;
}

/* Request A (payload 100) claims the key in a batch held open; request B (payload 999,
 * the same key) meets A's claim there. The batch's commit and A's redo then fail: the
 * disk never holds A's request, so B is no "key reused": it is answered from the disk,
 * where the key is free, and runs. */
Test(disk, another_request_met_in_a_batch_that_fails_to_commit_is_not_key_reused)
{
    lmdb_store *lst = (lmdb_store *)store;
    lst->gc.accept_min_us = lst->gc.accept_max_us = 30u * 1000 * 1000; /* B joins A's batch */
    listen_with("d.Gate/Pay", gated_handler, 0, 0);
    first_call a = {.c = client(1)};
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, send_first, &a), 0);
    pthread_mutex_lock(&gate_mu);
    while (!first_running) {
        pthread_cond_wait(&gate_cv, &gate_mu);
    }
    pthread_mutex_unlock(&gate_mu);
    atomic_store(&failing_syncs, 2); /* the batch holding both, then A's redo */
    idem_client *b_client = client(1);
    idem_result b;
    idem_request q = {
        .method = "d.Gate/Pay", .idempotency_key = "m1", .payload = "999", .payload_len = 3};
    idem_code bc = idem_client_call(b_client, &q, &b);
    cr_expect_eq(atomic_load(&failing_syncs), 0, "the batch and A's redo met the failures");
    cr_expect_eq(bc, IDEM_OK, "B was told %s \"%s\" about a request the disk does not hold",
                 idem_code_name(bc), b.message ? b.message : "");
    cr_expect(says(&b, "ran 999"), "%.*s", (int)b.payload_len, (const char *)b.payload);
    pthread_mutex_lock(&gate_mu);
    first_may_answer = true;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
    pthread_join(t, NULL);
    cr_expect_neq(a.code, IDEM_OK, "A's claim never reached the disk, yet A got OK");
    idem_result_clear(&a.r);
    idem_result_clear(&b);
    idem_client_close(a.c);
    idem_client_close(b_client);
}

/* ---- a refusal read from an open batch (group commit itself) ---- */

static MDB_env *raw_env;
static idem_group_commit raw_gc;
static char *raw_dir;
static atomic_int refusal_runs;
static bool refusal_applied;

static void raw_setup(void)
{
    raw_dir = tu_tempdir("disk-gc");
    cr_assert_eq(mdb_env_create(&raw_env), 0);
    cr_assert_eq(mdb_env_open(raw_env, raw_dir, 0, 0600), 0); /* commits call fdatasync */
    cr_assert_eq(idem__gc_init(&raw_gc, raw_env, true, 64), IDEM_OK);
    raw_gc.hold_us = 30u * 1000 * 1000; /* before any write: the writer thread sleeps */
    raw_gc.accept_min_us = raw_gc.accept_max_us = 30u * 1000 * 1000;
    atomic_store(&failing_syncs, 0);
    atomic_store(&refusal_runs, 0);
    refusal_applied = false;
}

static void raw_teardown(void)
{
    atomic_store(&failing_syncs, 0);
    idem__gc_fini(&raw_gc);
    mdb_env_close(raw_env);
    tu_rmtree(raw_dir);
}

TestSuite(disk_gc, .init = raw_setup, .fini = raw_teardown, .timeout = 10);

static const idem_write_fn applied_ok = failing_disk_put_x; /* a write: a commit syncs */

static void no_unref(void *ctx)
{
    (void)ctx;
}

/* As a claim whose token another claim of the open batch consumed: refused there (and
 * the disk then fails that batch's commit); alone, on what the disk holds, it passes. */
static idem_code refused_in_the_batch(MDB_txn *txn, void *ctx)
{
    (void)txn, (void)ctx;
    if (atomic_fetch_add(&refusal_runs, 1) > 0) {
        return IDEM_OK;
    }
    atomic_store(&failing_syncs, 1);
    pthread_mutex_lock(&gate_mu);
    refusal_applied = true;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
    return idem__err(IDEM_FAILED_PRECONDITION, "token used up (in the open batch)");
}

static void *claim_refused(void *arg)
{
    uint64_t ticket;
    idem_code *out = arg;
    *out = idem__gc_write_held(&raw_gc, refused_in_the_batch, applied_ok, NULL, no_unref, NULL,
                               &ticket);
    idem__gc_drop(&raw_gc, ticket);
    return NULL;
}

Test(disk_gc, a_shared_claim_refused_in_a_batch_that_fails_to_commit_is_decided_again)
{
    uint64_t ticket;
    idem_code refused = IDEM_UNKNOWN;
    pthread_t t;
    cr_assert_eq(
        idem__gc_write_held(&raw_gc, applied_ok, applied_ok, NULL, no_unref, NULL, &ticket),
        IDEM_OK);
    cr_assert_neq(ticket, 0);
    cr_assert_eq(pthread_create(&t, NULL, claim_refused, &refused), 0);
    pthread_mutex_lock(&gate_mu);
    while (!refusal_applied) {
        pthread_cond_wait(&gate_cv, &gate_mu);
    }
    pthread_mutex_unlock(&gate_mu);
    cr_assert_eq(idem__gc_write_end(&raw_gc, applied_ok, NULL, ticket, 0), IDEM_OK, "%s",
                 idem_errmsg()); /* the batch commits: its fdatasync fails */
    pthread_join(t, NULL);
    cr_expect_eq(atomic_load(&failing_syncs), 0, "the batch's commit met the failure");
    cr_expect_eq(refused, IDEM_OK, "refused from a batch the disk never held: %s",
                 idem_code_name(refused));
    cr_expect_eq(atomic_load(&refusal_runs), 2, "decided again alone");
}

/* ---- group_commit.h's rule, checked unless NDEBUG: a refusal comes before any write ---- */

#ifndef NDEBUG
static atomic_int bad_refusals;

static void count_bad_refusal(const char *msg)
{
    cr_log_info("%s", msg);
    atomic_fetch_add(&bad_refusals, 1);
}

/* The bug the rule forbids: a write, then a refusal. */
static idem_code writes_then_refuses(MDB_txn *txn, void *ctx)
{
    (void)ctx;
    MDB_dbi dbi;
    MDB_val k = {1, "y"}, v = {1, "1"};
    if (mdb_dbi_open(txn, NULL, 0, &dbi) != 0 || mdb_put(txn, dbi, &k, &v, 0) != 0) {
        return idem__err(IDEM_INTERNAL, "put y");
    }
    return idem__err(IDEM_FAILED_PRECONDITION, "refused after its write");
}

/* It joins a batch held open for a shared claim, applied in the batch's txn itself (a map
 * with room: no child txn per write): the check trips (it would abort the process), and
 * its write is not committed with the claim's. */
Test(disk_gc, a_write_that_refuses_after_writing_trips_the_check_and_commits_nothing)
{
    uint64_t ticket;
    MDB_txn *txn;
    MDB_dbi dbi;
    MDB_val k = {1, "y"}, v;
    cr_assert_eq(mdb_env_set_mapsize(raw_env, 64u << 20), 0); /* before any txn */
    idem__gc_on_bad_refusal = count_bad_refusal;
    cr_assert_eq(
        idem__gc_write_held(&raw_gc, applied_ok, applied_ok, NULL, no_unref, NULL, &ticket),
        IDEM_OK);
    cr_assert_neq(ticket, 0, "a batch is open");
    idem_code code = idem__gc_write(&raw_gc, writes_then_refuses, NULL);
    cr_expect_eq(code, IDEM_INTERNAL, "%s: %s", idem_code_name(code), idem_errmsg());
    cr_expect_geq(atomic_load(&bad_refusals), 1, "the check tripped");
    cr_assert_eq(idem__gc_write_end(&raw_gc, applied_ok, NULL, ticket, 0), IDEM_OK);
    cr_assert_eq(mdb_txn_begin(raw_env, NULL, MDB_RDONLY, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    int rc = mdb_get(txn, dbi, &k, &v);
    mdb_txn_abort(txn);
    cr_expect_eq(rc, MDB_NOTFOUND, "the refused write's key was committed with the batch");
    idem__gc_on_bad_refusal = NULL;
}
#endif

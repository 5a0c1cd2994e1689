/* A disk that fails a sync, then syncs again: what was answered OK is on disk even where
 * Linux marked the pages a failed fdatasync could not write clean, so that the next
 * fdatasync succeeds without writing them ("fsyncgate"). The store's writes are recorded
 * in this process (power_cut.c: a failed sync loses what was pending, unless a later
 * write to the page is synced), the store is closed, the power cut applied
 * (power_cut_apply.c), and what was answered OK must be there: through the real server
 * and client (a server on what is left replays every answer), and on group commit alone
 * for the sync that a failed commit should have done (the order of its batches is
 * chosen there). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "lmdb_internal.h"
#include "power_cut.h"
#include "testutil.h"

static char *dir;
static char store_dir[512], data[600], undo[600];
static atomic_int runs;

static void setup(void)
{
    dir = tu_tempdir("sync_failure");
    snprintf(store_dir, sizeof(store_dir), "%s/store", dir);
    snprintf(data, sizeof(data), "%s/data.mdb", store_dir);
    snprintf(undo, sizeof(undo), "%s/undo.log", dir);
    atomic_store(&runs, 0);
}

static void teardown(void)
{
    power_cut_plan("");
    atomic_store(&power_cut_before_sync, NULL);
    tu_rmtree(dir);
}

TestSuite(sync_failure, .init = setup, .fini = teardown, .timeout = 60);

/* The first run lets its batch's commit sync and makes the sync after it (the one that
 * flushes the batch's meta page, nothing being queued) fail. */
static idem_code put(idem_call *call, void *arg)
{
    (void)arg;
    char out[64];
    int run = atomic_fetch_add(&runs, 1) + 1;
    int n = snprintf(out, sizeof(out), "run %d", run);
    if (run == 1) {
        power_cut_plan("pf");
    }
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* A durable store (pipelined: its meta page waits for the next sync; without the
 * write-ahead log, whose batches need no second sync) and a server on it; the claim and
 * its completion share a batch (held open for them). */
static void start(idem_store **st, tu_server *srv)
{
    cr_assert_eq(idem_store_open_lmdb(st, store_dir, 0, IDEM_STORE_NO_LOG), IDEM_OK, "%s",
                 idem_errmsg());
    ((lmdb_store *)*st)->gc.hold_us = 30u * 1000 * 1000; /* before its first write */
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = *st;
    tu_server_create(srv, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(srv->srv, "s.Note/Put", put, NULL, &m), IDEM_OK);
    tu_server_listen(srv);
}

static void stop(idem_store *st, tu_server *srv)
{
    tu_server_destroy(srv, true);
    idem_store_close(st);
}

static idem_code call(const tu_server *srv, idem_result *r)
{
    idem_client *cl = tu_client(srv->url, 5000);
    idem_request q = {.method = "s.Note/Put", .idempotency_key = "k1"};
    idem_code code = idem_client_call(cl, &q, r);
    idem_client_close(cl);
    return code;
}

Test(sync_failure, an_answer_after_a_failed_sync_is_on_disk_though_the_next_sync_succeeds)
{
    idem_store *st;
    tu_server srv;
    idem_result r;
    power_cut_record(undo, data);
    start(&st, &srv);
    cr_assert_eq(call(&srv, &r), IDEM_OK, "%s", r.message ? r.message : "");
    cr_log_info("answered OK after %u attempt(s), %s", r.attempts,
                r.replayed ? "replayed" : "not replayed");
    cr_expect_eq(power_cut_plan_left(), 0, "the flush's sync failed");
    char answer[64];
    snprintf(answer, sizeof(answer), "%.*s", (int)r.payload_len, (const char *)r.payload);
    idem_result_clear(&r);
    stop(st, &srv);
    power_cut_record(NULL, NULL); /* else the cut's own writes would be recorded */

    long undone = power_cut_apply(undo, data);
    cr_assert_geq(undone, 1, "the power cut undid the write the failed sync lost");
    start(&st, &srv);
    cr_expect_eq(call(&srv, &r), IDEM_OK, "%s", r.message ? r.message : "");
    cr_expect(r.replayed, "k1 was answered OK (\"%s\"), and after the power cut it ran again",
              answer);
    cr_expect(r.payload_len == strlen(answer) && memcmp(r.payload, answer, r.payload_len) == 0,
              "answered \"%s\", now \"%.*s\"", answer, (int)r.payload_len, (const char *)r.payload);
    idem_result_clear(&r);
    stop(st, &srv);
}

/* ---- group commit alone: a batch's commit fails while the batch before it waits ---- */

static MDB_env *env;
static idem_group_commit gc;
static pthread_t b_thread;
static idem_code b_code = IDEM_UNKNOWN;
static uint64_t marks;

/* Puts key ctx (a string) in the main db. */
static idem_code put_key(MDB_txn *txn, void *ctx)
{
    MDB_dbi dbi;
    MDB_val k = {strlen(ctx), ctx}, v = {8, &marks};
    int rc = mdb_dbi_open(txn, NULL, 0, &dbi);
    if (rc == 0) {
        rc = mdb_put(txn, dbi, &k, &v, 0);
    }
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "put");
}

/* The store's re-write, as env.c's: one key changes. */
static idem_code rewrite_mark(MDB_txn *txn, void *ctx)
{
    (void)ctx;
    marks++;
    return put_key(txn, "mark");
}

static void *write_b(void *arg)
{
    (void)arg;
    b_code = idem__gc_write(&gc, put_key, "b");
    return NULL;
}

/* At batch A's commit sync: batch B is queued (on a thread of its own), so that the
 * writer thread commits B with A still waiting for the sync that flushes its meta page. */
static void queue_b(void)
{
    atomic_store(&power_cut_before_sync, NULL);
    cr_assert_eq(pthread_create(&b_thread, NULL, write_b, NULL), 0);
    bool queued = false;
    for (int i = 0; i < 5000 && !queued; i++) { /* bounded: 5 s */
        pthread_mutex_lock(&gc.mu);
        queued = gc.head != NULL;
        pthread_mutex_unlock(&gc.mu);
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
    }
    cr_assert(queued, "B was queued");
}

static void no_unref(void *ctx)
{
    (void)ctx;
}

/* Batch A (a claim and its end) commits and waits for the next sync; batch B's commit
 * fails (its fdatasync, which should have flushed A's meta page); the sync after it
 * succeeds; the next commit fails again. Whatever was answered OK survives the cut: A's
 * end used to be answered OK by that sync, and lost. */
Test(sync_failure, a_batch_waiting_for_a_failed_commits_sync_is_not_answered_ok_by_the_next_sync)
{
    uint64_t ticket;
    cr_assert_eq(mkdir(store_dir, 0700), 0);
    power_cut_record(undo, data);
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_set_mapsize(env, 64u << 20), 0);
    cr_assert_eq(mdb_env_open(env, store_dir, MDB_NOMETASYNC, 0600), 0); /* pipelined */
    cr_assert_eq(idem__gc_init(&gc, env, true, 64), IDEM_OK);
    gc.hold_us = 30u * 1000 * 1000;          /* before any write: A stays open for its end */
    gc.accept_min_us = gc.accept_max_us = 1; /* B waits for a batch of its own */
    gc.rewrite = rewrite_mark;
    cr_assert_eq(idem__gc_write_held(&gc, put_key, put_key, "a", no_unref, NULL, &ticket), IDEM_OK);
    power_cut_plan("pfpf"); /* A's commit, B's commit, then the next two syncs */
    atomic_store(&power_cut_before_sync, queue_b);
    idem_code a_code = idem__gc_write_end(&gc, put_key, "a-end", ticket, 0);
    pthread_join(b_thread, NULL);
    cr_log_info("A's end: %s, B: %s", idem_code_name(a_code), idem_code_name(b_code));
    cr_expect_eq(power_cut_plan_left(), 0, "every step of the plan was taken");
    idem__gc_fini(&gc);
    mdb_env_close(env);
    power_cut_record(NULL, NULL);
    cr_assert_geq(power_cut_apply(undo, data), 1);
    cr_expect(a_code != IDEM_OK || tu_lmdb_has_key(store_dir, "a-end"),
              "A's end was answered OK, and is lost");
    cr_expect(b_code != IDEM_OK || tu_lmdb_has_key(store_dir, "b"),
              "B was answered OK, and is lost");
}

/* The store's write-ahead log (src/store/lmdb/wal.h) under a power cut (the recorder,
 * power_cut.c: every write no fdatasync of its file covered is undone, taken while the
 * store is open, as a process dies there): a call answered OK from the log, then a store
 * opened read-write without the log (IDEM_STORE_NO_LOG, IDEM_STORE_NO_GROUP_COMMIT),
 * through the real server and client; and a batch that committed nothing, whose txnid
 * the next one takes. Each test failed on the log's first version (a stranger's
 * review). */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "lmdb_internal.h"
#include "power_cut.h"
#include "supplemental.h"
#include "testutil.h"
#include "wal_priv.h"

static char *dir;
static char store_dir[512], data[600], undo[600];
static atomic_int runs;

#define OTHERS 40

static void setup(void)
{
    dir = tu_tempdir("wal_cut");
    snprintf(store_dir, sizeof(store_dir), "%s/store", dir);
    snprintf(data, sizeof(data), "%s/data.mdb", store_dir);
    snprintf(undo, sizeof(undo), "%s/undo.log", dir);
    atomic_store(&runs, 0);
}

static void teardown(void)
{
    power_cut_plan("");
    tu_rmtree(dir);
}

TestSuite(wal_cut, .init = setup, .fini = teardown, .timeout = 60);

/* Each run answers its number: a second run is a second effect. */
static idem_code put(idem_call *call, void *arg)
{
    (void)arg;
    char out[64];
    int n = snprintf(out, sizeof(out), "run %d", atomic_fetch_add(&runs, 1) + 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static void start(idem_store **st, tu_server *srv, unsigned flags)
{
    cr_assert_eq(idem_store_open_lmdb(st, store_dir, 0, flags), IDEM_OK, "%s", idem_errmsg());
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

/* The power cut while the store is open (a process that dies there; a close would sync
 * LMDB first): the recorder stops, the unsynced writes of both files are undone, and the
 * store is closed, which writes nothing more (its syncs flush what the cut left). */
static void cut_then_close(idem_store *st)
{
    power_cut_record(NULL, NULL);
    cr_assert_geq(power_cut_apply(undo, data), 1, "the cut undid the unsynced writes");
    idem_store_close(st);
}

/* Calls keys (NULL-ended; k1 last) on a server over a store opened with flags: k1's
 * answer in out; cut: the power cut comes before the store's close. */
static void call_keys(unsigned flags, const char *const *keys, char *out, size_t size,
                      bool *replayed, bool cut)
{
    idem_store *st;
    tu_server srv;
    idem_result r;
    start(&st, &srv, flags);
    idem_client *cl = tu_client(srv.url, 5000);
    for (const char *const *k = keys; *k != NULL; k++) {
        idem_request q = {.method = "s.Note/Put", .idempotency_key = *k};
        cr_assert_eq(idem_client_call(cl, &q, &r), IDEM_OK, "%s", r.message ? r.message : "");
        snprintf(out, size, "%.*s", (int)r.payload_len, (const char *)r.payload);
        *replayed = r.replayed;
        idem_result_clear(&r);
    }
    idem_client_close(cl);
    if (cut) {
        tu_server_destroy(&srv, true);
        cut_then_close(st);
    } else {
        stop(st, &srv);
    }
}

static void call_k1(unsigned flags, char *out, size_t size, bool *replayed)
{
    static const char *const k1[] = {"k1", NULL};
    call_keys(flags, k1, out, size, replayed, false);
}

/* OTHERS other keys then k1 answered OK by a server with the log (default flags), then
 * the power cut: the log holds k1's entry after theirs. */
static void answer_then_cut(char *answer, size_t size)
{
    static char names[OTHERS][16];
    static const char *keys[OTHERS + 2];
    for (int i = 0; i < OTHERS; i++) {
        snprintf(names[i], sizeof(names[i]), "other%d", i);
        keys[i] = names[i];
    }
    keys[OTHERS] = "k1";
    keys[OTHERS + 1] = NULL;
    bool replayed;
    power_cut_record(undo, data);
    call_keys(0, keys, answer, size, &replayed, true);
}

static void restart_replays_k1(unsigned flags)
{
    char answer[64], again[64];
    bool replayed;
    answer_then_cut(answer, sizeof(answer));
    call_k1(flags, again, sizeof(again), &replayed);
    cr_expect(replayed && strcmp(again, answer) == 0,
              "k1 was answered \"%s\"; after the cut the server answered \"%s\" (%s)", answer,
              again, replayed ? "replayed" : "a second run");
}

Test(wal_cut, a_server_on_a_store_opened_without_the_log_replays_an_answer_of_the_log)
{
    restart_replays_k1(IDEM_STORE_NO_LOG);
}

Test(wal_cut, a_server_without_group_commit_replays_an_answer_of_the_log)
{
    restart_replays_k1(IDEM_STORE_NO_GROUP_COMMIT);
}

/* Near a full map every op of a batch runs in a child txn (group_commit_batch.c,
 * apply_nested): one whose first put succeeds (noted for the log) and whose next meets
 * MDB_MAP_FULL fails alone, its child aborted. Here the op's fn does that itself. */
static idem_code put_then_full(MDB_txn *txn, void *arg)
{
    lmdb_store *ls = arg;
    MDB_val k = {5, "ghost"}, v = {1, "g"};
    return mdb_put(txn, ls->records, &k, &v, 0) == 0
               ? idem__err(IDEM_RESOURCE_EXHAUSTED, "the next put met a full map")
               : IDEM_INTERNAL;
}

/* A batch whose only op failed that way commits nothing: LMDB hands its txnid to the next
 * commit. The log must not hold two entries of one txnid, the replay keeping the first:
 * a claim answered ACQUIRED in the next batch, then the cut (its meta page not synced,
 * the last commit), then the replay. */
Test(wal_cut, a_claim_after_a_batch_that_committed_nothing_survives_the_cut)
{
    idem_store *st;
    power_cut_record(undo, data);
    /* 4 MiB: less room than the commit's reserve (COMMIT_PAGES), every op in a child txn */
    cr_assert_eq(idem_store_open_lmdb(&st, store_dir, 4u << 20, 0), IDEM_OK, "%s", idem_errmsg());
    lmdb_store *ls = (lmdb_store *)st;
    cr_assert_eq(idem__gc_write(&ls->gc, put_then_full, ls), IDEM_RESOURCE_EXHAUSTED, "%s",
                 idem_errmsg());
    idem_claim_req r = {
        .key = {"c", "s.Note/Put", "claimed"}, .owner = 7, .now_ms = idem__now_ms()};
    r.lease_until_ms = r.now_ms + 600000;
    r.expires_ms = r.lease_until_ms + 600000;
    idem_claim_outcome out;
    cr_assert_eq(idem_store_claim(st, &r, &out, NULL), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(out, IDEM_CLAIM_ACQUIRED);
    cut_then_close(st);
    cr_assert_eq(idem_store_open_lmdb(&st, store_dir, 4u << 20, 0), IDEM_OK, "%s", idem_errmsg());
    idem_record rec;
    idem_code c = idem_store_get(st, &r.key, &rec);
    cr_expect_eq(c, IDEM_OK,
                 "the claim answered ACQUIRED is lost: %s (another caller can "
                 "claim the key and run it a second time)",
                 idem_code_name(c));
    if (c == IDEM_OK) {
        idem_record_clear(&rec);
    }
    idem_store_close(st);
}

/* A key in the main db, written through group commit as a write the log does not name (a
 * batch that waits in the pipe for LMDB's sync). */
static idem_code put_raw(MDB_txn *txn, void *key)
{
    MDB_dbi dbi;
    MDB_val k = {strlen(key), key}, v = {1, "1"};
    int rc = mdb_dbi_open(txn, NULL, 0, &dbi);
    if (rc == 0) {
        rc = mdb_put(txn, dbi, &k, &v, 0);
    }
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "put");
}

/* A wrap commits the new epoch to the store. When that commit's fdatasync fails, the
 * batch waiting in the pipe had its meta page dropped with it ("fsyncgate"): the next
 * sync that succeeds must not vouch for it. The epoch's commit keeps group commit's
 * rules for a failed sync (group_commit_sync.c), as every other commit does. */
Test(wal_cut, a_wrap_whose_epoch_commit_fails_its_sync_answers_no_batch_it_dropped)
{
    idem_store *st;
    cr_assert_eq(mkdir(store_dir, 0700), 0);
    power_cut_record(undo, data);
    cr_assert_eq(idem_store_open_lmdb(&st, store_dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    lmdb_store *ls = (lmdb_store *)st;
    cr_assert(idem__wal_on(ls->gc.wal));
    ls->gc.wal->off = WAL_WRAP; /* the writer thread is idle: the next batch wraps */
    power_cut_plan("pf");       /* the batch's commit syncs; the epoch's commit fails */
    idem_code code = idem__gc_write(&ls->gc, put_raw, "b");
    cr_expect_eq(power_cut_plan_left(), 0, "every step of the plan was taken");
    idem_store_close(st);
    power_cut_record(NULL, NULL);
    cr_assert_geq(power_cut_apply(undo, data), 1);
    cr_expect(code != IDEM_OK || tu_lmdb_has_key(store_dir, "b"),
              "b was answered OK, and is lost after the cut");
}

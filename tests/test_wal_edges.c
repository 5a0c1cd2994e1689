/* The store's write-ahead log (src/store/lmdb/wal.h) at its edges, without a power cut:
 * a disk that fails data.mdb's fdatasync (failing_disk.c), a large entry, a mistyped
 * path. Each test failed on the log's first version (a stranger's review). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "failing_disk.h"
#include "lmdb_internal.h"
#include "supplemental.h"
#include "wal_priv.h"
#include "testutil.h"

static char *dir;
static idem_store *st;

static void setup(void)
{
    dir = tu_tempdir("walrev");
    atomic_store(&failing_syncs, 0);
    atomic_store(&failing_log_syncs, 0);
}

static void teardown(void)
{
    atomic_store(&failing_syncs, 0);
    atomic_store(&failing_log_syncs, 0);
    idem_store_close(st);
    st = NULL;
    tu_rmtree(dir);
}

TestSuite(wal_edges, .init = setup, .fini = teardown, .timeout = 60);

static idem_claim_req claim_req(const char *key)
{
    idem_claim_req r = {
        .key = {"c", "wal.Test/Write", key}, .owner = idem__random_u64(), .now_ms = idem__now_ms()};
    r.lease_until_ms = r.now_ms + 60000;
    r.expires_ms = r.lease_until_ms + 60000;
    return r;
}

/* Claims key and completes it with value; 0 when both answered OK. */
static int put(const char *key, const char *value)
{
    idem_claim_req r = claim_req(key);
    idem_claim_outcome out;
    return idem_store_claim(st, &r, &out, NULL) == IDEM_OK && out == IDEM_CLAIM_ACQUIRED &&
                   idem_store_complete(st, &r.key, r.owner, value, strlen(value), r.expires_ms) ==
                       IDEM_OK
               ? 0
               : 1;
}

/* A write whose commit (and its redo) fails is answered with an error; its log entry
 * was flushed all the same. Nothing commits after it in this process; the next open
 * must not apply it (docs/semantics.md: a claim whose commit and redo fail: "nothing is
 * recorded, the retry runs"). */
Test(wal_edges, a_claim_answered_with_an_error_is_not_applied_at_the_next_open)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(put("before", "b"), 0, "a write before the failures, logged");
    idem_claim_req r = claim_req("failed");
    idem_claim_outcome out;
    atomic_store(&failing_syncs, 1000); /* data.mdb: every commit and sync fails */
    idem_code c = idem_store_claim(st, &r, &out, NULL);
    cr_assert_neq(c, IDEM_OK, "the claim is answered with an error");
    idem_store_close(st);
    st = NULL;
    atomic_store(&failing_syncs, 0);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    idem_key_ref ref = {"c", "wal.Test/Write", "failed"};
    idem_record rec;
    idem_code got = idem_store_get(st, &ref, &rec);
    cr_expect_eq(got, IDEM_NOT_FOUND, "a claim answered %s is recorded after a restart (%s)",
                 idem_code_name(c), idem_code_name(got));
    if (got == IDEM_OK) {
        idem_record_clear(&rec);
    }
}

/* wal.h: "The file is written with zeros to WAL_SIZE when created, so that an entry
 * overwrites blocks it has (no size change to journal)": an entry larger than what is
 * left of those blocks grows the file, for good (the brief asks for a bounded entry and
 * a bounded file). */
Test(wal_edges, one_large_result_leaves_the_log_within_its_presized_file)
{
    enum { LARGE = 4 << 20 };
    char path[600];
    struct stat sb;
    snprintf(path, sizeof(path), "%s/wal.log", dir);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    char *value = malloc(LARGE + 1);
    cr_assert_not_null(value);
    memset(value, 'v', LARGE);
    value[LARGE] = '\0';
    cr_assert_eq(put("large", value), 0, "%s", idem_errmsg());
    free(value);
    idem_store_close(st);
    st = NULL;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(stat(path, &sb), 0);
    cr_expect_leq(sb.st_size, (off_t)WAL_SIZE, "wal.log holds %lld bytes after a reopen",
                  (long long)sb.st_size);
}

/* store.h: IDEM_STORE_EXISTING opens "only a directory that already holds an idemrpc
 * store: IDEM_NOT_FOUND, and nothing created, for ... another program's LMDB environment"
 * (idemctl on a mistyped path). The log is opened (created, presized, its header
 * written) before the databases are looked for: here over that program's own wal.log. */
Test(wal_edges, opening_another_programs_lmdb_environment_writes_nothing_there)
{
    char path[600], got[64] = {0};
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    MDB_val k = {1, "k"}, v = {1, "v"};
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_open(env, dir, 0, 0600), 0);
    cr_assert_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    cr_assert_eq(mdb_put(txn, dbi, &k, &v, 0), 0);
    cr_assert_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    snprintf(path, sizeof(path), "%s/wal.log", dir);
    FILE *f = fopen(path, "w"); /* that program's own log */
    cr_assert_not_null(f);
    cr_assert_eq(fputs("its own log", f) >= 0, true);
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_EXISTING), IDEM_NOT_FOUND, "%s",
                 idem_errmsg());
    f = fopen(path, "r");
    cr_assert_not_null(f);
    size_t n = fread(got, 1, sizeof(got) - 1, f);
    fclose(f);
    cr_expect(n == strlen("its own log") && strcmp(got, "its own log") == 0,
              "its wal.log was written over (%zu bytes read, starting \"%.8s\")", n, got);
}

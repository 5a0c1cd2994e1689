/* Stores that say what they are (docs/upgrading.md): an LMDB store records its format in
 * its meta database; a binary refuses a store of a newer format than it knows, clearly,
 * and changes nothing in it; a store without the record (before 0.4) opens as format 1. */
#include <criterion/criterion.h>
#include <lmdb.h>
#include <stdio.h>
#include <string.h>

#include "store.h"
#include "testutil.h"

static char *dir;

static void format_setup(void)
{
    idem_store *st = tu_store_open("format", &dir);
    idem_store_close(st);
}

static void format_teardown(void)
{
    tu_rmtree(dir);
    dir = NULL;
}

TestSuite(format, .init = format_setup, .fini = format_teardown);

/* meta "format" of the closed store at dir: -1 when absent; value (be32) < 0: delete it. */
static long raw_format(long value)
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi meta;
    MDB_val k = {6, "format"}, v;
    long out = -1;
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_set_maxdbs(env, 64), 0);
    cr_assert_eq(mdb_env_open(env, dir, MDB_NOSYNC, 0600), 0);
    cr_assert_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, "meta", 0, &meta), 0);
    if (mdb_get(txn, meta, &k, &v) == 0 && v.mv_size == 4) {
        const unsigned char *p = v.mv_data;
        out = (long)p[0] << 24 | (long)p[1] << 16 | (long)p[2] << 8 | p[3];
    }
    if (value == -2) {
        int rc = mdb_del(txn, meta, &k, NULL);
        cr_assert(rc == 0 || rc == MDB_NOTFOUND);
    } else if (value >= 0) {
        unsigned char b[4] = {(unsigned char)(value >> 24), (unsigned char)(value >> 16),
                              (unsigned char)(value >> 8), (unsigned char)value};
        v = (MDB_val){4, b};
        cr_assert_eq(mdb_put(txn, meta, &k, &v, 0), 0);
    }
    cr_assert_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    return out;
}

Test(format, a_new_lmdb_store_records_format_1)
{
    cr_expect_eq(raw_format(-1), 1);
}

Test(format, an_lmdb_store_of_a_newer_format_is_refused_and_left_as_it_is)
{
    idem_store *st = NULL;
    raw_format(2);
    unsigned modes[] = {0, IDEM_STORE_READONLY, IDEM_STORE_EXISTING};
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
        cr_expect_eq(idem_store_open_lmdb(&st, dir, 0, modes[i]), IDEM_FAILED_PRECONDITION,
                     "mode %zu", i);
        cr_expect_null(st);
        cr_expect(strstr(idem_errmsg(), "has format 2, newer than the 1") != NULL, "%s",
                  idem_errmsg());
    }
    cr_expect_eq(raw_format(-1), 2, "the refusal wrote nothing");
}

Test(format, an_lmdb_store_from_before_the_format_record_opens_as_format_1)
{
    idem_store *st = NULL;
    raw_format(-2);
    cr_assert_eq(raw_format(-1), -1);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_READONLY), IDEM_OK, "%s",
                 idem_errmsg());
    idem_store_close(st);
    cr_expect_eq(raw_format(-1), -1, "a read-only open writes nothing");
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    idem_store_close(st);
    cr_expect_eq(raw_format(-1), 1, "the first read-write open records it");
}

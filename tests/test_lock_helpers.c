/* The lock helpers as a user needs them (issue 26, item 5): a locked update's callbacks
 * get the lock (its fencing token goes into the row they write), a fence can take the
 * lock handle, and idem_txn_pg_conn works inside a locked update on PostgreSQL. Run as
 * `lock_helpers` (LMDB) and `lock_helpers_pg`. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static tu_backend backend;
static idem_store *st;

static void setup(void)
{
    st = tu_backend_open(&backend, "lockh");
}

static void teardown(void)
{
    tu_backend_close(&backend);
    st = NULL;
}

TestSuite(lock_helpers, .init = setup, .fini = teardown);

typedef struct settle {
    uint64_t checked_with, written_with;
    bool had_conn;
} settle;

/* Done before when the settlement row exists. */
static idem_code not_settled(idem_txn *t, const idem_lock *lock, void *arg)
{
    settle *s = arg;
    const void *v;
    size_t n;
    s->checked_with = idem_lock_token(lock);
    idem_code code = idem_txn_get(t, "settlements", "M7:2024-05-01", 13, &v, &n);
    return code == IDEM_OK ? IDEM_ALREADY_EXISTS : code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* The row records which holder wrote it: the fencing token. */
static idem_code write_settlement(idem_txn *t, const idem_lock *lock, void *arg)
{
    settle *s = arg;
    char row[32];
    s->written_with = idem_lock_token(lock);
    s->had_conn = idem_txn_pg_conn(t) != NULL;
    int n = snprintf(row, sizeof(row), "token=%llu", (unsigned long long)s->written_with);
    return idem_txn_put(t, "settlements", "M7:2024-05-01", 13, row, (size_t)n);
}

Test(lock_helpers, a_locked_updates_callbacks_get_the_fencing_token)
{
    settle s = {0};
    idem_locked_outcome out;
    idem_lock_opts o = {.lease_ms = 1000};
    cr_assert_eq(idem_locked_update_with(st, "shop", "settle:M7", &o, not_settled, write_settlement,
                                         &s, &out),
                 IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(out, IDEM_LOCKED_UPDATED);
    cr_expect_gt(s.written_with, 0);
    cr_expect_eq(s.checked_with, s.written_with, "check and update see the same holder");
    char want[32];
    snprintf(want, sizeof(want), "token=%llu", (unsigned long long)s.written_with);
    cr_expect_str_eq(tu_app_value(st, "settlements", "M7:2024-05-01"), want,
                     "the row says which holder wrote it");
    cr_expect_eq(s.had_conn, tu_backend_is_pg(), "idem_txn_pg_conn in a locked update");

    settle again = {0};
    cr_assert_eq(idem_locked_update_with(st, "shop", "settle:M7", &o, not_settled, write_settlement,
                                         &again, &out),
                 IDEM_OK);
    cr_expect_eq(out, IDEM_LOCKED_ALREADY_DONE);
    cr_expect_gt(again.checked_with, s.written_with, "a later holder has a larger token");
    cr_expect_eq(again.written_with, 0, "no update");
}

typedef struct fenced {
    const idem_lock *lock;
    uint64_t older;
} fenced;

static idem_code fence_by_handle(idem_txn *t, void *arg)
{
    const fenced *f = arg;
    return idem_txn_fence_lock(t, f->lock);
}

static idem_code fence_older(idem_txn *t, void *arg)
{
    const fenced *f = arg;
    return idem_txn_fence(t, idem_lock_scope(f->lock), idem_lock_name(f->lock), f->older);
}

Test(lock_helpers, a_fence_takes_the_lock_handle)
{
    idem_lock *l;
    idem_lock_opts o = {.lease_ms = 1000};
    cr_assert_eq(idem_lock_acquire(st, "shop", "settle:M8", &o, &l), IDEM_OK);
    uint64_t first = idem_lock_token(l); /* an earlier holder's */
    cr_assert_eq(idem_lock_release(l), IDEM_OK);
    cr_assert_eq(idem_lock_acquire(st, "shop", "settle:M8", &o, &l), IDEM_OK);
    fenced f = {l, first};
    cr_expect_eq(idem_store_run_txn(st, fence_by_handle, &f), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(idem_store_run_txn(st, fence_older, &f), IDEM_ABORTED,
                 "the handle raised the fence to its own token");
    f.lock = NULL;
    cr_expect_eq(idem_store_run_txn(st, fence_by_handle, &f), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_lock_release(l), IDEM_OK);
}

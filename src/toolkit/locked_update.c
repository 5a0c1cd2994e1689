/* 一锁、二判、三更新 in one call: lock, check, update in one fenced txn, release.
 *
 * The check runs inside the txn and after the fence, so it sees everything an earlier
 * holder committed, even one whose lease had passed while it worked; the update commits
 * with the fence raised to this holder's token, so a superseded holder that comes back
 * later is refused. The lock only keeps the contenders from doing the work twice at
 * once; the fence and the check keep the data right when the lock did not. */
#include "lock_internal.h"

typedef struct locked_txn {
    const idem_lock *lock;
    idem_txn_fn check, update;              /* idem_locked_update's */
    idem_locked_fn check_with, update_with; /* or idem_locked_update_with's */
    void *arg;
    bool done_before;
} locked_txn;

static idem_code run_check(idem_txn *t, const locked_txn *a)
{
    return a->check_with != NULL ? a->check_with(t, a->lock, a->arg)
           : a->check != NULL    ? a->check(t, a->arg)
                                 : IDEM_OK;
}

static idem_code locked_txn_fn(idem_txn *t, void *arg)
{
    locked_txn *a = arg;
    idem_code code = idem_txn_fence_lock(t, a->lock);
    if (code == IDEM_OK && (code = run_check(t, a)) == IDEM_ALREADY_EXISTS) {
        a->done_before = true; /* rolled back: nothing to write, not even the fence */
        return code;
    }
    if (code != IDEM_OK) {
        return code;
    }
    return a->update_with != NULL ? a->update_with(t, a->lock, a->arg) : a->update(t, a->arg);
}

/* Both forms: a carries the callbacks. */
static idem_code locked_update(idem_store *st, const char *scope, const char *name,
                               const idem_lock_opts *opts, locked_txn *a,
                               idem_locked_outcome *outcome)
{
    idem_lock *l;
    idem_code code;
    if (st == NULL || (a->update == NULL && a->update_with == NULL)) {
        return idem__err(IDEM_INVALID_ARGUMENT, "locked update needs a store and an update");
    }
    if ((code = idem_lock_acquire(st, scope, name, opts, &l)) != IDEM_OK) {
        return code;
    }
    a->lock = l;
    code = idem_store_run_txn(st, locked_txn_fn, a);
    if (a->done_before) {
        code = IDEM_OK;
    }
    idem_errkeep keep;
    idem__err_keep(&keep);
    idem_lock_release(l); /* its outcome changes nothing: the txn is decided */
    idem__err_put(&keep, code);
    if (code == IDEM_OK && outcome != NULL) {
        *outcome = a->done_before ? IDEM_LOCKED_ALREADY_DONE : IDEM_LOCKED_UPDATED;
    }
    return code;
}

idem_code idem_locked_update(idem_store *st, const char *scope, const char *name,
                             const idem_lock_opts *opts, idem_txn_fn check, idem_txn_fn update,
                             void *arg, idem_locked_outcome *outcome)
{
    locked_txn a = {.check = check, .update = update, .arg = arg};
    return locked_update(st, scope, name, opts, &a, outcome);
}

idem_code idem_locked_update_with(idem_store *st, const char *scope, const char *name,
                                  const idem_lock_opts *opts, idem_locked_fn check,
                                  idem_locked_fn update, void *arg, idem_locked_outcome *outcome)
{
    locked_txn a = {.check_with = check, .update_with = update, .arg = arg};
    return locked_update(st, scope, name, opts, &a, outcome);
}

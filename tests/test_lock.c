/* Tests of the lease lock and its fencing tokens (lock.h). One suite for both stores:
 * meson runs it as `lock` on LMDB and as `lock_pg` on PostgreSQL
 * (IDEMRPC_TEST_BACKEND=postgres). Every test gets a fresh store (its own temp dir or
 * schema) and removes it. Waiting is on conditions (a lock's release, a latch) and on
 * the lock's own bounded waits, never on sleeps. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "testutil.h"

static tu_backend backend;
static idem_store *st;

static void store_setup(void)
{
    st = tu_backend_open(&backend, "lock");
}

static void store_teardown(void)
{
    tu_backend_close(&backend);
    st = NULL;
}

TestSuite(lock, .init = store_setup, .fini = store_teardown);
TestSuite(fence, .init = store_setup, .fini = store_teardown);
TestSuite(locked_update, .init = store_setup, .fini = store_teardown);
TestSuite(call_lock, .init = store_setup, .fini = store_teardown);

/* ---- helpers ---- */

static idem_lock *take(const char *scope, const char *name, const idem_lock_opts *o)
{
    idem_lock *l = NULL;
    idem_code code = idem_lock_acquire(st, scope, name, o, &l);
    cr_assert_eq(code, IDEM_OK, "acquire %s: %s %s", name, idem_code_name(code), idem_errmsg());
    cr_assert_not_null(l);
    return l;
}

/* The value of db/key as a string ("" when absent), read outside any txn. */
static const char *app_value(const char *db, const char *key)
{
    return tu_app_value(st, db, key);
}

typedef struct fenced_put {
    const char *scope, *name;
    uint64_t token;
    const char *key, *val;
} fenced_put;

/* Fence first, then write: the recipe. */
static idem_code fenced_put_fn(idem_txn *t, void *arg)
{
    fenced_put *a = arg;
    idem_code code = idem_txn_fence(t, a->scope, a->name, a->token);
    return code != IDEM_OK
               ? code
               : idem_txn_put(t, "settlement", a->key, strlen(a->key), a->val, strlen(a->val));
}

static idem_code fenced_write(const idem_lock *l, const char *key, const char *val)
{
    fenced_put a = {idem_lock_scope(l), idem_lock_name(l), idem_lock_token(l), key, val};
    return idem_store_run_txn(st, fenced_put_fn, &a);
}

/* ---- acquire, release, tokens ---- */

Test(lock, a_held_lock_is_busy_until_its_release_frees_it)
{
    idem_lock *a = take("shop", "settle:M1:2024-05-01", NULL), *b = NULL;
    uint64_t first = idem_lock_token(a);
    cr_expect_neq(first, 0, "every acquisition has a fencing token");
    cr_expect_str_eq(idem_lock_name(a), "settle:M1:2024-05-01");
    cr_expect_str_eq(idem_lock_scope(a), "shop");
    cr_expect_eq(idem_lock_acquire(st, "shop", "settle:M1:2024-05-01", NULL, &b), IDEM_ABORTED);
    cr_expect_null(b);
    cr_expect(strstr(idem_errmsg(), "held by another holder") != NULL, "%s", idem_errmsg());
    cr_assert_eq(idem_lock_release(a), IDEM_OK, "%s", idem_errmsg());
    b = take("shop", "settle:M1:2024-05-01", NULL);
    cr_expect_gt(idem_lock_token(b), first, "a later acquisition has a larger token");
    cr_expect_eq(idem_lock_release(b), IDEM_OK);
}

Test(lock, tokens_strictly_increase_across_acquisitions_and_names)
{
    uint64_t last = 0;
    for (int i = 0; i < 20; i++) {
        idem_lock *l = take("shop", i % 2 ? "recon" : "settle", NULL);
        cr_expect_gt(idem_lock_token(l), last, "acquisition %d", i);
        last = idem_lock_token(l);
        cr_assert_eq(idem_lock_release(l), IDEM_OK);
    }
}

Test(lock, locks_are_scoped_by_caller)
{
    idem_lock *a = take("tenant-a", "settle", NULL), *b = take("tenant-b", "settle", NULL);
    idem_lock *none = take(NULL, "settle", NULL); /* the empty scope is a scope too */
    cr_expect_neq(idem_lock_token(a), idem_lock_token(b));
    cr_expect_eq(idem_lock_release(a), IDEM_OK);
    cr_expect_eq(idem_lock_release(b), IDEM_OK);
    cr_expect_eq(idem_lock_release(none), IDEM_OK);
}

static void expect_refused(const char *scope, const char *name, const idem_lock_opts *o,
                           const char *says)
{
    idem_lock *l = (idem_lock *)1;
    cr_expect_eq(idem_lock_acquire(st, scope, name, o, &l), IDEM_INVALID_ARGUMENT, "%s", says);
    cr_expect_null(l, "nothing is handed out for %s", says);
    cr_expect(strstr(idem_errmsg(), says) != NULL, "\"%s\" not in \"%s\"", says, idem_errmsg());
}

Test(lock, bad_input_gets_invalid_argument_naming_the_fault)
{
    char long_name[IDEM_LOCK_MAX_NAME + 2], long_scope[IDEM_MAX_CALLER + 2];
    memset(long_name, 'n', sizeof(long_name) - 1);
    long_name[sizeof(long_name) - 1] = '\0';
    memset(long_scope, 's', sizeof(long_scope) - 1);
    long_scope[sizeof(long_scope) - 1] = '\0';
    expect_refused("shop", NULL, NULL, "lock name must be 1..255 bytes");
    expect_refused("shop", "", NULL, "lock name must be 1..255 bytes");
    expect_refused("shop", long_name, NULL, "lock name must be 1..255 bytes");
    expect_refused("shop", "a\nb", NULL, "without control characters");
    expect_refused("shop", "\xff\xfe", NULL, "UTF-8");
    expect_refused(long_scope, "settle", NULL, "lock scope must be 0..127 bytes");
    expect_refused("sh\top", "settle", NULL, "lock scope");
    expect_refused("shop", "settle", &(idem_lock_opts){.lease_ms = 50}, "lock lease must be");
    expect_refused("shop", "settle", &(idem_lock_opts){.lease_ms = IDEM_LOCK_MAX_LEASE_MS + 1},
                   "lock lease must be");
    expect_refused("shop", "settle", &(idem_lock_opts){.wait_ms = IDEM_LOCK_MAX_WAIT_MS + 1},
                   "lock wait must be");
    expect_refused("shop", "settle", &(idem_lock_opts){.max_hold_ms = IDEM_LOCK_MAX_HOLD_MS + 1},
                   "lock hold must be");
    long_name[IDEM_LOCK_MAX_NAME] = '\0'; /* exactly the bound: accepted */
    idem_lock *l = take("shop", long_name, NULL);
    cr_expect_eq(idem_lock_release(l), IDEM_OK);
    cr_expect_eq(idem_lock_acquire(NULL, "shop", "settle", NULL, &l), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_lock_acquire(st, "shop", "settle", NULL, NULL), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_lock_release(NULL), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_lock_renew(NULL), IDEM_INVALID_ARGUMENT);
}

Test(lock, a_record_under_the_name_that_is_not_a_lock_is_refused)
{
    idem_claim_req req = {.key = {"shop", IDEM_LOCK_METHOD, "odd"}, .owner = 7};
    idem_claim_outcome out;
    req.now_ms = idem__now_ms();
    req.lease_until_ms = req.expires_ms = req.now_ms + 60000;
    memset(req.fingerprint, 0xab, sizeof(req.fingerprint));
    cr_assert_eq(idem_store_claim(st, &req, &out, NULL), IDEM_OK, "%s", idem_errmsg());
    idem_lock *l = NULL;
    cr_expect_eq(idem_lock_acquire(st, "shop", "odd", NULL, &l), IDEM_FAILED_PRECONDITION);
    cr_expect(strstr(idem_errmsg(), "not a lock") != NULL, "%s", idem_errmsg());
    cr_expect_null(l);
}

/* ---- leases ---- */

Test(lock, a_live_holder_is_renewed_past_its_lease)
{
    idem_lock_opts o = {.lease_ms = 300};
    idem_lock *a = take("shop", "settle", &o), *b = NULL;
    uint64_t t0 = idem__mono_ms();
    /* Waits more than three leases: the keeper renews a's lease every 100 ms. */
    idem_lock_opts contender = {.lease_ms = 300, .wait_ms = 1000};
    cr_expect_eq(idem_lock_acquire(st, "shop", "settle", &contender, &b), IDEM_ABORTED,
                 "a live holder keeps its lock");
    cr_expect_geq(idem__mono_ms() - t0, 1000, "the contender waited its whole bound");
    cr_expect_eq(idem_lock_renew(a), IDEM_OK, "still the holder's: %s", idem_errmsg());
    cr_expect_eq(idem_lock_release(a), IDEM_OK, "%s", idem_errmsg());
}

Test(lock, a_holder_that_stops_renewing_loses_it_once_its_lease_has_passed)
{
    idem_lock_opts manual = {.lease_ms = 300, .manual_renew = true};
    uint64_t t0 = idem__mono_ms();
    idem_lock *a = take("shop", "settle", &manual);
    idem_lock *b = take("shop", "settle", &(idem_lock_opts){.wait_ms = 5000});
    uint64_t waited = idem__mono_ms() - t0;
    cr_expect_geq(waited, 280, "not taken over before the lease (%llu ms)",
                  (unsigned long long)waited);
    cr_expect_lt(waited, 2000, "taken soon after the lease (%llu ms)", (unsigned long long)waited);
    cr_expect_gt(idem_lock_token(b), idem_lock_token(a));
    cr_expect_eq(idem_lock_renew(a), IDEM_ABORTED, "a learns that it lost the lock");
    cr_expect(strstr(idem_errmsg(), "was lost") != NULL, "%s", idem_errmsg());
    cr_expect_eq(idem_lock_release(a), IDEM_ABORTED, "a's release cannot free b's lock");
    cr_expect_eq(idem_lock_renew(b), IDEM_OK, "b still holds it: %s", idem_errmsg());
    cr_expect_eq(idem_lock_release(b), IDEM_OK);
}

/* A one-shot event between threads. */
typedef struct latch {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool set;
} latch;

#define LATCH_INIT                                                                                 \
    {                                                                                              \
        PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false                                 \
    }

static void latch_set(latch *l)
{
    pthread_mutex_lock(&l->mu);
    l->set = true;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

static void latch_wait(latch *l)
{
    pthread_mutex_lock(&l->mu);
    while (!l->set) {
        pthread_cond_wait(&l->cv, &l->mu);
    }
    pthread_mutex_unlock(&l->mu);
}

typedef struct waiter {
    latch started;
    idem_lock *got;
    idem_code code;
    uint64_t waited_ms;
} waiter;

static void *wait_for_settle(void *arg)
{
    waiter *w = arg;
    latch_set(&w->started);
    uint64_t t0 = idem__mono_ms();
    w->code = idem_lock_acquire(st, "shop", "settle", &(idem_lock_opts){.wait_ms = 20000}, &w->got);
    w->waited_ms = idem__mono_ms() - t0;
    return NULL;
}

Test(lock, a_waiter_gets_the_lock_at_its_release_not_at_the_end_of_the_lease)
{
    idem_lock *a = take("shop", "settle", &(idem_lock_opts){.lease_ms = 60000});
    waiter w = {.started = LATCH_INIT};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, wait_for_settle, &w), 0);
    latch_wait(&w.started);
    cr_expect_eq(idem_lock_release(a), IDEM_OK);
    pthread_join(th, NULL);
    cr_assert_eq(w.code, IDEM_OK, "%s", idem_errmsg());
    cr_expect_lt(w.waited_ms, 2000, "woken by the release (%llu ms), the lease had 60 s",
                 (unsigned long long)w.waited_ms);
    cr_expect_eq(idem_lock_release(w.got), IDEM_OK);
}

Test(lock, a_lock_whose_lease_passed_is_swept_and_its_holder_learns_it)
{
    idem_lock *live = take("shop", "live", NULL);
    idem_lock *old = take("shop", "old", &(idem_lock_opts){.lease_ms = 100, .manual_renew = true});
    uint64_t old_token = idem_lock_token(old);
    size_t n = 0;
    cr_assert_eq(idem_store_sweep(st, idem__now_ms(), 100, &n), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(n, 0, "a live lease is never swept");
    /* An hour from now, as the sweeper would see it then: the manual lock's lease has
     * long passed (the live one's too: it is not renewed an hour ahead). */
    cr_assert_eq(idem_store_sweep(st, idem__now_ms() + 3600000, 100, &n), IDEM_OK);
    cr_expect_eq(n, 2);
    cr_expect_eq(idem_lock_renew(old), IDEM_ABORTED);
    cr_expect_eq(idem_lock_release(old), IDEM_ABORTED);
    cr_expect_eq(idem_lock_release(live), IDEM_ABORTED);
    idem_lock *again = take("shop", "old", NULL);
    cr_expect_gt(idem_lock_token(again), old_token, "the fence counter survives the sweep");
    cr_expect_eq(idem_lock_release(again), IDEM_OK);
}

/* ---- fencing ---- */

typedef struct fence_args {
    const char *scope, *name;
    uint64_t token;
} fence_args;

static idem_code fence_fn(idem_txn *t, void *arg)
{
    fence_args *a = arg;
    return idem_txn_fence(t, a->scope, a->name, a->token);
}

static idem_code fence(const char *scope, const char *name, uint64_t token)
{
    fence_args a = {scope, name, token};
    return idem_store_run_txn(st, fence_fn, &a);
}

Test(fence, passes_the_same_token_again_raises_a_newer_and_refuses_an_older)
{
    cr_expect_eq(fence("shop", "settle", 5), IDEM_OK, "the first token of a lock");
    cr_expect_eq(fence("shop", "settle", 5), IDEM_OK, "the same holder writes again");
    cr_expect_eq(fence("shop", "settle", 7), IDEM_OK, "a newer holder");
    cr_expect_eq(fence("shop", "settle", 6), IDEM_ABORTED, "an older holder");
    cr_expect(strstr(idem_errmsg(), "fenced: token 6") != NULL, "%s", idem_errmsg());
    cr_expect_eq(fence("shop", "settle", 5), IDEM_ABORTED);
    cr_expect_eq(fence("shop", "recon", 1), IDEM_OK, "each lock has its own fence");
    cr_expect_eq(fence("other", "settle", 1), IDEM_OK, "each scope has its own fence");
    cr_expect_eq(fence("shop", "settle", 0), IDEM_INVALID_ARGUMENT, "0 is no token");
    cr_expect_eq(fence("shop", "", 3), IDEM_INVALID_ARGUMENT);
}

static const char *const settle_states[] = {"OPEN", "SETTLED"};
static const idem_sm_transition settle_moves[] = {{"OPEN", "SETTLED"}};
static const idem_state_machine settlements = {"settle_state", settle_states, 2, settle_moves, 1};

/* A holder's settlement txn, the recipe: fence first, then read and write through every
 * toolkit writer (a key-value put, a read-modify-write of a versioned record, a state
 * machine advance). */
typedef struct holder_txn {
    const idem_lock *l;
    const char *val;
    bool fence_last; /* a blind write before the fence: the fence still aborts it all */
} holder_txn;

static idem_code holder_fence(idem_txn *t, const holder_txn *a)
{
    return idem_txn_fence(t, idem_lock_scope(a->l), idem_lock_name(a->l), idem_lock_token(a->l));
}

static idem_code settle_everything(idem_txn *t, void *arg)
{
    holder_txn *a = arg;
    const void *cur;
    size_t n;
    uint64_t version;
    idem_sm_outcome out;
    idem_code code = a->fence_last ? IDEM_OK : holder_fence(t, a);
    if (code != IDEM_OK ||
        (code = idem_txn_put(t, "settlement", "M1:D1", 5, a->val, strlen(a->val))) != IDEM_OK ||
        (code = idem_versioned_get(t, "totals", "M1", 2, &cur, &n, &version)) != IDEM_OK ||
        (code = idem_versioned_put(t, "totals", "M1", 2, version, a->val, strlen(a->val), NULL)) !=
            IDEM_OK ||
        (code = idem_sm_advance(t, &settlements, "M1:D1", "OPEN", "SETTLED", &out)) != IDEM_OK) {
        return code;
    }
    return a->fence_last ? holder_fence(t, a) : IDEM_OK;
}

static idem_code open_day(idem_txn *t, void *arg)
{
    (void)arg;
    idem_code code = idem_sm_create(t, &settlements, "M1:D1", "OPEN");
    return code != IDEM_OK ? code : idem_versioned_put(t, "totals", "M1", 2, 0, "0", 1, NULL);
}

/* The stopped holder: A stops (a SIGSTOP, a GC pause: it does not renew) past its lease,
 * B takes the lock when A's lease has passed and writes, A resumes and writes. */
Test(fence, a_stopped_holder_cannot_overwrite_what_its_successor_wrote)
{
    cr_assert_eq(idem_store_run_txn(st, open_day, NULL), IDEM_OK, "%s", idem_errmsg());
    idem_lock *a =
        take("shop", "settle:M1:D1", &(idem_lock_opts){.lease_ms = 300, .manual_renew = true});
    cr_assert_eq(fenced_write(a, "note", "A before the pause"), IDEM_OK, "%s", idem_errmsg());

    /* A is stopped now. B waits on the lease condition: acquires once A's lease passed. */
    idem_lock *b = take("shop", "settle:M1:D1", &(idem_lock_opts){.wait_ms = 5000});
    cr_assert_gt(idem_lock_token(b), idem_lock_token(a));
    holder_txn bw = {b, "B", false};
    cr_assert_eq(idem_store_run_txn(st, settle_everything, &bw), IDEM_OK, "%s", idem_errmsg());

    /* A resumes, unaware, and writes with its old token: refused, whichever comes first. */
    holder_txn aw = {a, "A", false};
    cr_expect_eq(idem_store_run_txn(st, settle_everything, &aw), IDEM_ABORTED,
                 "A's write is refused");
    cr_expect(strstr(idem_errmsg(), "fenced") != NULL, "%s", idem_errmsg());
    holder_txn blind = {a, "A", true};
    cr_expect_eq(idem_store_run_txn(st, settle_everything, &blind), IDEM_ABORTED,
                 "writes before the fence go with the txn");
    cr_expect(strstr(idem_errmsg(), "fenced") != NULL, "%s", idem_errmsg());
    cr_expect_eq(fenced_write(a, "note", "A after the pause"), IDEM_ABORTED);

    /* B's writes stand, all of them. */
    cr_expect_str_eq(app_value("settlement", "M1:D1"), "B");
    cr_expect_str_eq(app_value("settlement", "note"), "A before the pause");
    void *v;
    size_t n;
    uint64_t version;
    cr_assert_eq(idem_store_versioned_get(st, "totals", "M1", 2, &v, &n, &version), IDEM_OK);
    cr_expect_eq(version, 2, "one versioned write: B's");
    cr_expect(n == 1 && memcmp(v, "B", 1) == 0);
    free(v);
    char state[IDEM_SM_MAX_STATE + 1];
    cr_assert_eq(idem_store_sm_get(st, &settlements, "M1:D1", state, sizeof(state)), IDEM_OK);
    cr_expect_str_eq(state, "SETTLED");
    cr_expect_eq(idem_lock_release(a), IDEM_ABORTED, "A learns it had lost the lock");
    cr_expect_eq(idem_lock_release(b), IDEM_OK);
}

/* ---- contention ---- */

#define CONTENDERS 16
#define ROUNDS 3

typedef struct contention {
    atomic_int inside, most_inside, acquired;
    atomic_int refused; /* acquisitions out of their bound, fenced writes or releases refused */
} contention;

typedef struct contender {
    contention *c;
    pthread_t th;
    uint64_t tokens[ROUNDS];
    idem_code code;
    char msg[256];
} contender;

static idem_code fenced_increment(idem_txn *t, void *arg)
{
    const idem_lock *l = arg;
    const void *v;
    size_t n;
    uint64_t count = 0;
    idem_code code = idem_txn_fence(t, idem_lock_scope(l), idem_lock_name(l), idem_lock_token(l));
    if (code != IDEM_OK) {
        return code;
    }
    code = idem_txn_get(t, "counter", "n", 1, &v, &n);
    if (code == IDEM_OK && n == 8) {
        count = idem__get_be64(v);
    } else if (code != IDEM_NOT_FOUND) {
        return code != IDEM_OK ? code : IDEM_DATA_LOSS;
    }
    uint8_t b[8];
    idem__put_be64(b, count + 1);
    return idem_txn_put(t, "counter", "n", 1, b, 8);
}

static void *contend(void *arg)
{
    contender *me = arg;
    idem_lock_opts o = {.lease_ms = 2000, .wait_ms = 60000};
    for (int r = 0; r < ROUNDS; r++) {
        idem_lock *l;
        if ((me->code = idem_lock_acquire(st, "shop", "hot", &o, &l)) != IDEM_OK) {
            snprintf(me->msg, sizeof(me->msg), "acquire: %s %s", idem_code_name(me->code),
                     idem_errmsg());
            atomic_fetch_add(&me->c->refused, 1);
            return NULL;
        }
        int now_inside = atomic_fetch_add(&me->c->inside, 1) + 1;
        int most = atomic_load(&me->c->most_inside);
        while (now_inside > most &&
               !atomic_compare_exchange_weak(&me->c->most_inside, &most, now_inside)) {
        }
        me->tokens[r] = idem_lock_token(l);
        if ((me->code = idem_store_run_txn(st, fenced_increment, l)) != IDEM_OK) {
            snprintf(me->msg, sizeof(me->msg), "fenced write: %s %s", idem_code_name(me->code),
                     idem_errmsg());
            atomic_fetch_add(&me->c->refused, 1);
        }
        atomic_fetch_sub(&me->c->inside, 1);
        atomic_fetch_add(&me->c->acquired, 1);
        if (idem_lock_release(l) != IDEM_OK) { /* each held it to the end of its lease */
            snprintf(me->msg, sizeof(me->msg), "release: %s", idem_errmsg());
            atomic_fetch_add(&me->c->refused, 1);
        }
    }
    return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

Test(lock, sixteen_contenders_hold_it_one_at_a_time_and_each_gets_it_within_its_bound,
     .timeout = 120)
{
    contention c = {0};
    contender who[CONTENDERS];
    memset(who, 0, sizeof(who));
    for (int i = 0; i < CONTENDERS; i++) {
        who[i].c = &c;
        cr_assert_eq(pthread_create(&who[i].th, NULL, contend, &who[i]), 0);
    }
    for (int i = 0; i < CONTENDERS; i++) {
        pthread_join(who[i].th, NULL);
        cr_expect_eq(who[i].code, IDEM_OK, "contender %d: %s", i, who[i].msg);
    }
    cr_expect_eq(atomic_load(&c.most_inside), 1, "one holder at a time");
    cr_expect_eq(atomic_load(&c.refused), 0);
    cr_expect_eq(atomic_load(&c.acquired), CONTENDERS * ROUNDS, "every contender, every round");
    uint64_t all[CONTENDERS * ROUNDS];
    for (int i = 0; i < CONTENDERS; i++) {
        for (int r = 0; r < ROUNDS; r++) {
            all[i * ROUNDS + r] = who[i].tokens[r];
            cr_expect(r == 0 || who[i].tokens[r] > who[i].tokens[r - 1]);
        }
    }
    qsort(all, CONTENDERS * ROUNDS, sizeof(all[0]), cmp_u64);
    for (int i = 1; i < CONTENDERS * ROUNDS; i++) {
        cr_expect_neq(all[i], all[i - 1], "every acquisition has its own token");
    }
    void *v;
    size_t n;
    cr_assert_eq(idem_store_app_get(st, "counter", "n", 1, &v, &n), IDEM_OK);
    cr_expect_eq(n == 8 ? idem__get_be64(v) : 0, CONTENDERS * ROUNDS, "no fenced write lost");
    free(v);
}

/* ---- a holder in another process ---- */

/* Starts tests/lock_holder on this test's store: it acquires (scope "shop", name),
 * renewed by its keeper, prints its token and waits to be killed. */
static uint64_t spawn_holder(tu_child *c, const char *name, const char *lease_ms)
{
    const char *exe = getenv("LOCK_HOLDER");
    cr_assert_not_null(exe, "LOCK_HOLDER not set (meson sets it)");
    const char *argv[] = {exe,
                          backend.conninfo != NULL ? "--pg" : "--lmdb",
                          backend.conninfo != NULL ? backend.conninfo : backend.dir,
                          "--name",
                          name,
                          "--lease-ms",
                          lease_ms,
                          NULL};
    tu_spawn(c, argv);
    char line[64];
    cr_assert_not_null(fgets(line, sizeof(line), c->out), "no token from the holder");
    return strtoull(line, NULL, 10);
}

Test(lock, a_holder_in_another_process_keeps_it_while_alive_and_loses_it_when_killed)
{
    tu_child holder;
    uint64_t token = spawn_holder(&holder, "nightly", "400");
    cr_assert_gt(token, 0);
    idem_lock *l = NULL;
    uint64_t t0 = idem__mono_ms();
    cr_expect_eq(idem_lock_acquire(st, "shop", "nightly", &(idem_lock_opts){.wait_ms = 1300}, &l),
                 IDEM_ABORTED, "renewed by its process past three leases");
    cr_expect_geq(idem__mono_ms() - t0, 1300);
    cr_assert_eq(kill(holder.pid, SIGKILL), 0);
    cr_expect_eq(tu_reap(&holder), SIGKILL);
    t0 = idem__mono_ms();
    l = take("shop", "nightly", &(idem_lock_opts){.wait_ms = 5000});
    cr_expect_lt(idem__mono_ms() - t0, 2000, "free once the dead holder's lease passed");
    cr_expect_gt(idem_lock_token(l), token);
    cr_expect_eq(idem_lock_release(l), IDEM_OK);
}

/* ---- 一锁二判三更新 ---- */

typedef struct settle_job {
    const char *day_key; /* "M7:2024-05-01" */
    const char *amount;
    int updates;
} settle_job;

static idem_code not_settled_yet(idem_txn *t, void *arg)
{
    settle_job *j = arg;
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, "settlement", j->day_key, strlen(j->day_key), &v, &n);
    return code == IDEM_OK ? IDEM_ALREADY_EXISTS : code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

static idem_code settle_day(idem_txn *t, void *arg)
{
    settle_job *j = arg;
    j->updates++;
    return idem_txn_put(t, "settlement", j->day_key, strlen(j->day_key), j->amount,
                        strlen(j->amount));
}

static idem_code refuse(idem_txn *t, void *arg)
{
    (void)t, (void)arg;
    return idem__err(IDEM_FAILED_PRECONDITION, "the day is not closed yet");
}

Test(locked_update, updates_once_then_reports_already_done)
{
    settle_job j = {"M7:2024-05-01", "1250", 0};
    idem_locked_outcome out = 0;
    idem_lock_opts o = {.wait_ms = 2000};
    cr_assert_eq(idem_locked_update(st, "shop", "settle:M7:2024-05-01", &o, not_settled_yet,
                                    settle_day, &j, &out),
                 IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(out, IDEM_LOCKED_UPDATED);
    cr_assert_eq(idem_locked_update(st, "shop", "settle:M7:2024-05-01", &o, not_settled_yet,
                                    settle_day, &j, &out),
                 IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(out, IDEM_LOCKED_ALREADY_DONE);
    cr_expect_eq(j.updates, 1);
    cr_expect_str_eq(app_value("settlement", "M7:2024-05-01"), "1250");
    idem_lock *l = take("shop", "settle:M7:2024-05-01", NULL); /* released both times */
    cr_expect_eq(idem_lock_release(l), IDEM_OK);
}

Test(locked_update, a_failed_check_or_update_writes_nothing_and_releases_the_lock)
{
    settle_job j = {"M7:2024-05-02", "10", 0};
    idem_locked_outcome out = 0;
    cr_expect_eq(idem_locked_update(st, "shop", "settle:M7", NULL, refuse, settle_day, &j, &out),
                 IDEM_FAILED_PRECONDITION);
    cr_expect(strstr(idem_errmsg(), "not closed yet") != NULL, "%s", idem_errmsg());
    cr_expect_eq(out, 0, "no outcome on an error");
    cr_expect_eq(idem_locked_update(st, "shop", "settle:M7", NULL, NULL, refuse, &j, NULL),
                 IDEM_FAILED_PRECONDITION);
    cr_expect_eq(j.updates, 0);
    cr_expect_str_eq(app_value("settlement", "M7:2024-05-02"), "");
    cr_expect_eq(idem_locked_update(st, "shop", "settle:M7", NULL, NULL, NULL, &j, NULL),
                 IDEM_INVALID_ARGUMENT);
    idem_lock *l = take("shop", "settle:M7", NULL);
    cr_expect_eq(idem_lock_release(l), IDEM_OK);
}

Test(locked_update, a_busy_lock_is_waited_for_within_the_bound)
{
    settle_job j = {"M7:2024-05-03", "10", 0};
    idem_lock *l = take("shop", "settle:M7", NULL);
    cr_expect_eq(idem_locked_update(st, "shop", "settle:M7", &(idem_lock_opts){.wait_ms = 200},
                                    not_settled_yet, settle_day, &j, NULL),
                 IDEM_ABORTED, "held for the whole wait");
    cr_expect_eq(j.updates, 0);
    cr_expect_eq(idem_lock_release(l), IDEM_OK);
    cr_expect_eq(
        idem_locked_update(st, "shop", "settle:M7", NULL, not_settled_yet, settle_day, &j, NULL),
        IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(j.updates, 1);
}

/* Daily settlement under the lock: two server instances on one store (PostgreSQL: each
 * with its own store handle, as on two hosts; LMDB: one handle per process, shared),
 * each told by its own scheduler to settle merchant M7 for the same days. */
#define DAYS 6

typedef struct instance {
    tu_server ts;
    idem_store *st;
    atomic_int settled;
} instance;

static idem_code settle_rpc(idem_call *call, void *arg)
{
    instance *in = arg;
    size_t n;
    const char *p = idem_call_payload(call, &n);
    char day[64], name[80];
    snprintf(day, sizeof(day), "%.*s", (int)n, p);
    snprintf(name, sizeof(name), "settle:%s", day);
    settle_job j = {day, "1250", 0};
    idem_locked_outcome out;
    idem_code code =
        idem_locked_update(in->st, idem_call_caller(call), name, &(idem_lock_opts){.wait_ms = 5000},
                           not_settled_yet, settle_day, &j, &out);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    if (out == IDEM_LOCKED_UPDATED) {
        atomic_fetch_add(&in->settled, 1);
        return idem_call_reply(call, IDEM_OK, "settled", 7);
    }
    return idem_call_reply(call, IDEM_OK, "already settled", 15);
}

typedef struct scheduler {
    const char *url;
    pthread_barrier_t *go;
    int settled, already;
    idem_code code;
} scheduler;

static void *run_scheduler(void *arg)
{
    scheduler *s = arg;
    idem_client *c = tu_client(s->url, 10000);
    for (int d = 0; d < DAYS; d++) {
        char day[32];
        idem_result r;
        int len = snprintf(day, sizeof(day), "M7:2024-05-%02d", d + 1);
        idem_request q = {.method = "settle.Daily/Run",
                          .payload = day,
                          .payload_len = (size_t)len,
                          .caller = "shop"};
        pthread_barrier_wait(s->go); /* both instances on the same day at once */
        if ((s->code = idem_client_call(c, &q, &r)) != IDEM_OK) {
            idem_result_clear(&r);
            break;
        }
        bool settled = r.payload_len == 7 && memcmp(r.payload, "settled", 7) == 0;
        s->settled += settled;
        s->already += !settled;
        idem_result_clear(&r);
    }
    idem_client_close(c);
    return NULL;
}

Test(locked_update, daily_settlement_on_two_instances_settles_each_day_exactly_once, .timeout = 120)
{
    instance in[2];
    memset(in, 0, sizeof(in));
    for (int i = 0; i < 2; i++) {
        idem_server_opts o;
        idem_server_opts_init(&o);
        in[i].st = st;
        if (i == 1 && backend.conninfo != NULL) { /* a second instance: its own pool */
            idem_pg_opts po = {.pool_size = 4, .pooler = tu_pg_pooler()};
            cr_assert_eq(idem_store_open_postgres_ex(&in[i].st, backend.conninfo, &po), IDEM_OK);
        }
        o.store = in[i].st;
        o.workers = 2;
        tu_server_create(&in[i].ts, &o);
        cr_assert_eq(
            idem_server_register(in[i].ts.srv, "settle.Daily/Run", settle_rpc, &in[i], NULL),
            IDEM_OK, "%s", idem_errmsg());
        tu_server_listen(&in[i].ts);
    }
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, 2);
    scheduler s[2] = {{in[0].ts.url, &go, 0, 0, 0}, {in[1].ts.url, &go, 0, 0, 0}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(pthread_create(&th[i], NULL, run_scheduler, &s[i]), 0);
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(s[i].code, IDEM_OK, "instance %d: %s", i, idem_code_name(s[i].code));
    }
    pthread_barrier_destroy(&go);
    cr_expect_eq(s[0].settled + s[1].settled, DAYS, "each day settled once");
    cr_expect_eq(s[0].already + s[1].already, DAYS, "and seen settled by the other instance");
    cr_expect_eq(atomic_load(&in[0].settled) + atomic_load(&in[1].settled), DAYS);
    for (int d = 0; d < DAYS; d++) {
        char day[32];
        snprintf(day, sizeof(day), "M7:2024-05-%02d", d + 1);
        cr_expect_str_eq(app_value("settlement", day), "1250", "%s", day);
    }
    for (int i = 0; i < 2; i++) {
        tu_server_destroy(&in[i].ts, false);
        if (in[i].st != st) {
            idem_store_close(in[i].st);
        }
    }
}

/* ---- locks taken through a call ---- */

typedef struct held {
    latch taken, go;
    uint64_t token;
    idem_code code;
} held;

static idem_code hold_handler(idem_call *call, void *arg)
{
    held *h = arg;
    idem_lock *l;
    h->code = idem_call_lock(call, "nightly", &(idem_lock_opts){.lease_ms = 300}, &l);
    h->token = h->code == IDEM_OK ? idem_lock_token(l) : 0;
    latch_set(&h->taken);
    latch_wait(&h->go);                               /* working, longer than three leases */
    return idem_call_reply(call, IDEM_OK, "done", 4); /* returns holding it */
}

static idem_code txn_lock_handler(idem_call *call, void *arg)
{
    (void)arg;
    idem_lock *l;
    idem_code code = idem_call_lock(call, "nightly", NULL, &l);
    const char *name = idem_code_name(code);
    return idem_call_reply(call, IDEM_OK, name, strlen(name));
}

typedef struct call_args {
    const char *url, *method, *key;
    idem_code code;
    char payload[64];
} call_args;

static void *call_once(void *arg)
{
    call_args *a = arg;
    idem_client *c = tu_client(a->url, 10000);
    idem_result r;
    idem_request q = {
        .method = a->method, .idempotency_key = a->key, .caller = "ops", .payload_len = 0};
    a->code = idem_client_call(c, &q, &r);
    snprintf(a->payload, sizeof(a->payload), "%.*s", (int)r.payload_len,
             r.payload != NULL ? (const char *)r.payload : "");
    idem_result_clear(&r);
    idem_client_close(c);
    return NULL;
}

static void serve(tu_server *ts, held *h)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = st;
    tu_server_create(ts, &o);
    cr_assert_eq(idem_server_register(ts->srv, "lockt.Job/Hold", hold_handler, h, NULL), IDEM_OK);
    idem_method_opts txn = {.flags = IDEM_METHOD_TRANSACTIONAL};
    cr_assert_eq(idem_server_register(ts->srv, "lockt.Job/InTxn", txn_lock_handler, NULL, &txn),
                 IDEM_OK, "%s", idem_errmsg());
    tu_server_listen(ts);
}

Test(call_lock, a_handlers_lock_is_renewed_by_the_server_and_released_when_it_returns)
{
    tu_server ts;
    held h = {.taken = LATCH_INIT, .go = LATCH_INIT};
    serve(&ts, &h);
    call_args a = {.url = ts.url, .method = "lockt.Job/Hold"};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, call_once, &a), 0);
    latch_wait(&h.taken);
    cr_assert_eq(h.code, IDEM_OK, "idem_call_lock");
    idem_lock *l = NULL;
    cr_expect_eq(idem_lock_acquire(st, "ops", "nightly", &(idem_lock_opts){.wait_ms = 1000}, &l),
                 IDEM_ABORTED, "the server's keeper renews it while the handler works");
    latch_set(&h.go);
    pthread_join(th, NULL);
    cr_expect_eq(a.code, IDEM_OK);
    l = take("ops", "nightly", NULL); /* at once: the handler's end released it */
    cr_expect_gt(idem_lock_token(l), h.token);
    cr_expect_eq(idem_lock_release(l), IDEM_OK);
    tu_server_destroy(&ts, false);
}

Test(call_lock, a_transactional_handler_is_refused_a_lock)
{
    tu_server ts;
    held h = {.taken = LATCH_INIT, .go = LATCH_INIT};
    serve(&ts, &h);
    call_args a = {.url = ts.url, .method = "lockt.Job/InTxn", .key = "k1"};
    call_once(&a);
    cr_expect_eq(a.code, IDEM_OK);
    cr_expect_str_eq(a.payload, "FAILED_PRECONDITION");
    tu_server_destroy(&ts, false);
}

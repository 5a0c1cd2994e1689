/* A key's later requests, and a journaled call after its outcome (issue 36, item 3),
 * through the real server and client, on LMDB (generations) and PostgreSQL
 * (generations_pg):
 *   - once a request's record has expired and been swept, the key's next request
 *     derives downstream keys of its own, never the earlier request's; the earlier
 *     request's retries derived the same keys, as does a call whose journal an older
 *     release wrote;
 *   - a journaled call whose process dies right after its outcome's commit leaves no
 *     listing for the re-driver: once its record is swept, it is not run again.
 * The test's link wraps idem__call_steps_forget (tests/meson.build): the separate
 * deletion of the journal that older releases committed after the outcome; a "death"
 * stops its worker there until the test ends. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "../src/toolkit/steps_internal.h"
#include "testutil.h"

#define CALLER "shop-web"
#define PLACE "gen.Order/Place"
#define BOOK "gen.Order/Book"

static tu_backend store;
static tu_server first, second;
static atomic_int runs, effects, fail_next, die_after_commit, n_derived;
static char derived[8][IDEM_DERIVED_KEY_LEN + 1]; /* every run's key for step "charge" */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static bool buried;

/* ---- the crash point of older releases ---- */

extern idem_code __real_idem__call_steps_forget(idem_call *call) __attribute__((weak));
idem_code __wrap_idem__call_steps_forget(idem_call *call);
idem_code __wrap_idem__call_steps_forget(idem_call *call)
{
    if (!atomic_exchange(&die_after_commit, 0)) {
        return __real_idem__call_steps_forget(call);
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 60; /* a hang guard: the test buries the worker at its end */
    pthread_mutex_lock(&mu);
    while (!buried && pthread_cond_timedwait(&cv, &mu, &until) == 0) {
    }
    pthread_mutex_unlock(&mu);
    return idem__err(IDEM_UNAVAILABLE, "this process died");
}

static void bury(void)
{
    pthread_mutex_lock(&mu);
    buried = true;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

/* ---- the order service ---- */

/* gen.Order/Place: derives the key of its step "charge" and answers it; fail_next makes
 * a run fail transiently after deriving it (the key has left: a downstream timed out). */
static idem_code place(idem_call *call, void *arg)
{
    char key[IDEM_DERIVED_KEY_LEN + 1];
    (void)arg;
    idem_code code = idem_call_derive_key(call, "charge", key);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    int i = atomic_fetch_add(&n_derived, 1);
    if (i < 8) {
        snprintf(derived[i], sizeof(derived[i]), "%s", key);
    }
    if (atomic_exchange(&fail_next, 0)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "the payment system timed out");
    }
    return idem_call_reply(call, IDEM_OK, key, strlen(key));
}

static idem_code effect_fn(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call, (void)arg, (void)out;
    atomic_fetch_add(&effects, 1);
    return IDEM_OK;
}

/* gen.Order/Book: one journaled step, then the answer; runs counts the handler's runs. */
static idem_code book(idem_call *call, void *arg)
{
    idem_step_result r;
    (void)arg;
    atomic_fetch_add(&runs, 1);
    idem_code code = idem_call_step(call, "effect", effect_fn, NULL, &r);
    idem_step_result_clear(&r);
    return code == IDEM_OK ? idem_call_reply(call, IDEM_OK, "booked", 6)
                           : idem_call_fail(call, code, "%s", idem_errmsg());
}

/* A server on the test's store; redrive_ms 0: no re-driver. */
static void start(tu_server *ts, uint64_t redrive_ms)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = store.st;
    o.redrive_interval_ms = redrive_ms;
    tu_server_create(ts, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_STEPS | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(ts->srv, PLACE, place, NULL, &m), IDEM_OK);
    cr_assert_eq(idem_server_register(ts->srv, BOOK, book, NULL, &m), IDEM_OK);
    tu_server_listen(ts);
}

static void setup(void)
{
    tu_backend_open(&store, "generations");
}

static void teardown(void)
{
    bury();
    tu_server *servers[] = {&first, &second};
    for (int i = 0; i < 2; i++) {
        if (servers[i]->srv != NULL) {
            tu_server_destroy(servers[i], false);
        }
    }
    tu_backend_close(&store);
}

TestSuite(generations, .init = setup, .fini = teardown, .timeout = 60);

static idem_code call(const char *url, const char *method, const char *key, const char *payload,
                      idem_result *r)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.caller = CALLER;
    o.retry.max_attempts = 1;
    o.attempt_timeout_ms = 2000;
    cr_assert_eq(idem_client_open(&c, (const char *[]){url}, 1, &o), IDEM_OK);
    idem_request q = {.method = method,
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = strlen(payload)};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

/* The record of (method, key): IDEM_OK (then *rec, cleared by the caller) or NOT_FOUND. */
static idem_code record_of(const char *method, const char *key, idem_record *rec)
{
    idem_key_ref ref = {CALLER, method, key};
    idem_code code = idem_store_get(store.st, &ref, rec);
    cr_assert(code == IDEM_OK || code == IDEM_NOT_FOUND, "%s", idem_errmsg());
    return code;
}

/* The sweeper once the record's result TTL has passed: it is gone. */
static void sweep_expired(const char *method, const char *key)
{
    idem_record rec;
    size_t deleted = 0;
    uint64_t later = idem__now_ms() + 2 * 24 * 3600 * 1000ull; /* past the default TTL */
    for (int i = 0; i < 100 && record_of(method, key, &rec) == IDEM_OK; i++) {
        idem_record_clear(&rec);
        cr_assert_eq(idem_store_sweep(store.st, later, 1000, &deleted), IDEM_OK, "%s",
                     idem_errmsg());
    }
    cr_assert_eq(record_of(method, key, &rec), IDEM_NOT_FOUND, "the record was swept");
}

/* A retry of a request derives its first run's keys; once its record is swept, the
 * key's next requests (another request, then the first one again) derive new ones. The
 * generation is kept at the first derived key (redrive_ms 0), or in the claim's txn
 * (a server with a re-driver). */
static void later_requests_derive_new_keys(uint64_t redrive_ms)
{
    idem_result r;
    start(&first, redrive_ms);
    atomic_store(&fail_next, 1);
    cr_assert_eq(call(first.url, PLACE, "cart-1", "A", &r), IDEM_UNAVAILABLE, "%s", r.message);
    idem_result_clear(&r);
    cr_assert_eq(call(first.url, PLACE, "cart-1", "A", &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, derived[0], "the retry derived the first run's key");
    idem_result_clear(&r);
    cr_assert_eq(call(first.url, PLACE, "cart-1", "A", &r), IDEM_OK, "%s", r.message);
    cr_expect(r.replayed, "the completed request replays");
    idem_result_clear(&r);
    const char *const later[] = {"B", "A"};
    for (int i = 0; i < 2; i++) {
        sweep_expired(PLACE, "cart-1");
        cr_assert_eq(call(first.url, PLACE, "cart-1", later[i], &r), IDEM_OK, "%s", r.message);
        idem_result_clear(&r);
    }
    cr_assert_eq(atomic_load(&n_derived), 4);
    for (int i = 2; i < 4; i++) {
        for (int j = 0; j < i; j++) {
            cr_expect_str_neq(derived[i], derived[j], "request %d derived run %d's key", i, j);
        }
    }
}

Test(generations, a_keys_later_request_never_derives_an_earlier_requests_keys)
{
    later_requests_derive_new_keys(0);
}

Test(generations, with_a_redriver_a_keys_later_request_never_derives_an_earlier_requests_keys)
{
    later_requests_derive_new_keys(3600 * 1000);
}

/* A journal an older release wrote ('g': generation 0, kept with the first run's first
 * step): the call's retry derives the key its first run sent (no generation mixed in). */
Test(generations, a_call_whose_journal_an_older_release_wrote_keeps_its_derived_keys)
{
    idem_result r;
    uint8_t d[32], g[GEN_LEN] = {0};
    char want[IDEM_DERIVED_KEY_LEN + 1] = "d-";
    start(&first, 0);
    atomic_store(&fail_next, 1);
    cr_assert_eq(call(first.url, PLACE, "cart-2", "A", &r), IDEM_UNAVAILABLE, "%s", r.message);
    idem_result_clear(&r);
    /* The request's generation as an older release kept it: 0, with the fingerprint of
     * the entry this run kept before its key left. */
    idem_txn *t;
    idem__journal j;
    const char *parts[4] = {CALLER, PLACE, "cart-2", "charge"};
    cr_assert(idem__lp_sha256(parts, 3, NULL, 0, d));
    j.gen_key[0] = 'g';
    memcpy(j.gen_key + 1, d, 32);
    const void *v;
    size_t n;
    cr_assert_eq(idem__store_txn_begin(store.st, &t), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_txn_get(t, IDEM__STEPS_DB, j.gen_key, IDEM__JKEY, &v, &n), IDEM_OK,
                 "the run kept its generation before its key left: %s", idem_errmsg());
    cr_assert_eq(n, GEN_LEN);
    memcpy(g + 8, (const uint8_t *)v + 8, IDEM_FINGERPRINT_LEN);
    cr_assert_eq(idem_txn_put(t, IDEM__STEPS_DB, j.gen_key, IDEM__JKEY, g, GEN_LEN), IDEM_OK);
    cr_assert_eq(idem__store_txn_commit(t), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(call(first.url, PLACE, "cart-2", "A", &r), IDEM_OK, "%s", r.message);
    cr_assert(idem__lp_sha256(parts, 4, NULL, 0, d));
    idem__hex(want + 2, d, sizeof(d));
    cr_expect_str_eq(r.payload, want, "generation 0's key, as the older release derived it");
    idem_result_clear(&r);
}

/* The journal's listing of (method, key) for the request whose fingerprint is fp. */
static bool listed(const char *key, const uint8_t fp[IDEM_FINGERPRINT_LEN])
{
    uint8_t base[32];
    idem__journal j;
    bool exists = true;
    cr_assert(idem__journal_base(CALLER, BOOK, key, fp, base));
    idem__journal_of_base(base, &j);
    cr_assert_eq(idem__journal_entry_exists(store.st, j.call_key, &exists), IDEM_OK, "%s",
                 idem_errmsg());
    return exists;
}

/* The first server's process dies right after the call's outcome is committed; its
 * record expires and is swept before a re-driver (the second server's) looks: the call
 * ran once, and nothing runs it again. */
Test(generations, the_redriver_never_reruns_a_completed_call_whose_record_was_swept)
{
    idem_result r;
    idem_record rec;
    uint8_t fp[IDEM_FINGERPRINT_LEN];
    bool completed = false;
    start(&first, 3600 * 1000); /* lists journaled calls; its first pass is an hour away */
    atomic_store(&die_after_commit, 1);
    call(first.url, BOOK, "trip-1", "T", &r); /* answered, or its process "died" first */
    idem_result_clear(&r);
    for (int i = 0; i < 2000 && !completed; i++) { /* bounded: the outcome is committed */
        if (record_of(BOOK, "trip-1", &rec) == IDEM_OK) {
            completed = rec.state == IDEM_REC_COMPLETED;
            memcpy(fp, rec.fingerprint, sizeof(fp));
            idem_record_clear(&rec);
        }
        nanosleep(&(struct timespec){0, 5 * 1000 * 1000}, NULL);
    }
    cr_assert(completed, "the outcome was committed");
    sweep_expired(BOOK, "trip-1");
    start(&second, 20);
    for (int i = 0; i < 2000 && listed("trip-1", fp); i++) { /* bounded: until unlisted */
        nanosleep(&(struct timespec){0, 5 * 1000 * 1000}, NULL);
    }
    cr_expect(!listed("trip-1", fp), "no listing is left");
    cr_expect_eq(atomic_load(&runs), 1, "the completed call did not run again");
    cr_expect_eq(atomic_load(&effects), 1);
    cr_expect_eq(record_of(BOOK, "trip-1", &rec), IDEM_NOT_FOUND, "no outcome was recorded again");
    idem_record_clear(&rec);
}

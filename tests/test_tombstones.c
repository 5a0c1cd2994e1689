/* Integration: tombstones, a dedup horizon longer than the result's TTL (docs/semantics.md
 * "Tombstones"). A real server and the real client (nng) and HTTP front, one handler
 * that counts its runs; the store is the test's own, so that it sweeps when the test
 * says and outlives a server. Results expire after RESULT_TTL_MS; the test waits for
 * that moment on the clock (a time condition: nothing else could signal it). */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store.h"
#include "testutil.h"

#define PAY "t.Pay/Charge"
#define RESULT_TTL_MS 200
#define TOMB_TTL_MS (60 * 1000)
#define LEASE_MS 1000

static atomic_int runs;

static idem_code h_charge(idem_call *call, void *arg)
{
    (void)arg;
    atomic_fetch_add(&runs, 1);
    size_t n;
    const void *p = idem_call_payload(call, &n);
    bool refused = n == 2 && memcmp(p, "nf", 2) == 0; /* a final error: its result is kept */
    return idem_call_reply(call, refused ? IDEM_NOT_FOUND : IDEM_OK, p, n);
}

typedef struct fixture {
    tu_server ts;
    tu_backend b;
    idem_store *st;
    idem_client *cli;
    uint32_t sweep_ms; /* the server's sweep interval; 0: an hour (the test sweeps) */
} fixture;

/* A server on st (not owned) with the given tombstone horizons: the server's, and its
 * method's (0: the server's). */
static void serve_with(fixture *f, uint64_t tomb_ttl_ms, uint64_t method_ttl_ms)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = f->st;
    o.result_ttl_ms = RESULT_TTL_MS;
    o.lease_ms = LEASE_MS;
    o.tombstone_ttl_ms = tomb_ttl_ms;
    o.sweep_interval_ms = f->sweep_ms ? f->sweep_ms : 3600 * 1000;
    o.workers = 2; /* few: a call that held one would show */
    tu_server_create(&f->ts, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED,
                          .tombstone_ttl_ms = method_ttl_ms};
    cr_assert_eq(idem_server_register(f->ts.srv, PAY, h_charge, NULL, &m), IDEM_OK);
    tu_server_listen(&f->ts);
    f->cli = tu_client(f->ts.url, 2000);
}

static void unserve(fixture *f)
{
    idem_client_close(f->cli);
    tu_server_destroy(&f->ts, false);
}

static void open_fixture_with(fixture *f, uint64_t tomb_ttl_ms, uint64_t method_ttl_ms)
{
    uint32_t sweep_ms = f->sweep_ms;
    memset(f, 0, sizeof(*f));
    f->sweep_ms = sweep_ms;
    atomic_store(&runs, 0);
    f->st = tu_backend_open(&f->b, "tomb");
    serve_with(f, tomb_ttl_ms, method_ttl_ms);
}

static void open_fixture(fixture *f, uint64_t tomb_ttl_ms)
{
    open_fixture_with(f, tomb_ttl_ms, 0);
}

static void close_fixture(fixture *f)
{
    unserve(f);
    tu_backend_close(&f->b);
}

/* One call of PAY under key with payload; its code, and r kept for the caller. */
static idem_code pay(fixture *f, const char *key, const char *payload, idem_result *r)
{
    idem_request q = {
        .method = PAY, .idempotency_key = key, .payload = payload, .payload_len = strlen(payload)};
    idem_client_call(f->cli, &q, r);
    return r->code;
}

static idem_code pay_once(fixture *f, const char *key, const char *payload)
{
    idem_result r;
    idem_code code = pay(f, key, payload, &r);
    idem_result_clear(&r);
    return code;
}

/* This host's clock, as the server's (ms since the epoch). */
static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Waits until this host's clock has passed at_ms (a bound of 10 s). */
static void wait_clock_past(uint64_t at_ms)
{
    for (int i = 0; i < 1000 && now_ms() <= at_ms; i++) {
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    cr_assert_gt(now_ms(), at_ms, "the clock did not pass %llu", (unsigned long long)at_ms);
}

/* The key's result has expired (its record's expiry passed). */
static void wait_result_expired(fixture *f, const char *key)
{
    idem_record rec;
    idem_key_ref k = {"", PAY, key};
    cr_assert_eq(idem_store_get(f->st, &k, &rec), IDEM_OK, "%s", idem_errmsg());
    uint64_t expires = rec.expires_ms;
    idem_record_clear(&rec);
    wait_clock_past(expires);
}

static void sweep_all(fixture *f)
{
    size_t n;
    cr_assert_eq(idem_store_sweep(f->st, now_ms(), 1000, &n), IDEM_OK, "%s", idem_errmsg());
}

static void assert_result_gone_was(fixture *f, const char *key, const char *payload,
                                   const char *first_code)
{
    idem_result r;
    cr_assert_eq(pay(f, key, payload, &r), IDEM_ALREADY_EXISTS, "%s", r.message);
    const char *gone = idem_result_metadata(&r, "idem-result-gone");
    cr_assert_not_null(gone, "no idem-result-gone metadata: %s", r.message);
    cr_assert_str_eq(gone, first_code);
    cr_assert_not_null(strstr(r.message, "already done"), "%s", r.message);
    idem_result_clear(&r);
}

static void assert_result_gone(fixture *f, const char *key, const char *payload)
{
    assert_result_gone_was(f, key, payload, "OK");
}

Test(tombstones, a_late_duplicate_after_the_result_ttl_is_told_done_and_never_runs_again)
{
    fixture f = {0};
    open_fixture(&f, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "late-1", "100"), IDEM_OK);
    wait_result_expired(&f, "late-1");
    assert_result_gone(&f, "late-1", "100"); /* the expired record, not swept yet */
    sweep_all(&f);
    idem_record rec;
    idem_tombstone t;
    idem_key_ref k = {"", PAY, "late-1"};
    cr_assert_eq(idem_store_get(f.st, &k, &rec), IDEM_NOT_FOUND, "the sweep kept the record");
    cr_assert_eq(idem_store_tombstone_get(f.st, &k, &t), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(t.code, IDEM_OK);
    assert_result_gone(&f, "late-1", "100"); /* the tombstone the sweep left */
    cr_assert_eq(atomic_load(&runs), 1, "the handler ran %d times", atomic_load(&runs));
    close_fixture(&f);
}

/* The tombstone keeps how the first call ended: a final error too (on PostgreSQL the
 * sweep reads the code out of the stored Response in SQL). */
Test(tombstones, a_tombstone_keeps_the_first_calls_error_code)
{
    fixture f = {0};
    open_fixture(&f, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "err-1", "nf"), IDEM_NOT_FOUND);
    wait_result_expired(&f, "err-1");
    assert_result_gone_was(&f, "err-1", "nf", "NOT_FOUND"); /* the expired record */
    sweep_all(&f);
    idem_tombstone t;
    idem_key_ref k = {"", PAY, "err-1"};
    cr_assert_eq(idem_store_tombstone_get(f.st, &k, &t), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(t.code, IDEM_NOT_FOUND, "%s", idem_code_name(t.code));
    assert_result_gone_was(&f, "err-1", "nf", "NOT_FOUND"); /* the tombstone */
    cr_assert_eq(atomic_load(&runs), 1);
    close_fixture(&f);
}

Test(tombstones, another_request_under_a_tombstoned_key_is_key_reused)
{
    fixture f = {0};
    open_fixture(&f, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "reuse-1", "100"), IDEM_OK);
    wait_result_expired(&f, "reuse-1");
    cr_assert_eq(pay_once(&f, "reuse-1", "999"), IDEM_INVALID_ARGUMENT); /* unswept */
    sweep_all(&f);
    idem_result r;
    cr_assert_eq(pay(&f, "reuse-1", "999", &r), IDEM_INVALID_ARGUMENT, "%s", r.message);
    cr_assert_not_null(strstr(r.message, "different request"), "%s", r.message);
    idem_result_clear(&r);
    cr_assert_eq(atomic_load(&runs), 1);
    close_fixture(&f);
}

/* A short horizon: the tombstone answers within it; past it the key is free again and
 * the sweep deletes the tombstone. */
Test(tombstones, after_the_tombstone_horizon_the_key_is_free)
{
    fixture f = {0};
    open_fixture(&f, 300);
    cr_assert_eq(pay_once(&f, "free-1", "100"), IDEM_OK);
    idem_record rec;
    idem_key_ref k = {"", PAY, "free-1"};
    cr_assert_eq(idem_store_get(f.st, &k, &rec), IDEM_OK);
    uint64_t expired_at = rec.expires_ms;
    idem_record_clear(&rec);
    wait_clock_past(expired_at);
    sweep_all(&f);
    wait_clock_past(expired_at + 300);
    cr_assert_eq(pay_once(&f, "free-1", "100"), IDEM_OK);
    cr_assert_eq(atomic_load(&runs), 2, "past the horizon the call runs again");
    idem_tombstone t;
    cr_assert_eq(idem_store_tombstone_get(f.st, &k, &t), IDEM_NOT_FOUND,
                 "the new claim left the old tombstone");
    close_fixture(&f);
}

/* Off (0, the default): an expired result is as no record, as before tombstones. */
Test(tombstones, off_by_default_an_expired_result_runs_again)
{
    fixture f = {0};
    open_fixture(&f, 0);
    cr_assert_eq(pay_once(&f, "off-1", "100"), IDEM_OK);
    wait_result_expired(&f, "off-1");
    sweep_all(&f);
    idem_tombstone t;
    idem_key_ref k = {"", PAY, "off-1"};
    cr_assert_eq(idem_store_tombstone_get(f.st, &k, &t), IDEM_NOT_FOUND);
    cr_assert_eq(pay_once(&f, "off-1", "100"), IDEM_OK);
    cr_assert_eq(atomic_load(&runs), 2);
    close_fixture(&f);
}

/* The tombstone is in the store: a new server on it (the store closed and opened
 * again) still answers the late duplicate. */
Test(tombstones, survive_a_server_restart)
{
    fixture f = {0};
    open_fixture(&f, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "restart-1", "100"), IDEM_OK);
    wait_result_expired(&f, "restart-1");
    sweep_all(&f);
    unserve(&f);
    idem_store_close(f.b.st);
    idem_code code = tu_backend_is_pg()
                         ? tu_pg_open(&f.b.st, f.b.conninfo, 8)
                         : idem_store_open_lmdb(&f.b.st, f.b.dir, 0, IDEM_STORE_NOSYNC);
    cr_assert_eq(code, IDEM_OK, "%s", idem_errmsg());
    f.st = f.b.st;
    serve_with(&f, TOMB_TTL_MS, 0);
    assert_result_gone(&f, "restart-1", "100");
    cr_assert_eq(atomic_load(&runs), 1);
    close_fixture(&f);
}

/* Over HTTP the late duplicate is 410 Gone with the front's problem body. */
Test(tombstones, http_answers_410_gone_to_a_late_duplicate)
{
    fixture f = {0};
    open_fixture(&f, TOMB_TTL_MS);
    cr_assert_eq(idem_server_listen_http(f.ts.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    int port = idem_server_http_port(f.ts.srv);
    const char *h[] = {"Idempotency-Key: http-1"};
    tu_http r;
    tu_http_post(&r, port, "/" PAY, h, 1, "100", 3);
    cr_assert_eq(r.status, 200, "%d %s", r.status, r.body);
    tu_http_free(&r);
    wait_result_expired(&f, "http-1");
    sweep_all(&f);
    tu_http_post(&r, port, "/" PAY, h, 1, "100", 3);
    char buf[64];
    cr_assert_eq(r.status, 410, "%d %s", r.status, r.body);
    cr_assert_not_null(strstr(r.body, "\"code\":\"ALREADY_EXISTS\""), "%s", r.body);
    cr_assert_str_eq(tu_http_header(&r, "Idem-Result-Gone", buf, sizeof(buf)), "OK");
    tu_http_free(&r);
    tu_http_post(&r, port, "/" PAY, h, 1, "999", 3);
    cr_assert_eq(r.status, 422, "another request: %d %s", r.status, r.body);
    tu_http_free(&r);
    cr_assert_eq(atomic_load(&runs), 1);
    close_fixture(&f);
}

/* The sweep turns expired results into tombstones and deletes expired tombstones, at
 * most max of either per batch. Times relative to this host's clock, which the sweep's
 * now shifts on PostgreSQL (the database's clock, the same host's here): LMDB keeps the
 * callers' times, PostgreSQL its own, so the sweeps leave a second's margin. */
Test(tombstones, the_sweep_removes_expired_tombstones_in_bounded_batches)
{
    enum { N = 25, BATCH = 10, KEEP = 100000, MARGIN = 1000 };
    tu_backend b = {0};
    idem_store *st = tu_backend_open(&b, "tomb_sweep");
    cr_assert_eq(idem__store_tomb_keep(st, KEEP), IDEM_OK, "%s", idem_errmsg());
    const uint64_t t0 = now_ms();
    char key[N][16];
    for (int i = 0; i < N; i++) {
        snprintf(key[i], sizeof(key[i]), "k%d", i);
        idem_claim_req req = {.key = {"", PAY, key[i]},
                              .owner = 0,
                              .now_ms = t0,
                              .lease_until_ms = t0 + 100,
                              .expires_ms = t0 + 200};
        idem_claim_outcome out;
        idem_record rec;
        cr_assert_eq(idem_store_claim(st, &req, &out, &rec), IDEM_OK, "%s", idem_errmsg());
        cr_assert_eq(idem__store_complete_at(st, &req.key, rec.owner, "", 0, t0 + 10, t0, 0),
                     IDEM_OK, "%s", idem_errmsg());
        idem_record_clear(&rec);
    }
    size_t n, tombs = 0;
    idem_tombstone t;
    uint64_t done = now_ms(), first = UINT64_MAX, last = 0;
    for (int round = 0; round < 3; round++) {
        cr_assert_eq(idem_store_sweep(st, done + MARGIN, BATCH, &n), IDEM_OK, "%s", idem_errmsg());
        cr_assert_leq(n, BATCH);
    }
    for (int i = 0; i < N; i++) {
        idem_key_ref k = {"", PAY, key[i]};
        tombs += idem_store_tombstone_get(st, &k, &t) == IDEM_OK;
        cr_assert_eq(t.until_ms - t.expired_at_ms, KEEP);
        first = t.expired_at_ms < first ? t.expired_at_ms : first;
        last = t.expired_at_ms > last ? t.expired_at_ms : last;
    }
    cr_assert_eq(tombs, N, "%zu of %d expired results left a tombstone", tombs, N);
    cr_assert_eq(idem_store_sweep(st, first + KEEP - MARGIN, BATCH, &n), IDEM_OK);
    cr_assert_eq(n, 0, "a tombstone swept before its horizon");
    size_t swept = 0;
    for (int round = 0; round < 5; round++) {
        cr_assert_eq(idem_store_sweep(st, last + KEEP + MARGIN, BATCH, &n), IDEM_OK);
        cr_assert_leq(n, BATCH);
        swept += n;
    }
    cr_assert_eq(swept, N);
    for (int i = 0; i < N; i++) {
        idem_key_ref k = {"", PAY, key[i]};
        cr_assert_eq(idem_store_tombstone_get(st, &k, &t), IDEM_NOT_FOUND);
    }
    tu_backend_close(&b);
}

/* idemctl's sweep (purge --expired) leaves the tombstone, show shows it and delete deletes
 * it; the late duplicate then runs again. */
Test(tombstones, idemctl_shows_and_deletes_a_tombstone)
{
    fixture f = {0};
    open_fixture(&f, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "ctl-1", "100"), IDEM_OK);
    wait_result_expired(&f, "ctl-1");
    const char *ctl = getenv("IDEMCTL");
    cr_assert_not_null(ctl, "IDEMCTL unset");
    char out[4096];
    const char *at = tu_backend_is_pg() ? "--pg" : "--db";
    const char *store = tu_backend_is_pg() ? f.b.conninfo : f.b.dir;
    /* idemctl's own sweep keeps the horizon the server left in the store */
    const char *purge[] = {ctl, at, store, "purge", "--expired", NULL};
    cr_assert_eq(tu_run_captured(purge, out, sizeof(out)), 0, "%s", out);
    const char *show[] = {ctl, at, store, "show", PAY, "ctl-1", "--caller", "", NULL};
    cr_assert_eq(tu_run_captured(show, out, sizeof(out)), 0, "%s", out);
    cr_assert_not_null(strstr(out, "state: TOMBSTONE"), "%s", out);
    cr_assert_not_null(strstr(out, "outcome: OK"), "%s", out);
    const char *del[] = {ctl, at, store, "delete", PAY, "ctl-1", "--caller", "", NULL};
    cr_assert_eq(tu_run_captured(del, out, sizeof(out)), 0, "%s", out);
    cr_assert_not_null(strstr(out, "deleted the tombstone"), "%s", out);
    idem_tombstone t;
    idem_key_ref k = {"", PAY, "ctl-1"};
    cr_assert_eq(idem_store_tombstone_get(f.st, &k, &t), IDEM_NOT_FOUND);
    cr_assert_eq(pay_once(&f, "ctl-1", "100"), IDEM_OK);
    cr_assert_eq(atomic_load(&runs), 2, "a deleted tombstone frees the key");
    close_fixture(&f);
}

/* A horizon set per method only (the server's is 0, the documented default): another
 * request under a key whose result expired and was swept is "key reused", answered
 * promptly like the server-wide horizon answers it (test_tombstones). */
Test(tombstones, method_horizon_another_request_under_a_swept_key_is_key_reused, .timeout = 30)
{
    fixture f = {0};
    open_fixture_with(&f, 0, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "m-reuse-1", "100"), IDEM_OK);
    wait_result_expired(&f, "m-reuse-1");
    sweep_all(&f);
    idem_tombstone t;
    idem_key_ref k = {"", PAY, "m-reuse-1"};
    cr_assert_eq(idem_store_tombstone_get(f.st, &k, &t), IDEM_OK, "no tombstone: %s",
                 idem_errmsg());
    idem_result r;
    idem_code code = pay(&f, "m-reuse-1", "999", &r);
    cr_assert_eq(code, IDEM_INVALID_ARGUMENT, "another request: %s: %s", idem_code_name(code),
                 r.message);
    idem_result_clear(&r);
    cr_assert_eq(atomic_load(&runs), 1);
    close_fixture(&f);
}

/* The same loop holds its worker for good (the client's deadline does not end it): two
 * such requests on a 2-worker server and an unrelated call with a fresh key is not
 * served. */
Test(tombstones, method_horizon_key_reuse_requests_do_not_starve_other_calls, .timeout = 60)
{
    fixture f = {0};
    open_fixture_with(&f, 0, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "m-a", "100"), IDEM_OK);
    cr_assert_eq(pay_once(&f, "m-b", "100"), IDEM_OK);
    wait_result_expired(&f, "m-a");
    wait_result_expired(&f, "m-b");
    sweep_all(&f);
    idem_code a = pay_once(&f, "m-a", "999"), b = pay_once(&f, "m-b", "999");
    cr_log_info("key reuse answers: %s, %s", idem_code_name(a), idem_code_name(b));
    idem_result r;
    idem_code code = pay(&f, "fresh-1", "5", &r);
    cr_assert_eq(code, IDEM_OK, "an unrelated call after two key-reuse requests: %s: %s",
                 idem_code_name(code), r.message);
    idem_result_clear(&r);
    close_fixture(&f);
}

/* With the method-only horizon the same request is "done, result gone", before and after
 * the sweep. */
Test(tombstones, method_horizon_a_late_duplicate_is_told_done, .timeout = 30)
{
    fixture f = {0};
    open_fixture_with(&f, 0, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "m-late-1", "100"), IDEM_OK);
    wait_result_expired(&f, "m-late-1");
    assert_result_gone(&f, "m-late-1", "100");
    sweep_all(&f);
    assert_result_gone(&f, "m-late-1", "100");
    cr_assert_eq(atomic_load(&runs), 1);
    close_fixture(&f);
}

/* The value of one series on the server's GET /metrics; -1 when absent. */
static double metric(int port, const char *series)
{
    char needle[128];
    tu_http h;
    snprintf(needle, sizeof(needle), "\n%s ", series);
    tu_http_get(&h, port, "/metrics");
    const char *w = h.body != NULL ? strstr(h.body, needle) : NULL;
    double v = w != NULL ? strtod(w + strlen(needle), NULL) : -1;
    tu_http_free(&h);
    return v;
}

/* The server's own sweeps (every 20 ms) turn the expired result into a tombstone; the
 * gauge it reads after each sweep, idemctl stats and idemctl list --state tombstone count
 * and show it. */
Test(tombstones, metrics_idemctl_stats_and_list_count_tombstones, .timeout = 60)
{
    fixture f = {.sweep_ms = 20};
    open_fixture(&f, TOMB_TTL_MS);
    cr_assert_eq(idem_server_listen_http(f.ts.srv, "http://127.0.0.1:0"), IDEM_OK, "%s",
                 idem_errmsg());
    int port = idem_server_http_port(f.ts.srv);
    cr_assert_eq(pay_once(&f, "count-1", "100"), IDEM_OK);
    double n = -1;
    for (int i = 0; i < 1000 && n != 1; i++) { /* a gauge read after each sweep: polled */
        n = metric(port, "idem_store_tombstones");
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    cr_assert_eq(n, 1, "idem_store_tombstones %g", n);
    cr_assert_eq(metric(port, "idem_store_records{state=\"completed\"}"), 0);
    const char *ctl = getenv("IDEMCTL");
    cr_assert_not_null(ctl, "IDEMCTL unset");
    char out[4096];
    const char *at = tu_backend_is_pg() ? "--pg" : "--db";
    const char *store = tu_backend_is_pg() ? f.b.conninfo : f.b.dir;
    const char *stats[] = {ctl, at, store, "stats", NULL};
    cr_assert_eq(tu_run_captured(stats, out, sizeof(out)), 0, "%s", out);
    cr_assert_not_null(strstr(out, "tombstones   1"), "%s", out);
    const char *list[] = {ctl, at, store, "list", "--state", "tombstone", NULL};
    cr_assert_eq(tu_run_captured(list, out, sizeof(out)), 0, "%s", out);
    cr_assert_not_null(strstr(out, "TOMBSTONE"), "%s", out);
    if (tu_backend_is_pg()) { /* LMDB keeps only the key's hash */
        cr_assert_not_null(strstr(out, "count-1"), "%s", out);
    }
    const char *json[] = {ctl, at, store, "--json", "list", "--state", "tombstone", NULL};
    cr_assert_eq(tu_run_captured(json, out, sizeof(out)), 0, "%s", out);
    cr_assert_not_null(strstr(out, "\"state\":\"TOMBSTONE\",\"outcome\":\"OK\""), "%s", out);
    close_fixture(&f);
}

/* Integration: a tombstone horizon set on a method only (idem_method_opts.tombstone_ttl_ms,
 * the server's 0): the late duplicate, another request, and the workers (docs/semantics.md
 * "Tombstones"). A real server and the real client (nng), one handler that counts its runs;
 * the store is the test's own, so that it sweeps when the test says. Results expire after
 * RESULT_TTL_MS; the test waits for that moment on the clock (nothing else could signal it). */
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
    return idem_call_reply(call, IDEM_OK, p, n);
}

typedef struct fixture {
    tu_server ts;
    tu_backend b;
    idem_store *st;
    idem_client *cli;
} fixture;

/* A server on st (not owned) with the given tombstone horizon. */
static void serve(fixture *f, uint64_t tomb_ttl_ms, uint64_t method_ttl_ms)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = f->st;
    o.result_ttl_ms = RESULT_TTL_MS;
    o.lease_ms = LEASE_MS;
    o.tombstone_ttl_ms = tomb_ttl_ms;
    o.sweep_interval_ms = 3600 * 1000; /* the test sweeps */
    o.workers = 2;
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

static void open_fixture(fixture *f, uint64_t tomb_ttl_ms, uint64_t method_ttl_ms)
{
    memset(f, 0, sizeof(*f));
    atomic_store(&runs, 0);
    f->st = tu_backend_open(&f->b, "tombstone_horizon");
    serve(f, tomb_ttl_ms, method_ttl_ms);
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

static void assert_result_gone(fixture *f, const char *key, const char *payload)
{
    idem_result r;
    cr_assert_eq(pay(f, key, payload, &r), IDEM_ALREADY_EXISTS, "%s", r.message);
    const char *gone = idem_result_metadata(&r, "idem-result-gone");
    cr_assert_not_null(gone, "no idem-result-gone metadata: %s", r.message);
    cr_assert_str_eq(gone, "OK");
    cr_assert_not_null(strstr(r.message, "already done"), "%s", r.message);
    idem_result_clear(&r);
}

/* A horizon set per method only (the server's is 0, the documented default): another
 * request under a key whose result expired and was swept is "key reused", answered
 * promptly like the server-wide horizon answers it (test_tombstones). */
Test(tombstone_horizon, method_horizon_another_request_under_a_swept_key_is_key_reused,
     .timeout = 30)
{
    fixture f;
    open_fixture(&f, 0, TOMB_TTL_MS);
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
Test(tombstone_horizon, method_horizon_key_reuse_requests_do_not_starve_other_calls, .timeout = 60)
{
    fixture f;
    open_fixture(&f, 0, TOMB_TTL_MS);
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
Test(tombstone_horizon, method_horizon_a_late_duplicate_is_told_done, .timeout = 30)
{
    fixture f;
    open_fixture(&f, 0, TOMB_TTL_MS);
    cr_assert_eq(pay_once(&f, "m-late-1", "100"), IDEM_OK);
    wait_result_expired(&f, "m-late-1");
    assert_result_gone(&f, "m-late-1", "100");
    sweep_all(&f);
    assert_result_gone(&f, "m-late-1", "100");
    cr_assert_eq(atomic_load(&runs), 1);
    close_fixture(&f);
}

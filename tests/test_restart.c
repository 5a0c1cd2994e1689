/* The store outlives the process: replays and leases survive a server restart. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "call.h"
#include "testutil.h"

static atomic_int executions;

static idem_code h_count(idem_call *call, void *arg)
{
    (void)arg;
    char out[16];
    int n = snprintf(out, sizeof(out), "run %d", atomic_fetch_add(&executions, 1) + 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static void start(tu_server *ts, char *dir)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.lease_ms = 200;
    memset(ts, 0, sizeof(*ts));
    if (dir == NULL) {
        tu_server_create(ts, &o);
    } else {
        o.db_path = dir;
        cr_assert_eq(idem_server_create(&ts->srv, &o), IDEM_OK, "%s", idem_errmsg());
        ts->dir = dir;
    }
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(ts->srv, "test.Pay/Charge", h_count, NULL, &m), IDEM_OK);
    tu_server_listen(ts);
}

static idem_code charge(const char *url, const char *key, idem_result *r)
{
    idem_client *c = tu_client(url, 2000);
    idem_request q = {
        .method = "test.Pay/Charge", .idempotency_key = key, .payload = "100", .payload_len = 3};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

Test(restart, replay_survives_server_restart_on_the_same_store)
{
    tu_server ts;
    idem_result r;
    atomic_store(&executions, 0);
    start(&ts, NULL);
    cr_assert_eq(charge(ts.url, "charge-1", &r), IDEM_OK);
    cr_expect_str_eq(r.payload, "run 1");
    idem_result_clear(&r);
    tu_server_destroy(&ts, true);

    start(&ts, ts.dir);
    cr_assert_eq(charge(ts.url, "charge-1", &r), IDEM_OK);
    cr_expect(r.replayed);
    cr_expect_str_eq(r.payload, "run 1");
    cr_expect_eq(atomic_load(&executions), 1);
    idem_result_clear(&r);
    tu_server_destroy(&ts, false);
}

Test(restart, abandoned_claim_is_reclaimed_after_its_lease)
{
    char *dir = tu_tempdir("lease");
    idem_store *st;
    idem_claim_outcome out;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK);
    /* A crashed owner: IN_PROGRESS with a lease that is already over. */
    uint64_t now = (uint64_t)time(NULL) * 1000;
    idem_claim_req req = {.key = {"", "test.Pay/Charge", "charge-2"},
                          .owner = 7,
                          .now_ms = now - 1000,
                          .lease_until_ms = now - 1,
                          .expires_ms = now + 3600 * 1000};
    size_t plen = 3;
    idem__fingerprint("test.Pay/Charge", "100", plen, req.fingerprint);
    cr_assert_eq(idem_store_claim(st, &req, &out, NULL), IDEM_OK);
    cr_assert_eq(out, IDEM_CLAIM_ACQUIRED);
    idem_store_close(st);

    tu_server ts;
    idem_result r;
    atomic_store(&executions, 0);
    start(&ts, dir);
    cr_expect_eq(charge(ts.url, "charge-2", &r), IDEM_OK, "%s", r.message);
    cr_expect_not(r.replayed, "the unknown outcome is re-run (at-least-once)");
    cr_expect_eq(atomic_load(&executions), 1);
    idem_result_clear(&r);
    tu_server_destroy(&ts, false);
}

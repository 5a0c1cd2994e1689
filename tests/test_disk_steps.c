/* A disk that fails under a call with journaled steps (IDEM_METHOD_STEPS), through the
 * real server and client: the outcome the store refused at first is recorded later by
 * the lease keeper, and with it the call's step journal goes, in the same transaction,
 * as on the normal path (result_cache_run.c: record_journaled). A journal left behind
 * would keep the call listed for a re-driver, and its steps would answer a later request
 * under the key. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <string.h>

#include "lmdb_internal.h"
#include "failing_disk.h"
#include "testutil.h"

#include "idemrpc/downstream.h"

#define PAY "ds.Bank/Pay"

static char *dir;
static idem_store *store;
static tu_server srv;
static atomic_int runs;

static void setup(void)
{
    dir = tu_tempdir("disk_steps");
    cr_assert_eq(idem_store_open_lmdb(&store, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = store;
    tu_server_create(&srv, &o);
    atomic_store(&runs, 0);
    atomic_store(&failing_syncs, 0);
}

static void teardown(void)
{
    atomic_store(&failing_syncs, 0);
    tu_server_destroy(&srv, false);
    idem_store_close(store);
    tu_rmtree(dir);
}

TestSuite(disk_steps, .init = setup, .fini = teardown, .timeout = 60);

static idem_code reserve(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call;
    (void)arg;
    out->data = strdup("r-1");
    out->len = out->data != NULL ? 3 : 0;
    return out->data != NULL ? IDEM_OK : IDEM_RESOURCE_EXHAUSTED;
}

/* One recorded step (its own commit), then the completion's commit fails, twice: the
 * completion and its redo (the keeper's first try may meet the second). */
static idem_code pay_handler(idem_call *c, void *arg)
{
    (void)arg;
    idem_step_result r;
    atomic_fetch_add(&runs, 1);
    idem_code code = idem_call_step(c, "reserve", reserve, NULL, &r);
    if (code != IDEM_OK) {
        return idem_call_fail(c, code, "step: %s", idem_errmsg());
    }
    idem_step_result_clear(&r);
    atomic_store(&failing_syncs, 2);
    return idem_call_reply(c, IDEM_OK, "paid", 4);
}

Test(disk_steps, an_outcome_recorded_later_deletes_the_step_journal_with_it)
{
    idem_method_opts m = {.flags =
                              IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED | IDEM_METHOD_STEPS,
                          .lease_ms = 300,
                          .max_run_ms = 10000};
    cr_assert_eq(idem_server_register(srv.srv, PAY, pay_handler, NULL, &m), IDEM_OK, "%s",
                 idem_errmsg());
    tu_server_listen(&srv);
    idem_client *once = tu_client_attempts(srv.url, 5000, 1);
    idem_client *retrying = tu_client_attempts(srv.url, 5000, 10);
    idem_request q = {.method = PAY, .idempotency_key = "p1", .payload = "1", .payload_len = 1};
    idem_result r1, r2;
    idem_code c1 = idem_client_call(once, &q, &r1);
    cr_assert_eq(c1, IDEM_UNAVAILABLE, "the first caller was told %s: %s", idem_code_name(c1),
                 r1.message ? r1.message : "");
    /* The retry waits for the outcome recorded later and replays it. */
    cr_assert_eq(idem_client_call(retrying, &q, &r2), IDEM_OK, "%s", r2.message ? r2.message : "");
    cr_expect(r2.replayed);
    cr_expect_eq(atomic_load(&runs), 1);
    idem_record rec;
    idem_key_ref k = {"", PAY, "p1"};
    cr_assert_eq(idem_store_get(store, &k, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(rec.state, IDEM_REC_COMPLETED);
    idem_journal_info j;
    idem_code jc = idem_journal_get(store, &k, rec.fingerprint, &j);
    idem_record_clear(&rec);
    cr_expect_eq(jc, IDEM_NOT_FOUND, "the completed call's journal is still there (%s, %s)",
                 idem_code_name(jc), jc == IDEM_OK ? idem_journal_state_name(j.state) : "-");
    idem_result_clear(&r1);
    idem_result_clear(&r2);
    idem_client_close(once);
    idem_client_close(retrying);
}

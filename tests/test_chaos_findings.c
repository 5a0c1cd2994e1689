/* Deterministic reproductions of what the fault campaign (bench/chaos*.c) found. Each
 * test states the documented behaviour; it fails until the library does it. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static idem_code put_balance(idem_call *call, void *arg)
{
    (void)arg;
    long long balance = 700;
    idem_code code = idem_txn_put(idem_call_txn(call), "ledger", "acct-00", 7, &balance,
                                  sizeof(balance));
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    return idem_call_reply(call, IDEM_OK, "ok", 2);
}

/* txn.h: idem_store_app_get "reads a business value outside a handler (own read txn)";
 * store.h offers IDEM_STORE_READONLY for readers such as idemctl or an auditor. Found by
 * idemrpc-chaos's checker, which opens the campaign's store read-only after the run:
 * the first app_get of a database answers INTERNAL "write begin: Permission denied",
 * because store_dbi (src/store/lmdb/txn.c) opens the business database's handle
 * through a write transaction even when the database already exists. */
Test(chaos_findings, app_get_reads_business_data_from_a_read_only_store)
{
    tu_server ts;
    idem_server_opts o;
    idem_server_opts_init(&o);
    tu_server_create(&ts, &o);
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(ts.srv, "f.Ledger/Put", put_balance, NULL, &tx), IDEM_OK);
    tu_server_listen(&ts);
    idem_client *c = tu_client(ts.url, 2000);
    idem_request q = {.method = "f.Ledger/Put", .idempotency_key = "put-1"};
    idem_result r;
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s", r.message ? r.message : "");
    idem_result_clear(&r);
    idem_client_close(c);
    char *dir = ts.dir;
    tu_server_destroy(&ts, true);

    idem_store *ro;
    cr_assert_eq(idem_store_open_lmdb(&ro, dir, 0, IDEM_STORE_READONLY), IDEM_OK, "%s",
                 idem_errmsg());
    void *v = NULL;
    size_t n = 0;
    idem_code code = idem_store_app_get(ro, "ledger", "acct-00", 7, &v, &n);
    cr_expect_eq(code, IDEM_OK, "app_get on a read-only store: %s %s", idem_code_name(code),
                 idem_errmsg());
    if (code == IDEM_OK) {
        long long balance;
        cr_assert_eq(n, sizeof(balance));
        memcpy(&balance, v, sizeof(balance));
        cr_expect_eq(balance, 700);
    }
    free(v);
    idem_store_close(ro);
    tu_rmtree(dir);
}

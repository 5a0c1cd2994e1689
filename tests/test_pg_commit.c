/* A transactional handler's COMMIT refused by PostgreSQL, through a real server and
 * client on a schema of the test's own in $IDEMRPC_TEST_PG: the client hears why,
 * the cause intact inside the store's context, and nothing was committed. */
#include <criterion/criterion.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define METHOD "commit.Test/Twice"

static char schema[32];
static char *conninfo;

static void setup(void)
{
    conninfo = tu_pg_schema_create(schema);
    /* checked at COMMIT: the handler's statement succeeds, its commit does not */
    tu_pg_exec(conninfo, "CREATE TABLE once (v int UNIQUE DEFERRABLE INITIALLY DEFERRED)");
}

static void teardown(void)
{
    if (conninfo != NULL) {
        tu_pg_schema_drop(schema);
        free(conninfo);
        conninfo = NULL;
    }
}

TestSuite(pg_commit, .init = setup, .fini = teardown, .timeout = 60);

/* Inserts the same value twice on the transaction's connection and answers OK. */
static idem_code h_twice(idem_call *call, void *arg)
{
    (void)arg;
    PGconn *c = idem_txn_pg_conn(idem_call_txn(call));
    PGresult *r = PQexec(c, "INSERT INTO once VALUES (1), (1)");
    bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
    PQclear(r);
    return ok ? idem_call_reply(call, IDEM_OK, "inserted", 8)
              : idem_call_fail(call, IDEM_INTERNAL, "insert: %s", PQerrorMessage(c));
}

Test(pg_commit, a_refused_commit_reaches_the_client_with_its_cause_intact)
{
    idem_store *st;
    cr_assert_eq(tu_pg_open(&st, conninfo, 2), IDEM_OK, "%s", idem_errmsg());
    idem_server_opts so;
    idem_server_opts_init(&so);
    so.store = st;
    tu_server ts;
    tu_server_create(&ts, &so);
    idem_method_opts m = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(ts.srv, METHOD, h_twice, NULL, &m), IDEM_OK);
    tu_server_listen(&ts);

    idem_client_opts co;
    idem_client *c;
    idem_client_opts_init(&co);
    co.retry.max_attempts = 1;
    cr_assert_eq(idem_client_open(&c, (const char *[]){ts.url}, 1, &co), IDEM_OK);
    idem_request q = {.method = METHOD, .idempotency_key = "k-commit"};
    idem_result r;
    idem_code code = idem_client_call(c, &q, &r);
    cr_expect_neq(code, IDEM_OK);
    cr_expect_not_null(strstr(r.message != NULL ? r.message : "",
                              "the commit failed or its outcome is unknown (duplicate key "
                              "value violates unique constraint \"once_v_key\" (postgres "
                              "COMMIT, SQLSTATE 23505))"),
                       "the cause, inside its context: %s", r.message);
    idem_result_clear(&r);
    idem_client_close(c);
    tu_server_destroy(&ts, false);
    idem_store_close(st);
    tu_pg_exec(conninfo, "DO $$ BEGIN IF (SELECT count(*) FROM once) <> 0 THEN"
                         " RAISE 'the refused commit left rows'; END IF; END $$");
}

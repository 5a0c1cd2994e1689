/* Your business tables, not ours: on PostgreSQL the order's status and the received
 * callbacks live in the service's own tables, written with its own SQL.
 *
 *   pay_order     trade_no PRIMARY KEY, status (the state machine's names), version (how
 *                 often the status changed), updated_at
 *   pay_callback  out_trade_no, channel, amount, received_at;
 *                 CONSTRAINT uk_pay_callback UNIQUE (out_trade_no, channel)
 *
 * Every statement runs on idem_txn_pg_conn(t): the connection of the handler's
 * transaction, which already holds the claim and, when the handler answers OK, gets the
 * idempotency record before it commits. The rows below therefore commit with the record
 * or not at all. Two guards make an effect happen once even for a call that got past the
 * record (another caller scope, a result that expired):
 *   - the unique key: INSERT ... ON CONFLICT ON CONSTRAINT uk_pay_callback DO NOTHING
 *     inserts 0 rows for a notification that was applied before;
 *   - the conditional UPDATE: UPDATE pay_order SET status = 'PAID' WHERE trade_no = $1
 *     AND status = 'CREATED' changes 1 row exactly once.
 * At READ COMMITTED both wait for a concurrent transaction holding the row and then see
 * its committed outcome, so two instances cannot both win. No COMMIT or ROLLBACK here:
 * the server ends the transaction. A failed statement aborts it; the caller then answers
 * a transient code, which rolls everything back. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "payments.h"

#ifdef PAY_HAVE_PG
#include <libpq-fe.h>

/* Serialises CREATE TABLE IF NOT EXISTS of instances starting together (PostgreSQL can
 * fail one of two concurrent creations). The two-key form: a space the store's own
 * one-key advisory locks never use. */
static const char CREATE_TABLES[] =
    "SELECT pg_advisory_xact_lock(1885436193, 1);"
    "CREATE TABLE IF NOT EXISTS pay_order ("
    " trade_no text PRIMARY KEY,"
    " status text NOT NULL CHECK (status IN ('CREATED', 'PAID', 'REFUNDED', 'CANCELLED')),"
    " version integer NOT NULL DEFAULT 0,"
    " updated_at timestamptz NOT NULL DEFAULT now());"
    "CREATE TABLE IF NOT EXISTS pay_callback ("
    " out_trade_no text NOT NULL,"
    " channel text NOT NULL,"
    " amount bigint NOT NULL,"
    " received_at timestamptz NOT NULL DEFAULT now(),"
    " CONSTRAINT uk_pay_callback UNIQUE (out_trade_no, channel))";

/* Keeps libpq's message for pay_errmsg(). Deadlocks and serialization failures (and a
 * lost connection) are UNAVAILABLE: nothing committed, the client retries. */
static idem_code sql_failed(PGconn *c, PGresult *r, const char *what)
{
    const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE); /* NULL when r is NULL */
    const char *msg = r != NULL ? PQresultErrorMessage(r) : PQerrorMessage(c);
    bool retry = PQstatus(c) != CONNECTION_OK ||
                 (state != NULL && (strcmp(state, "40001") == 0 || strcmp(state, "40P01") == 0));
    pay_set_errmsg("%s: %.*s", what, (int)strcspn(msg, "\n"), msg);
    PQclear(r);
    return retry ? IDEM_UNAVAILABLE : IDEM_INTERNAL;
}

/* Runs q with text parameters on t's connection. On success *out (NULL: cleared here)
 * holds the result, to be PQclear'ed. */
static idem_code sql(idem_txn *t, const char *q, int n, const char *const *params,
                     ExecStatusType want, PGresult **out)
{
    PGconn *c = idem_txn_pg_conn(t);
    pay_set_errmsg(NULL);
    if (c == NULL) {
        pay_set_errmsg("not a PostgreSQL transaction");
        return IDEM_FAILED_PRECONDITION;
    }
    PGresult *r = PQexecParams(c, q, n, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != want) {
        return sql_failed(c, r, q);
    }
    if (out != NULL) {
        *out = r;
    } else {
        PQclear(r);
    }
    return IDEM_OK;
}

/* The number of rows an INSERT, UPDATE or DELETE changed. */
static long changed_rows(PGresult *r)
{
    return strtol(PQcmdTuples(r), NULL, 10);
}

idem_code pay_sql_create_tables(idem_txn *t)
{
    PGconn *c = idem_txn_pg_conn(t);
    if (c == NULL) {
        pay_set_errmsg("not a PostgreSQL transaction");
        return IDEM_FAILED_PRECONDITION;
    }
    PGresult *r = PQexec(c, CREATE_TABLES); /* the last statement's result */
    if (PQresultStatus(r) != PGRES_COMMAND_OK) {
        return sql_failed(c, r, "creating pay_order and pay_callback");
    }
    PQclear(r);
    return IDEM_OK;
}

idem_code pay_sql_order_insert(idem_txn *t, const char *trade_no)
{
    const char *const p[] = {trade_no};
    return sql(t, "INSERT INTO pay_order (trade_no, status) VALUES ($1, 'CREATED')", 1, p,
               PGRES_COMMAND_OK, NULL);
}

idem_code pay_sql_order_status(idem_txn *t, const char *trade_no, char *buf, size_t cap)
{
    const char *const p[] = {trade_no};
    PGresult *r;
    idem_code code =
        sql(t, "SELECT status FROM pay_order WHERE trade_no = $1", 1, p, PGRES_TUPLES_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    if (PQntuples(r) != 1) {
        pay_set_errmsg("no order %s in pay_order", trade_no);
        code = IDEM_NOT_FOUND;
    } else {
        snprintf(buf, cap, "%s", PQgetvalue(r, 0, 0));
    }
    PQclear(r);
    return code;
}

/* The conditional UPDATE is the compare-and-set: 1 row means this transaction moved the
 * order (and holds its row until the end), 0 rows that it was not in `from`. */
idem_code pay_sql_order_move(idem_txn *t, const char *trade_no, const char *from, const char *to,
                             idem_sm_outcome *out)
{
    const char *const p[] = {trade_no, from, to};
    char status[IDEM_SM_MAX_STATE + 1];
    PGresult *r;
    idem_code code = sql(t,
                         "UPDATE pay_order SET status = $3, version = version + 1,"
                         " updated_at = now() WHERE trade_no = $1 AND status = $2",
                         3, p, PGRES_COMMAND_OK, &r);
    if (code != IDEM_OK) {
        return code;
    }
    long rows = changed_rows(r);
    PQclear(r);
    if (rows == 1) {
        *out = IDEM_SM_ADVANCED;
        return IDEM_OK;
    }
    if ((code = pay_sql_order_status(t, trade_no, status, sizeof(status))) != IDEM_OK) {
        return code;
    }
    if (strcmp(status, to) == 0) {
        *out = IDEM_SM_DUPLICATE; /* moved before: do nothing */
        return IDEM_OK;
    }
    pay_set_errmsg("order %s is %s, not %s", trade_no, status, from);
    return IDEM_FAILED_PRECONDITION;
}

idem_code pay_sql_callback_insert(idem_txn *t, const char *trade_no, const char *channel,
                                  long long amount, bool *first)
{
    char cents[24];
    snprintf(cents, sizeof(cents), "%lld", amount);
    const char *const p[] = {trade_no, channel, cents};
    PGresult *r;
    idem_code code =
        sql(t,
            "INSERT INTO pay_callback (out_trade_no, channel, amount)"
            " VALUES ($1, $2, $3) ON CONFLICT ON CONSTRAINT uk_pay_callback DO NOTHING",
            3, p, PGRES_COMMAND_OK, &r);
    if (code == IDEM_OK) {
        *first = changed_rows(r) == 1;
        PQclear(r);
    }
    return code;
}

#else /* built without libpq: no PostgreSQL store, so nothing calls these */

static idem_code no_pg(void)
{
    pay_set_errmsg("built without PostgreSQL support");
    return IDEM_UNIMPLEMENTED;
}

idem_code pay_sql_create_tables(idem_txn *t)
{
    (void)t;
    return no_pg();
}

idem_code pay_sql_order_insert(idem_txn *t, const char *trade_no)
{
    (void)t, (void)trade_no;
    return no_pg();
}

idem_code pay_sql_order_status(idem_txn *t, const char *trade_no, char *buf, size_t cap)
{
    (void)t, (void)trade_no, (void)buf, (void)cap;
    return no_pg();
}

idem_code pay_sql_order_move(idem_txn *t, const char *trade_no, const char *from, const char *to,
                             idem_sm_outcome *out)
{
    (void)t, (void)trade_no, (void)from, (void)to, (void)out;
    return no_pg();
}

idem_code pay_sql_callback_insert(idem_txn *t, const char *trade_no, const char *channel,
                                  long long amount, bool *first)
{
    (void)t, (void)trade_no, (void)channel, (void)amount, (void)first;
    return no_pg();
}
#endif

/* Statements on one libpq connection that never wait unboundedly (conn.c's pool and
 * schema.c's migration use them), and what a failed one says: PostgreSQL's message
 * first, then the statement's short name, bounded. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>

#include "pg_internal.h"

/* Maps a failed result (or a dead connection) to a code: connection trouble, a lock or
 * statement timeout and serialisation conflicts are transient (UNAVAILABLE), a full disk
 * RESOURCE_EXHAUSTED. */
static _Thread_local char last_state[6];

void idem__pg_fail_forget(void)
{
    last_state[0] = '\0';
}

bool idem__pg_failed_with(const char *state)
{
    return strcmp(last_state, state) == 0;
}

idem_code idem__pg_fail(PGconn *c, PGresult *r, const char *what)
{
    const char *state = r != NULL ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
    snprintf(last_state, sizeof(last_state), "%s", state != NULL ? state : "");
    const char *msg = r != NULL ? PQresultErrorMessage(r) : PQerrorMessage(c);
    idem_code code = IDEM_INTERNAL;
    if (c == NULL || PQstatus(c) != CONNECTION_OK || state == NULL ||
        strncmp(state, "08", 2) == 0 || strncmp(state, "57P", 3) == 0 ||
        strcmp(state, "57014") == 0 || strcmp(state, "55P03") == 0 || strcmp(state, "40001") == 0 ||
        strcmp(state, "40P01") == 0 ||
        strcmp(state, "25006") == 0) { /* read-only: a demoted leader */
        code = IDEM_UNAVAILABLE;
    } else if (strcmp(state, "53100") == 0 || strcmp(state, "53200") == 0) {
        code = IDEM_RESOURCE_EXHAUSTED;
    }
    const char *primary = r != NULL ? PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY) : NULL;
    if (primary == NULL) {
        primary = msg != NULL ? msg : "";
    }
    int line = (int)strcspn(primary, "\n");
    idem__err(code, "%.*s (postgres %s%s%s)", line > 300 ? 300 : line, primary, what,
              state != NULL ? ", SQLSTATE " : "", state != NULL ? state : "");
    if (r != NULL) {
        PQclear(r);
    }
    return code;
}

/* Flushes what libpq holds to send and waits until a result can be read without
 * blocking. False when deadline (monotonic ms) passed or the connection broke. */
bool idem__pg_await_readable(PGconn *c, uint64_t deadline)
{
    int fd = PQsocket(c);
    for (;;) {
        int f = PQflush(c);
        if (f < 0 || fd < 0) {
            return false;
        }
        if (f == 0 && !PQisBusy(c)) {
            return true;
        }
        uint64_t now = idem__mono_ms();
        if (now >= deadline) {
            return false;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN | (f == 1 ? POLLOUT : 0)};
        int rc = poll(&p, 1, (int)(deadline - now));
        if (rc < 0 && errno != EINTR) {
            return false;
        }
        if (rc > 0 && (p.revents & (POLLIN | POLLERR | POLLHUP)) && !PQconsumeInput(c)) {
            return false;
        }
    }
}

/* sql (several statements may be ;-separated) on c, bounded by deadline: the first
 * failed result, else the last (NULL and *lost when no answer came in time; the
 * connection is then left to the caller). */
static PGresult *simple_on(PGconn *c, const char *sql, const char *name, uint64_t deadline,
                           bool *lost)
{
    PGresult *keep = NULL, *r;
    *lost = !PQsendQuery(c, sql);
    while (!*lost && !(*lost = !idem__pg_await_readable(c, deadline)) &&
           (r = PQgetResult(c)) != NULL) {
        ExecStatusType k = keep != NULL ? PQresultStatus(keep) : PGRES_COMMAND_OK;
        if (k == PGRES_COMMAND_OK || k == PGRES_TUPLES_OK) {
            PQclear(keep);
            keep = r;
        } else {
            PQclear(r);
        }
    }
    if (*lost) {
        PQclear(keep);
        idem__err(IDEM_UNAVAILABLE, "no answer in time (postgres %s)", name);
        return NULL;
    }
    return keep;
}

/* Plain SQL's name in messages: its text up to the first ';', at most 40 bytes. */
const char *idem__pg_sql_name(const char *sql, char buf[48])
{
    size_t n = strcspn(sql, ";");
    snprintf(buf, 48, "%.*s%s", (int)(n > 40 ? 40 : n), sql, n > 40 ? "..." : "");
    return buf;
}

/* simple_on's result checked: *out (may be NULL) gets it; name (NULL: from the SQL)
 * names it in messages. */
idem_code idem__pg_simple_checked(PGconn *c, const char *sql, const char *name, uint64_t deadline,
                                  bool *lost, PGresult **out)
{
    char buf[48];
    name = name != NULL ? name : idem__pg_sql_name(sql, buf);
    PGresult *r = simple_on(c, sql, name, deadline, lost);
    if (r == NULL) {
        return *lost ? IDEM_UNAVAILABLE : idem__err(IDEM_INTERNAL, "postgres: no result");
    }
    if (PQresultStatus(r) != PGRES_COMMAND_OK && PQresultStatus(r) != PGRES_TUPLES_OK) {
        return idem__pg_fail(c, r, name);
    }
    if (out != NULL) {
        *out = r;
    } else {
        PQclear(r);
    }
    return IDEM_OK;
}

idem_code idem__pg_conn_query(PGconn *c, const char *name, const char *sql, uint32_t bound_ms,
                              PGresult **out)
{
    bool lost;
    return idem__pg_simple_checked(c, sql, name, idem__mono_ms() + bound_ms, &lost, out);
}

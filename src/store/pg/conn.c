/* The PostgreSQL backend's connections: the pool, and statements that never wait
 * unboundedly.
 *
 * Every statement is sent asynchronously and its answer awaited with poll until a
 * deadline (the store's statement_timeout_ms plus a margin, or a shorter bound the
 * caller sets on the slot). A connection that did not answer in time is marked dead
 * (closed when its slot is put back, so that a handler's idem_txn_pg_conn pointer stays
 * valid): the statement's outcome is then unknown (it may still commit on the server),
 * and the caller must re-read before it answers or re-runs anything. On a direct connection the
 * server bounds the same statement first (statement_timeout, lock_timeout, set per
 * session at connect), so a lock wait normally ends with a definite error.
 *
 * A slot whose connection broke is reconnected by the next idem__pg_pool_get, with
 * backoff for up to reconnect_ms: a failover ends there, since a multi-host conninfo
 * with target_session_attrs=read-write finds the new leader.
 *
 * Through a pooler in transaction mode (st->pooler) nothing lives in the session: the
 * statements are sent unnamed (parsed each time), and no SET is made at connect.
 * The lease keeper's renewals have a slot of their own (renew_slot), and so has the
 * flush of fences (fence_slot, claim.c), so that handlers holding every pooled
 * connection never delay them. */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "pg_internal.h"

#define POOL_WAIT_MS 5000
#define CLIENT_MARGIN_MS 500 /* past the server's own statement_timeout */
#define RECONNECT_MIN_MS 50  /* doubling */
#define RECONNECT_MAX_MS 1000

/* A statement got no answer in time, or the connection broke: the connection is closed
 * (reconnected by the next pool_get). */
static idem_code drop_unanswered(pool_slot *pc, const char *what)
{
    bool broke = PQstatus(pc->c) != CONNECTION_OK;
    idem_code code = idem__err(IDEM_UNAVAILABLE,
                               "%s; the connection was dropped, and a write's outcome is "
                               "unknown (postgres %s)",
                               broke ? "the connection broke" : "no answer in time", what);
    pc->dead = true; /* closed when the slot is put back: a handler may hold the pointer */
    return code;
}

static bool slot_usable(const pool_slot *pc)
{
    return pc->c != NULL && !pc->dead;
}

static uint64_t slot_deadline(const pool_slot *pc)
{
    return idem__mono_ms() + pc->bound_ms;
}

/* The next result of the query in flight, waiting until deadline; NULL at its end.
 * *lost when no answer came (the connection is then dropped). */
static PGresult *next_result(pool_slot *pc, uint64_t deadline, bool *lost)
{
    if (!idem__pg_await_readable(pc->c, deadline)) {
        *lost = true;
        return NULL;
    }
    return PQgetResult(pc->c);
}

/* Reads every result of the query in flight: the first that is not want, else the
 * last. NULL and *code when none came in time. */
static PGresult *finish_query(pool_slot *pc, uint64_t deadline, ExecStatusType want,
                              const char *what, idem_code *code)
{
    PGresult *keep = NULL, *r;
    bool lost = false;
    while ((r = next_result(pc, deadline, &lost)) != NULL) {
        if (keep == NULL || PQresultStatus(keep) == want) {
            PQclear(keep);
            keep = r;
        } else {
            PQclear(r);
        }
    }
    if (lost) {
        PQclear(keep);
        *code = drop_unanswered(pc, what);
        return NULL;
    }
    return keep;
}

static int send_stmt(const pool_slot *pc, enum stmt s, const pg_args *a)
{
    int n = a != NULL ? a->n : 0;
    const char *const *v = a != NULL ? a->v : NULL;
    const int *len = a != NULL ? a->len : NULL, *fmt = a != NULL ? a->fmt : NULL;
    if (pc->st->pooler) {
        return PQsendQueryParams(pc->c, idem__pg_sql[s], n, NULL, v, len, fmt, 1);
    }
    char name[8];
    snprintf(name, sizeof(name), "s%d", (int)s);
    return PQsendQueryPrepared(pc->c, name, n, v, len, fmt, 1);
}

PGresult *idem__pg_exec(pool_slot *pc, enum stmt s, const pg_args *a, ExecStatusType want,
                        idem_code *code)
{
    if (!slot_usable(pc) || !send_stmt(pc, s, a)) {
        *code = !slot_usable(pc) ? idem__err(IDEM_UNAVAILABLE, "postgres: connection lost")
                                 : drop_unanswered(pc, idem__pg_stmt_name[s]);
        return NULL;
    }
    PGresult *r = finish_query(pc, slot_deadline(pc), want, idem__pg_stmt_name[s], code);
    if (r != NULL && PQresultStatus(r) != want) {
        *code = idem__pg_fail(pc->c, r, idem__pg_stmt_name[s]);
        return NULL;
    }
    return r;
}

idem_code idem__pg_run(pool_slot *pc, enum stmt s, const pg_args *a, ExecStatusType want)
{
    idem_code code;
    PGresult *r = idem__pg_exec(pc, s, a, want, &code);
    if (r == NULL) {
        return code;
    }
    PQclear(r);
    return IDEM_OK;
}

idem_code idem__pg_query_named(pool_slot *pc, const char *name, const char *sql, PGresult **out)
{
    bool lost;
    char buf[48];
    if (!slot_usable(pc)) {
        return idem__err(IDEM_UNAVAILABLE, "postgres: connection lost");
    }
    name = name != NULL ? name : idem__pg_sql_name(sql, buf);
    idem_code code = idem__pg_simple_checked(pc->c, sql, name, slot_deadline(pc), &lost, out);
    return lost ? drop_unanswered(pc, name) : code;
}

idem_code idem__pg_query_simple(pool_slot *pc, const char *sql, PGresult **out)
{
    return idem__pg_query_named(pc, NULL, sql, out);
}

idem_code idem__pg_exec_simple(pool_slot *pc, const char *sql)
{
    return idem__pg_query_simple(pc, sql, NULL);
}

/* Runs prepared statements s1 and s2 in one round trip (libpq pipeline mode): s2 runs
 * once s1 has finished, and not at all when s1 failed. Both results are checked for
 * PGRES_TUPLES_OK. A connection left in pipeline mode by a failure is dropped. */
idem_code idem__pg_exec_pair(pool_slot *pc, enum stmt s1, const pg_args *a1, enum stmt s2,
                             const pg_args *a2, PGresult **r1, PGresult **r2)
{
    *r1 = *r2 = NULL;
    if (!slot_usable(pc) || !PQenterPipelineMode(pc->c) || !send_stmt(pc, s1, a1) ||
        !send_stmt(pc, s2, a2) || !PQpipelineSync(pc->c)) {
        return !slot_usable(pc) ? idem__err(IDEM_UNAVAILABLE, "postgres: connection lost")
                                : drop_unanswered(pc, "pipeline send");
    }
    uint64_t deadline = slot_deadline(pc);
    bool lost = false;
    PGresult *got[2] = {NULL, NULL}, *r;
    for (int i = 0; i < 2 && !lost; i++) {
        while ((r = next_result(pc, deadline, &lost)) != NULL) { /* one result, then NULL */
            if (got[i] == NULL) {
                got[i] = r;
            } else {
                PQclear(r);
            }
        }
    }
    PGresult *sync = lost ? NULL : next_result(pc, deadline, &lost);
    bool ended = !lost && PQresultStatus(sync) == PGRES_PIPELINE_SYNC && PQexitPipelineMode(pc->c);
    PQclear(sync);
    idem_code code = IDEM_OK;
    if (lost || !ended) {
        code = drop_unanswered(pc, "pipeline");
    } else if (PQresultStatus(got[0]) != PGRES_TUPLES_OK) {
        code = idem__pg_fail(pc->c, got[0], idem__pg_stmt_name[s1]);
        got[0] = NULL;
    } else if (PQresultStatus(got[1]) != PGRES_TUPLES_OK) {
        code = idem__pg_fail(pc->c, got[1], idem__pg_stmt_name[s2]);
        got[1] = NULL;
    }
    if (code != IDEM_OK) {
        PQclear(got[0]);
        PQclear(got[1]);
        return code;
    }
    *r1 = got[0];
    *r2 = got[1];
    return IDEM_OK;
}

/* ---- connections ---- */

static idem_code prepare_all(pool_slot *pc)
{
    char name[8];
    for (int i = 0; i < S_COUNT; i++) {
        snprintf(name, sizeof(name), "s%d", i);
        if (!PQsendPrepare(pc->c, name, idem__pg_sql[i], 0, NULL)) {
            return drop_unanswered(pc, "prepare");
        }
        idem_code code;
        PGresult *r = finish_query(pc, slot_deadline(pc), PGRES_COMMAND_OK, "prepare", &code);
        if (r == NULL) {
            return code;
        }
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            return idem__pg_fail(pc->c, r, "prepare");
        }
        PQclear(r);
    }
    return IDEM_OK;
}

/* (Re)connects a pool slot before until (monotonic ms, 0: each host's connect_timeout
 * only), then the session's bounds, the schema and the statements, each bounded like a
 * statement. */
static idem_code slot_connect(pg_store *st, pool_slot *pc, uint64_t until)
{
    if (slot_usable(pc) && PQstatus(pc->c) == CONNECTION_OK) {
        return IDEM_OK;
    }
    PQfinish(pc->c);
    pc->c = NULL;
    pc->dead = false;
    bool lost;
    idem_code code = idem__pg_connect(st->hosts, until, &pc->c);
    if (code == IDEM_OK && !st->pooler) { /* the session's bounds */
        code = idem__pg_simple_checked(pc->c, st->session_sql, "session settings",
                                       slot_deadline(pc), &lost, NULL);
    }
    if (code != IDEM_OK) {
        PQfinish(pc->c);
        pc->c = NULL;
        return code;
    }
    if (pc->opened) {
        __atomic_add_fetch(&st->reconnects, 1, __ATOMIC_RELAXED);
    }
    pc->opened = true;
    if (!__atomic_load_n(&st->schema_ready, __ATOMIC_ACQUIRE) &&
        (code = idem__pg_schema_ensure(pc)) == IDEM_OK) {
        __atomic_store_n(&st->schema_ready, true, __ATOMIC_RELEASE);
    }
    if (code == IDEM_OK && !st->pooler) {
        code = prepare_all(pc);
    }
    if (code != IDEM_OK) {
        PQfinish(pc->c);
        pc->c = NULL;
    }
    return code;
}

/* Connects pc, retrying a connection the database refused or did not answer (a
 * failover, a restart) with backoff for up to within_ms (0: one attempt). */
static idem_code slot_connect_retrying(pg_store *st, pool_slot *pc, uint32_t within_ms)
{
    uint64_t until = within_ms ? idem__mono_ms() + within_ms : 0, backoff = RECONNECT_MIN_MS;
    for (;;) {
        idem_code code = slot_connect(st, pc, until);
        if (code != IDEM_UNAVAILABLE || idem__mono_ms() + backoff > until) {
            return code;
        }
        idem__sleep_ms(backoff);
        backoff = backoff * 2 > RECONNECT_MAX_MS ? RECONNECT_MAX_MS : backoff * 2;
    }
}

idem_code idem__pg_pool_get(pg_store *st, pool_slot **out)
{
    return idem__pg_pool_get_within(st, st->reconnect_ms, out);
}

idem_code idem__pg_pool_get_within(pg_store *st, uint32_t within_ms, pool_slot **out)
{
    struct timespec ts;
    uint32_t wait = within_ms < POOL_WAIT_MS ? (within_ms ? within_ms : 1) : POOL_WAIT_MS;
    idem__abs_timespec(&ts, wait);
    pthread_mutex_lock(&st->mu);
    for (;;) {
        for (size_t i = 0; i < st->n; i++) {
            if (!st->pool[i].busy) {
                pool_slot *pc = &st->pool[i];
                pc->busy = true;
                pthread_mutex_unlock(&st->mu);
                pc->st = st;
                pc->bound_ms = st->stmt_ms + CLIENT_MARGIN_MS;
                idem_code code = slot_connect_retrying(st, pc, within_ms);
                if (code != IDEM_OK) {
                    idem__pg_pool_put(st, pc);
                    return code;
                }
                *out = pc;
                return IDEM_OK;
            }
        }
        if (pthread_cond_timedwait(&st->cv, &st->mu, &ts) != 0) {
            pthread_mutex_unlock(&st->mu);
            return idem__err(IDEM_UNAVAILABLE, "no postgres connection free for %u ms", wait);
        }
    }
}

/* A connection that went unanswered, or was left in a transaction or a pipeline (a
 * failed ROLLBACK), is closed: the next get reconnects. */
static void slot_settle(pool_slot *pc)
{
    if (pc->c != NULL && (pc->dead || PQtransactionStatus(pc->c) != PQTRANS_IDLE ||
                          PQpipelineStatus(pc->c) != PQ_PIPELINE_OFF)) {
        PQfinish(pc->c);
        pc->c = NULL;
        pc->dead = false;
    }
}

/* A slot outside the pool, its user's mutex held. One attempt, bounded like one
 * statement: its user's next turn is the retry. A connection slower than the user's
 * bound is still worth making (the turns after it use it). */
static idem_code side_slot_connect(pg_store *st, pool_slot *pc, uint32_t within_ms)
{
    pc->st = st;
    pc->bound_ms = within_ms;
    return slot_connect(st, pc, idem__mono_ms() + st->stmt_ms + CLIENT_MARGIN_MS);
}

idem_code idem__pg_renew_slot_get(pg_store *st, uint32_t within_ms, pool_slot **out)
{
    pthread_mutex_lock(&st->renew_mu);
    *out = &st->renew_slot;
    return side_slot_connect(st, &st->renew_slot, within_ms);
}

void idem__pg_renew_slot_put(pg_store *st, pool_slot *pc)
{
    slot_settle(pc);
    pthread_mutex_unlock(&st->renew_mu);
}

idem_code idem__pg_fence_slot_get(pg_store *st, pool_slot **out)
{
    *out = &st->fence_slot;
    return side_slot_connect(st, &st->fence_slot, st->stmt_ms + CLIENT_MARGIN_MS);
}

void idem__pg_fence_slot_put(pool_slot *pc)
{
    slot_settle(pc);
}

void idem__pg_pool_put(pg_store *st, pool_slot *pc)
{
    slot_settle(pc);
    pthread_mutex_lock(&st->mu);
    pc->busy = false;
    pthread_cond_signal(&st->cv);
    pthread_mutex_unlock(&st->mu);
}

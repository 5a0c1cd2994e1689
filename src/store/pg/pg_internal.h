/* The PostgreSQL backend's parts: sql.c the statements; schema.c the schema, its
 * migration and format; store_pg.c the single-statement operations; connect.c where and
 * within what time a connection is made; conn.c the pool and bounded statements; claim.c
 * the claim and token consumption; renew.c lease renewals; admin.c the sweep, counts and
 * walks; txn.c handler transactions and business key-value data; listen.c completion
 * announcements (its listener knows nothing of pg_store), watch.c the store's watch ops
 * on it. */
#ifndef IDEMRPC_STORE_PG_INTERNAL_H
#define IDEMRPC_STORE_PG_INTERNAL_H

#include <libpq-fe.h>
#include <pthread.h>
#include <stdio.h>

#include "idemrpc/txn.h"

#include "replay_cache.h"
#include "store.h"

/* The NOTIFY channel of completions and releases; the payload is the key's
 * idem__key_hash in decimal. */
#define PG_CHANNEL "idem_done"

struct pg_store;

/* One pooled connection. dead: a statement got no answer in time and the connection is
 * not used again (closed when the slot is put back, reconnected by the next get; a
 * handler's idem_txn_pg_conn pointer stays valid until its txn ends). */
typedef struct pool_slot {
    PGconn *c;
    bool busy, dead;
    struct pg_store *st;
    uint32_t bound_ms; /* the client's bound on each statement; set by pool_get */
    bool opened;       /* a connection was made before: the next is a reconnect */
} pool_slot;

typedef struct pg_listener pg_listener;
/* connect.c: the conninfo's hosts, and the one that gave the last connection. */
typedef struct pg_hosts pg_hosts;

typedef struct pg_store {
    idem_store base; /* first */
    pg_hosts *hosts; /* the conninfo, parsed */
    bool notify;     /* announce completions (NOTIFY) and hear others' (LISTEN) */
    bool pooler;     /* transaction pooling: unnamed statements, no session state */
    bool existing;   /* idem_pg_opts.existing: no schema created where there is none */
    uint32_t stmt_ms, lock_ms, reconnect_ms;
    uint32_t migrate_ms;   /* the schema migration's bound (schema.c) */
    uint64_t reconnects;   /* atomic */
    char session_sql[256]; /* the session's keepalives and bounds (not through a pooler) */
    char txn_sql[192];     /* BEGIN with the same bounds, transaction-local */
    bool schema_ready;     /* the tables exist (checked by this store's first connection) */
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a connection was returned */
    pool_slot *pool;
    size_t n;
    /* The lease keeper's own connection (renew.c): renewals never wait for a pooled one
     * that handlers hold. renew_mu: one round at a time (servers sharing the store). */
    pool_slot renew_slot;
    pthread_mutex_t renew_mu;
    /* The connection that makes fences durable (claim.c), for the same reason; under
     * fence_mu, one flush at a time, numbered (fence_flushes: atomic, changed under
     * fence_mu); fence_flushed: the number of the last one that succeeded. */
    pool_slot fence_slot;
    pthread_mutex_t fence_mu;
    uint64_t fence_flushes, fence_flushed;
    pg_listener *listener; /* started by the first watch */
    pg_rcache *rcache;     /* COMPLETED records read here (replay_cache.h); NULL: off */
} pg_store;

enum stmt {
    S_CLAIM_INSERT,
    S_CLAIM_FENCE,
    S_CLAIM_LOCK,
    S_CLAIM_TAKE,
    S_TOKEN_TAKE,
    S_TOKEN_KEEP,
    S_TOKEN_CHECK,
    S_COMPLETE,
    S_RELEASE,
    S_RENEW,
    S_GET,
    S_DELETE,
    S_SWEEP_RECORDS,
    S_SWEEP_TOKENS,
    S_SWEEP_TOMBS,
    S_SWEEP_KV,
    S_TOKEN_PUT,
    S_STATS,
    S_PAGE,
    S_TRY_LOCK,
    S_NOTIFY,
    S_KV_LOCK,
    S_KV_PUT,
    S_KV_DEL,
    S_KV_READ,
    S_KV_NEXT,
    S_TXN_RECORD,
    S_RENEW_BATCH,
    S_TOMB_GET,
    S_TOMB_DEL,
    S_CLAIM_UNDO,
    S_TOMB_KEEP,
    S_TOMB_PAGE,
    S_CLAIM_CONFIRM,
    S_COUNT
};

/* Parameters of one statement, text unless given as bytes. */
typedef struct pg_args {
    const char *v[8];
    int len[8], fmt[8], n;
    char num[8][24];
} pg_args;

static inline void arg_text(pg_args *a, const char *s)
{
    a->v[a->n] = s;
    a->len[a->n] = 0;
    a->fmt[a->n++] = 0;
}

static inline void arg_i64(pg_args *a, uint64_t x)
{
    snprintf(a->num[a->n], sizeof(a->num[0]), "%lld", (long long)x); /* bigint is signed */
    arg_text(a, a->num[a->n]);
}

static inline void arg_bytes(pg_args *a, const void *p, size_t n)
{
    a->v[a->n] = p != NULL ? p : "";
    a->len[a->n] = (int)n;
    a->fmt[a->n++] = 1;
}

static inline void arg_key(pg_args *a, const idem_key_ref *k)
{
    arg_text(a, k->caller != NULL ? k->caller : "");
    arg_text(a, k->method);
    arg_text(a, k->key);
}

/* The NOTIFY payload for key ("" when the store does not announce). */
static inline void arg_announce(pg_args *a, const pg_store *st, const idem_key_ref *key)
{
    if (st->notify) {
        snprintf(a->num[a->n], sizeof(a->num[0]), "%u", idem__key_hash(key));
        arg_text(a, a->num[a->n]);
    } else {
        arg_text(a, "");
    }
}

extern const idem_store_ops idem__pg_ops;
/* sql.c: the statements, and their short names for error messages. */
extern const char *const idem__pg_sql[S_COUNT];
extern const char *const idem__pg_stmt_name[S_COUNT];

/* connect.c */
/* Parses conninfo (INVALID_ARGUMENT naming the fault: a syntax error, host, hostaddr and
 * port lists that libpq could not pair). */
idem_code idem__pg_hosts_parse(const char *conninfo, pg_hosts **out);
void idem__pg_hosts_free(pg_hosts *h);
/* A new nonblocking connection with the store's defaults (keepalives), made
 * asynchronously before deadline (monotonic ms; 0: none, each host still bounded by
 * connect_timeout): the host that gave the last connection first, then the others in
 * their order, each within its share of the time left. */
idem_code idem__pg_connect(pg_hosts *h, uint64_t deadline, PGconn **out);

/* query.c */
/* The error of r (or of c when r is NULL) as the thread's message, the cause first:
 * "<PostgreSQL's message> (postgres <what>)", what a short name; frees r. */
idem_code idem__pg_fail(PGconn *c, PGresult *r, const char *what);
/* True when the thread's last idem__pg_fail since idem__pg_fail_forget was a result with
 * this SQLSTATE (a failure without one, a lost connection, is none). */
void idem__pg_fail_forget(void);
bool idem__pg_failed_with(const char *state);
/* Flushes what libpq holds and waits until a result can be read; false when
 * deadline (monotonic ms) passed or the connection broke. */
bool idem__pg_await_readable(PGconn *c, uint64_t deadline);
/* Plain SQL on c bounded by deadline, its result checked (*out, may be NULL, gets it);
 * name (NULL: from the SQL) names it in messages; *lost when no answer came in time. */
idem_code idem__pg_simple_checked(PGconn *c, const char *sql, const char *name, uint64_t deadline,
                                  bool *lost, PGresult **out);
/* Plain SQL's name in messages: its text up to the first ';', at most 40 bytes. */
const char *idem__pg_sql_name(const char *sql, char buf[48]);

/* conn.c */
/* A connected slot (reconnecting with backoff for up to reconnect_ms). */
idem_code idem__pg_pool_get(pg_store *st, pool_slot **out);
/* The same, waiting and reconnecting for at most within_ms. */
idem_code idem__pg_pool_get_within(pg_store *st, uint32_t within_ms, pool_slot **out);
/* The renewal connection (st->renew_slot, under st->renew_mu): connected in one attempt
 * bounded like a statement, its statements bounded by within_ms. Put back with
 * idem__pg_renew_slot_put (also after a failure). */
idem_code idem__pg_renew_slot_get(pg_store *st, uint32_t within_ms, pool_slot **out);
void idem__pg_renew_slot_put(pg_store *st, pool_slot *pc);
/* The same for st->fence_slot, st->fence_mu held by the caller, its statements bounded
 * like any. */
idem_code idem__pg_fence_slot_get(pg_store *st, pool_slot **out);
void idem__pg_fence_slot_put(pool_slot *pc);
/* A connection left inside a transaction (a failed ROLLBACK) is closed, not reused. */
void idem__pg_pool_put(pg_store *st, pool_slot *slot);
/* Statement s on pc, bounded by pc->bound_ms: its result, or NULL and *code (pc->c is
 * then NULL when no answer came: the outcome is unknown). */
PGresult *idem__pg_exec(pool_slot *pc, enum stmt s, const pg_args *a, ExecStatusType want,
                        idem_code *code);
/* idem__pg_exec for a statement whose result is not read: only its code. */
idem_code idem__pg_run(pool_slot *pc, enum stmt s, const pg_args *a, ExecStatusType want);
/* Plain SQL (several ;-separated statements), bounded the same way. */
idem_code idem__pg_exec_simple(pool_slot *pc, const char *sql);
idem_code idem__pg_query_simple(pool_slot *pc, const char *sql, PGresult **out);
/* idem__pg_query_simple whose errors name the statement by name instead of its SQL. */
idem_code idem__pg_query_named(pool_slot *pc, const char *name, const char *sql, PGresult **out);
/* The same on a connection outside the pool (the listener's), bounded by bound_ms; *out
 * may be NULL; name (NULL: from the SQL) names it in messages. */
idem_code idem__pg_conn_query(PGconn *c, const char *name, const char *sql, uint32_t bound_ms,
                              PGresult **out);
/* s1 then s2 in one round trip (pipeline mode); s2 does not run when s1 failed. */
idem_code idem__pg_exec_pair(pool_slot *pc, enum stmt s1, const pg_args *a1, enum stmt s2,
                             const pg_args *a2, PGresult **r1, PGresult **r2);
idem_code idem__pg_exec_pooled(pg_store *st, enum stmt s, const pg_args *a, ExecStatusType want,
                               PGresult **out);
/* A pooled statement that must change exactly one row; else_code (else_msg) when it
 * changed none. */
idem_code idem__pg_exec_one_row(pg_store *st, enum stmt s, const pg_args *a, idem_code else_code,
                                const char *else_msg);

/* renew.c */
idem_code idem__pg_renew(idem_store *base, const idem_key_ref *key, uint64_t owner,
                         uint64_t lease_until_ms, uint64_t now_ms);
idem_code idem__pg_renew_batch(idem_store *base, idem__renewal *r, size_t n);

/* admin.c */
idem_code idem__pg_sweep(idem_store *base, uint64_t now_ms, size_t max, size_t *deleted);
idem_code idem__pg_stats(idem_store *base, idem_store_stats *out);
idem_code idem__pg_foreach(idem_store *base, idem_store_visit_fn fn, void *arg);

/* tombs.c: tombstones. The claim's answer from the key's tombstone on a row the claim
 * just inserted in c's transaction, at the database's time now_ms: *decided (TOMBSTONE
 * or MISMATCH, rec filled when not NULL; the row deleted again), else a stale tombstone
 * is deleted and the claim stands. */
idem_code idem__pg_tomb_claim(pool_slot *c, const idem_claim_req *req, uint64_t now_ms,
                              idem_claim_outcome *outcome, idem_record *rec, bool *decided);
idem_code idem__pg_tomb_keep(idem_store *base, uint64_t keep_ms);
idem_code idem__pg_tomb_get(idem_store *base, const idem_key_ref *key, idem_tombstone *out);
idem_code idem__pg_tomb_del(idem_store *base, const idem_key_ref *key);
idem_code idem__pg_tomb_foreach(idem_store *base, idem_tombstone_visit_fn fn, void *arg);

/* schema.c: the format of the store's tables this binary reads and writes (idem_meta). */
#define IDEM__PG_FORMAT 1
/* Creates what the catalog says is missing (nothing when all is there), waiting politely
 * for locks for up to pc->st->migrate_ms; FAILED_PRECONDITION for a newer format. */
idem_code idem__pg_schema_ensure(pool_slot *pc);

/* store_pg.c */
int64_t idem__pg_col_i64(const PGresult *r, int row, int col);
/* Runs S_COMPLETE on pc; IDEM_ABORTED when the claim is not (key, owner) any more. */
idem_code idem__pg_complete_on(pg_store *st, pool_slot *pc, const idem_key_ref *key, uint64_t owner,
                               const void *response, size_t len, uint64_t expires_ms,
                               uint64_t now_ms);

/* claim.c */
/* The claim's statements inside an open transaction; *got is the claimed row. */
idem_code idem__pg_claim_in_txn(pool_slot *pc, const idem_claim_req *req,
                                idem_claim_outcome *outcome, idem_record *rec, idem_record *got);
idem_code idem__pg_claim(idem_store *base, const idem_claim_req *req, idem_claim_outcome *outcome,
                         idem_record *rec);
idem_code idem__pg_token_consume(idem_store *base, const char *token, const char *scope,
                                 uint64_t now_ms);
/* Every fence drawn so far on the server st's fence_slot reaches is flushed there, and on
 * its synchronous standbys: a commit that writes WAL, on that slot. */
idem_code idem__pg_fences_flush(pg_store *st);

/* txn.c */
idem_code idem__pg_txn_begin(idem_store *base, uint64_t idle_ms, idem_txn **out);
void idem__pg_txn_abort(idem_txn *t);
bool idem__pg_txn_broken(const idem_txn *t);
idem_code idem__pg_txn_commit(idem_txn *t);
idem_code idem__pg_txn_complete_commit(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                       const void *response, size_t len, uint64_t expires_ms,
                                       uint64_t now_ms);
idem_code idem__pg_txn_claim(idem_txn *t, const idem_claim_req *req, idem_claim_outcome *outcome,
                             idem_record *rec);
idem_code idem__pg_txn_undo(idem_txn *t);
idem_code idem__pg_txn_fence_durable(idem_txn *t);
idem_code idem__pg_txn_get(idem_txn *t, const char *db, const void *key, size_t klen,
                           const void **val, size_t *vlen);
idem_code idem__pg_txn_get_bounded(idem_txn *t, const char *db, const void *key, size_t klen,
                                   const void **val, size_t *vlen);
idem_code idem__pg_txn_put(idem_txn *t, const char *db, const void *key, size_t klen,
                           const void *val, size_t vlen);
idem_code idem__pg_txn_del(idem_txn *t, const char *db, const void *key, size_t klen);
idem_code idem__pg_app_get(idem_store *base, const char *db, const void *key, size_t klen,
                           void **val, size_t *vlen);

/* Fills rec from the record columns (REC_COLS) at column off of row r; the response only
 * when want. */
idem_code idem__pg_row_record(const PGresult *r, int row, int off, idem_record *rec, bool want);
idem_code idem__pg_txn_record(idem_txn *t, const idem_key_ref *key, idem_record *rec);
idem_code idem__pg_app_next(idem_store *base, const char *db, const void *after, size_t alen,
                            idem_app_entry *out);

/* listen.c: the listener thread, on the store's hosts (borrowed until stop) and nothing
 * else of the store. */
idem_code idem__pg_listener_start(pg_hosts *hosts, pg_listener **out);
/* At most IDEM__STORE_MAX_WATCH watchers (RESOURCE_EXHAUSTED beyond). */
idem_code idem__pg_listener_add(pg_listener *l, idem__store_watch_fn fn, void *arg);
/* Waits for a delivery to fn in progress. */
void idem__pg_listener_remove(pg_listener *l, idem__store_watch_fn fn, void *arg);
/* Stops the thread and frees l (NULL: nothing). */
void idem__pg_listener_stop(pg_listener *l);
/* How many times l has LISTENed (and told its watchers IDEM__STORE_WATCH_ALL). */
uint64_t idem__pg_listener_listens(pg_listener *l);
/* watch.c: the store's watch and unwatch ops. */
idem_code idem__pg_watch(idem_store *base, idem__store_watch_fn fn, void *arg);
void idem__pg_unwatch(idem_store *base, idem__store_watch_fn fn, void *arg);
/* The replay cache's setup (opts: the store's; nothing when replay_cache_entries is 0),
 * watching announcements (watch.c). */
idem_code idem__pg_rcache_open(pg_store *st, const idem_pg_opts *opts);
/* cached_read.c: the ops' get and del. */
idem_code idem__pg_get(idem_store *base, const idem_key_ref *key, idem_record *rec);
idem_code idem__pg_delete(idem_store *base, const idem_key_ref *key);

#endif

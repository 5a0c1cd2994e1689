/* idem_store: durable idempotency records and one-time tokens.
 *
 * A record is keyed by the effective key (caller, method, key) and moves
 *   absent --claim--> IN_PROGRESS(owner, lease) --complete--> COMPLETED(response, expiry)
 *                                         \--release--> absent
 * The claim is one atomic write: of concurrent claimers exactly one acquires. A lease
 * that has expired (its owner crashed or hung) may be taken over by the next claim; a
 * live owner renews its lease (idem_store_renew) to keep it.
 *
 * Times are ms since the epoch and every write carries the caller's now_ms. LMDB (one
 * machine) decides on those absolute values. PostgreSQL (many machines, many clocks)
 * decides every lease, expiry and token expiry on the database's clock: it uses only
 * the differences (lease_until_ms - now_ms, expires_ms - now_ms), so a skewed instance
 * clock cannot take over a live lease early.
 * LMDB is the embedded backend; the interface is what the interceptors use. */
#ifndef IDEMRPC_STORE_H
#define IDEMRPC_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_store idem_store;

#define IDEM_MAX_CALLER 127
#define IDEM_MAX_METHOD 127
#define IDEM_MAX_KEY 255
#define IDEM_MAX_TOKEN 128
#define IDEM_FINGERPRINT_LEN 32 /* SHA-256 */

typedef struct idem_key_ref {
    const char *caller; /* "" when the request named none */
    const char *method;
    const char *key;
} idem_key_ref;

typedef enum idem_record_state {
    IDEM_REC_IN_PROGRESS = 1,
    IDEM_REC_COMPLETED = 2,
    /* What a COMPLETED record leaves once its result expired, within the method's
     * tombstone horizon (idem_server_opts.tombstone_ttl_ms): no response, result_code
     * says how the call ended. Only a claim reports it (IDEM_CLAIM_TOMBSTONE). */
    IDEM_REC_TOMBSTONE = 3,
} idem_record_state;

/* A record as read from the store. response is a malloc'd copy of the stored
 * serialized idem.v1.Response (COMPLETED only); free with idem_record_clear(). */
typedef struct idem_record {
    idem_record_state state;
    uint8_t fingerprint[IDEM_FINGERPRINT_LEN];
    uint64_t owner;
    uint64_t lease_until_ms; /* IN_PROGRESS */
    uint64_t first_at_ms;    /* when the first execution claimed it */
    uint64_t expires_ms;     /* when the sweeper may delete it */
    void *response;
    size_t response_len;
    /* The store's own clock when it read the record (PostgreSQL: the database clock),
     * to compare lease_until_ms and expires_ms with; 0 when the store keeps the
     * callers' times (LMDB): compare with your own clock. */
    uint64_t now_ms;
    /* IDEM_REC_TOMBSTONE: the code the call completed with (IDEM_OK or a final error);
     * expires_ms is then when its result expired. */
    idem_code result_code;
} idem_record;

typedef struct idem_claim_req {
    idem_key_ref key;
    uint8_t fingerprint[IDEM_FINGERPRINT_LEN];
    /* 0: the store assigns the next value of a strictly increasing counter (a fencing
     * token), returned in rec->owner (rec is then required). Nonzero: used as given,
     * unique per claim. */
    uint64_t owner;
    uint64_t now_ms;
    uint64_t lease_until_ms;
    uint64_t expires_ms; /* sweep time of an abandoned IN_PROGRESS record */
    /* Optional: a one-time token consumed in the same transaction when the claim
     * acquires a new record; scoped to key.caller. The IN_PROGRESS record keeps it: a
     * release puts it back (same transaction), a completion uses it up for good. */
    const char *token;
    /* 0: a COMPLETED record whose result expired is as no record (0.3's behaviour).
     * Else for this long after the result expired its tombstone answers the claim:
     * IDEM_CLAIM_TOMBSTONE for the same fingerprint, IDEM_CLAIM_MISMATCH for another. */
    uint64_t tombstone_ttl_ms;
} idem_claim_req;

typedef enum idem_claim_outcome {
    IDEM_CLAIM_ACQUIRED = 1, /* new record; caller runs the handler */
    IDEM_CLAIM_TAKEN_OVER,   /* expired lease re-claimed; caller runs the handler */
    IDEM_CLAIM_COMPLETED,    /* record holds the first result (in *rec) */
    IDEM_CLAIM_IN_PROGRESS,  /* another owner holds a live lease (in *rec) */
    IDEM_CLAIM_MISMATCH,     /* same key, other fingerprint: nothing changed */
    IDEM_CLAIM_TOMBSTONE,    /* done, its result expired and is gone (*rec: the tombstone) */
} idem_claim_outcome;

typedef struct idem_store_stats {
    size_t records, in_progress, completed, tokens;
    size_t map_size, map_used; /* bytes */
    uint64_t commits, writes;  /* write txns and the writes they held, since open */
    /* Times a writer waiting for its commit was woken and had to wait again (LMDB group
     * commit): wake-ups that cost a context switch and did nothing. */
    uint64_t early_wakeups;
    /* Completions committed in the same transaction as their claim (LMDB group commit:
     * one durable commit for a new key instead of two). */
    uint64_t shared_commits;
    /* Connections re-opened after one broke or went unanswered (PostgreSQL: a restart,
     * a failover, a partition), since open. */
    uint64_t reconnects;
    /* Tombstones kept (idem_tombstone): keys whose result expired, remembered still. */
    size_t tombstones;
} idem_store_stats;

enum idem_store_flags {
    /* MDB_NOSYNC: commits are not fsynced; a machine crash may lose the newest records
     * (a process crash does not). For benchmarks and caches, never for money. */
    IDEM_STORE_NOSYNC = 1u << 0,
    IDEM_STORE_READONLY = 1u << 1,
    /* Group commit is on by default: concurrent claims, completions and releases share
     * one write transaction and one fsync; each caller returns only after the commit
     * that holds its write, except a server's claim of a cached method, which shares its
     * commit with its completion (README "Which writes reach the disk"). This flag makes
     * every write its own transaction, and a new key two commits. */
    IDEM_STORE_NO_GROUP_COMMIT = 1u << 2,
    /* Opens only a directory that already holds an idemrpc store: IDEM_NOT_FOUND, and
     * nothing created, for a missing directory, one without data.mdb, or another
     * program's LMDB environment (no records database). For tools (idemctl) that must
     * not invent an empty store from a mistyped path. */
    IDEM_STORE_EXISTING = 1u << 3,
    /* A durable store with group commit keeps a write-ahead log beside data.mdb
     * (wal.log): a batch of writes is answered once its log entry and its LMDB commit are
     * on disk, both flushed at once, instead of after a second sync of LMDB's meta page
     * (docs/performance.md). This flag writes without it, as releases before 0.4 did:
     * the same guarantees, a slower new key. */
    IDEM_STORE_NO_LOG = 1u << 4,
};

/* Opens (creating the directory if missing) an LMDB store. map_size 0 = 1 GiB. One
 * store per directory per process: share it (idem_server_opts.store) instead of opening
 * the same directory twice. */
IDEM_API idem_code idem_store_open_lmdb(idem_store **out, const char *dir, size_t map_size,
                                        unsigned flags);
/* Opens a PostgreSQL store (libpq conninfo, e.g. "host=127.0.0.1 port=5432 dbname=app")
 * with a pool of pool_size connections (size it to the server's workers; 0 = 1). The
 * schema is created or migrated at start. Several server instances may share it: the
 * unique key (caller, method, key) decides every claim. Connection failures give
 * IDEM_UNAVAILABLE (retryable); each operation reconnects as needed. */
IDEM_API idem_code idem_store_open_postgres(idem_store **out, const char *conninfo,
                                            size_t pool_size);

typedef struct idem_pg_opts {
    size_t pool_size; /* connections; 0 = 1. A transactional handler holds one while it runs */
    /* By default completions and releases are announced (NOTIFY idem_done, sent at
     * commit) and each store LISTENs on its own connection, so a duplicate waiting on
     * this instance for a call running on another wakes at once; without the
     * announcements (or while the listening connection is down) it re-reads every
     * 20..200 ms. Set for engines without LISTEN/NOTIFY (CockroachDB) or a pooler in
     * transaction mode; every instance should agree. */
    bool no_notify;
    /* Bounds on every statement the store sends, so that no call, renewal or sweep waits
     * unboundedly for a row another session holds, a database that stopped answering or
     * a network that drops packets. statement_timeout_ms: the longest round trip of one
     * statement, on the database (statement_timeout) and on the client, which then
     * drops the connection (a write's outcome is then unknown, and is re-read before
     * anything is answered). 0 = 5000. lock_timeout_ms: the longest wait for a row lock
     * (lock_timeout), answered UNAVAILABLE; lease renewals never wait for one. 0 = 1000. */
    uint32_t statement_timeout_ms;
    uint32_t lock_timeout_ms;
    /* How long an operation retries a connection that broke or could not be opened
     * (a failover: the multi-host conninfo finds the new leader), with backoff, before it
     * answers UNAVAILABLE. 0 = 10000. */
    uint32_t reconnect_ms;
    /* A pooler in transaction mode (PgBouncer pool_mode=transaction) is in front: no
     * named prepared statements, no session settings, no LISTEN (implies no_notify). */
    bool pooler;
    /* A local cache of COMPLETED records, so that a replay on this instance needs no
     * round trip (a completed record does not change until it expires). Off by default:
     * it changes what a forget means. After idem_store_delete on another instance, this one may still replay the old result until that forget's
     * announcement arrives (NOTIFY idem_done, as completions; milliseconds), and never
     * longer than replay_cache_ttl_ms after the read that filled it began (no_notify,
     * pooler; one lost while the listening connection was down: until it listens
     * again, which empties the cache). replay_cache_entries: 0 = off, at most
     * 1048576. replay_cache_bytes: keys and responses held, 0 = 16 MiB (a larger
     * response is not cached). replay_cache_ttl_ms: how long one read may be answered
     * from, 0 = 5000, at most 3600000; an entry also ends at its record's expiry.
     * Evicted least recently used. docs/semantics.md "Replay cache (PostgreSQL)". */
    size_t replay_cache_entries;
    size_t replay_cache_bytes;
    uint32_t replay_cache_ttl_ms;
    /* How long a start may wait to create what is missing of the store's tables (the
     * first start, or a release that adds to them). Only what the catalog says is
     * missing is created, so a start whose tables are complete takes no lock; a
     * migration waits for a table lock at most 200 ms at a time, then steps aside
     * (rolls back) and retries with backoff, so that it never holds up live instances'
     * statements queued behind it. 0 = 30000. */
    uint32_t migrate_timeout_ms;
    /* Opens only a database that already holds an idemrpc store (its idem_records table
     * on the search_path): IDEM_NOT_FOUND, and nothing created, otherwise; one whose
     * tables are of an older format is IDEM_FAILED_PRECONDITION, nothing migrated. For
     * tools (idemctl) that must not invent an empty store from a mistyped conninfo, nor
     * change a live store's schema by looking at it. */
    bool existing;
} idem_pg_opts;

/* idem_store_open_postgres with options; opts may be NULL (defaults). */
IDEM_API idem_code idem_store_open_postgres_ex(idem_store **out, const char *conninfo,
                                               const idem_pg_opts *opts);

IDEM_API void idem_store_close(idem_store *st);

/* "lmdb" or "postgres". */
IDEM_API const char *idem_store_backend(const idem_store *st);

/* All functions return IDEM_OK or: IDEM_INVALID_ARGUMENT (bad key), IDEM_RESOURCE_EXHAUSTED
 * (store full; nothing was written), IDEM_INTERNAL (storage error); detail in
 * idem_errmsg(). */

/* With req->token set and the record absent the token is consumed atomically with the
 * claim; an unknown or expired token gives IDEM_FAILED_PRECONDITION, one issued to
 * another caller IDEM_PERMISSION_DENIED, and nothing is written. rec may be NULL; when
 * not, it is always initialised and must be cleared with idem_record_clear(). */
IDEM_API idem_code idem_store_claim(idem_store *st, const idem_claim_req *req,
                                    idem_claim_outcome *outcome, idem_record *rec);

/* IN_PROGRESS(owner) → COMPLETED. IDEM_ABORTED when the record is no longer owned by
 * owner (its lease expired and another claim took it over). */
IDEM_API idem_code idem_store_complete(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                       const void *response, size_t len, uint64_t expires_ms);

/* IN_PROGRESS(owner) → absent, restoring the token the claim consumed (if any). IDEM_ABORTED
 * when not owned by owner. */
IDEM_API idem_code idem_store_release(idem_store *st, const idem_key_ref *key, uint64_t owner);

/* Extends the lease of IN_PROGRESS(owner) to lease_until_ms (the heartbeat of a handler
 * that is still running). IDEM_ABORTED when not owned by owner. */
IDEM_API idem_code idem_store_renew(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                    uint64_t lease_until_ms, uint64_t now_ms);

/* IDEM_NOT_FOUND when absent. */
IDEM_API idem_code idem_store_get(idem_store *st, const idem_key_ref *key, idem_record *rec);

/* Unconditional delete (operator tool). IDEM_NOT_FOUND when absent. */
IDEM_API idem_code idem_store_delete(idem_store *st, const idem_key_ref *key);

/* A tombstone: what the sweep keeps of a COMPLETED record whose result expired, while
 * a server's tombstone horizon runs (idem_server_opts.tombstone_ttl_ms). Keyed by a hash
 * of the effective key; it keeps the first fingerprint_len bytes of the request's
 * fingerprint: 16 on PostgreSQL, 8 on LMDB (another request under the key is taken for
 * the first with probability 2^-64). */
#define IDEM_TOMBSTONE_FP_LEN 16
typedef struct idem_tombstone {
    uint8_t fingerprint[IDEM_TOMBSTONE_FP_LEN]; /* the first bytes of the request's */
    idem_code code;                             /* the outcome: IDEM_OK or a final error */
    uint64_t first_at_ms;                       /* when the call first ran */
    uint64_t expired_at_ms;                     /* when its result expired */
    uint64_t until_ms;                          /* when the sweep deletes it */
    size_t fingerprint_len; /* bytes of fingerprint kept, the rest 0; 0: all 16 */
} idem_tombstone;
/* The key's tombstone (operator tools); IDEM_NOT_FOUND when it has none, and
 * IDEM_UNIMPLEMENTED on a backend without tombstones. */
IDEM_API idem_code idem_store_tombstone_get(idem_store *st, const idem_key_ref *key,
                                            idem_tombstone *out);
/* Deletes the key's tombstone: a late duplicate then runs again. IDEM_NOT_FOUND when
 * absent. */
IDEM_API idem_code idem_store_tombstone_delete(idem_store *st, const idem_key_ref *key);
/* The length of the hash an LMDB store keys a tombstone by (the effective key's). */
#define IDEM_TOMBSTONE_KEY_HASH_LEN 16
/* Called for each tombstone, in the store's order: with its key on PostgreSQL (key_hash
 * NULL); on LMDB, which keeps only a hash of the key, with key NULL and key_hash its
 * IDEM_TOMBSTONE_KEY_HASH_LEN bytes. Both are valid only during the call. Return false
 * to stop. */
typedef bool (*idem_tombstone_visit_fn)(void *arg, const idem_key_ref *key, const uint8_t *key_hash,
                                        const idem_tombstone *t);
/* Visits the tombstones (operator tools); IDEM_UNIMPLEMENTED on a backend without them. */
IDEM_API idem_code idem_store_tombstone_foreach(idem_store *st, idem_tombstone_visit_fn fn,
                                                void *arg);

/* Deletes at most max records and tokens whose expiry is <= now_ms, in one write txn.
 * PostgreSQL: now_ms is read as "the database clock + (now_ms - this host's clock)". */
IDEM_API idem_code idem_store_sweep(idem_store *st, uint64_t now_ms, size_t max, size_t *deleted);

IDEM_API idem_code idem_store_token_put(idem_store *st, const char *token, const char *scope,
                                        uint64_t expires_ms);
/* Atomic delete-if-valid; codes as for a claim with a token. PostgreSQL judges the
 * expiry on the database clock. */
IDEM_API idem_code idem_store_token_consume(idem_store *st, const char *token, const char *scope,
                                            uint64_t now_ms);

IDEM_API idem_code idem_store_stats_get(idem_store *st, idem_store_stats *out);

/* Called for each record in key order; the key strings and rec are valid only during
 * the call (rec->response is NULL, rec->response_len its stored size). Return false to
 * stop. */
typedef bool (*idem_store_visit_fn)(void *arg, const idem_key_ref *key, const idem_record *rec);
/* Visits records in one read txn (a consistent snapshot; writers are not blocked). */
IDEM_API idem_code idem_store_foreach(idem_store *st, idem_store_visit_fn fn, void *arg);

IDEM_API void idem_record_clear(idem_record *rec);

#ifdef __cplusplus
}
#endif
#endif

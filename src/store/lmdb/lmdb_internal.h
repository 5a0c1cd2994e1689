/* LMDB backend of idem_store: what its files share.
 *
 * Databases in one env:
 *   records  effective key → rec_hdr + serialized idem.v1.Response (COMPLETED only)
 *   tokens   token         → tok_hdr + scope
 *   expiry   be64(expires) ‖ sha256(name)[0..16] → type ‖ name   (the sweep index)
 *   tombs    sha256(effective key)[0..16] → fingerprint[0..16] ‖ code ‖ be48 expired_at
 *            ‖ be40 (until - expired_at) ‖ be40 (expired_at - first_at) (tombs.c: a swept
 *            COMPLETED record, kept while tomb_keep_ms runs; no expiry entry: the sweep
 *            scans "tombs". The first layout, 44 bytes with an expiry entry 'T' at until,
 *            is read and swept too. 0.3 ignores "tombs")
 *   meta     "fence" → be64 last owner id handed out (store-assigned owners); a fence a
 *            redo of this process tried is not drawn again here even when that redo
 *            failed and the counter did not move (lmdb_store.fence_floor);
 *            "tomb_keep" → be64 how long the sweep keeps tombstones (tombs.c);
 *            "format" → be32 IDEM__LMDB_FORMAT, the layout described here (env.c: a
 *            newer one is refused at open)
 * An IN_PROGRESS record keeps, after its header, the token its claim consumed
 * (be64 token expiry ‖ token bytes; the scope is the key's caller), so that a release
 * can put the token back in the same txn. Every record and token has exactly one expiry
 * entry; they change in the same write txn. LMDB allows one write txn at a time per env
 * across all processes: that is the unique constraint that makes a claim atomic.
 *
 * The files, by concern: env.c (open/close, the read-txn pool, the ops table),
 * records.c (record format, get/delete/foreach/stats), claim.c (claim, complete, release,
 * renew), fence.c (the fence counter of store-assigned owners), tokens.c (tokens and the
 * token an IN_PROGRESS record keeps), expiry.c (the expiry index), tombs.c (tombstones),
 * tomb_db.c (their layouts), sweep.c (the sweep of what the index says is due), gate.c
 * (the write gate: group commit, or the thread's own handler txn), txn.c (business
 * databases, idem_txn_* and the handler-txn ops); group commit
 * (group_commit.h): group_commit.c (the callers' queue), group_commit_batch.c (the writer
 * thread's batches), group_commit_redo.c (a batch whose commit failed), group_commit_pipe.c
 * (committed batches waiting for the sync that flushes their meta page: MDB_NOMETASYNC),
 * group_commit_sync.c (the file's syncs, and what a sync vouches for after a failed one),
 * wal.c and wal_open.c (the write-ahead log beside data.mdb: wal.h);
 * load.c (the benchmark's bulk load, store_lmdb.h). */
#ifndef IDEMRPC_LMDB_INTERNAL_H
#define IDEMRPC_LMDB_INTERNAL_H

#include <lmdb.h>
#include <stdatomic.h>

/* The on-disk format this file describes; raise it (and teach the open to read the old
 * one, or to refuse it clearly) with any change an older binary would misread. */
#define IDEM__LMDB_FORMAT 1
#include <pthread.h>
#include <sys/types.h>

#include "group_commit.h"
#include "store.h"
#include "store_lmdb.h"

#define REC_MAGIC 0x69640001u /* "id" v1 */
#define READ_POOL 64          /* reset read txns kept (each holds a reader slot) */

enum { TYPE_RECORD = 'r', TYPE_TOKEN = 't', TYPE_TOMB = 'T' };
#define IDEM__LMDB_TOMB_KEY_LEN IDEM_TOMBSTONE_KEY_HASH_LEN /* tombs.c */

typedef struct rec_hdr {
    uint32_t magic;
    uint8_t state;
    uint8_t pad[3];
    uint64_t owner;
    uint64_t lease_until_ms;
    uint64_t first_at_ms;
    uint64_t expires_ms;
    uint8_t fingerprint[IDEM_FINGERPRINT_LEN];
} rec_hdr;

#define APP_DB_NAME (IDEM_MAX_DB_NAME + 5) /* "app." + name + NUL */

typedef struct app_db {
    char name[APP_DB_NAME];
    MDB_dbi dbi;
} app_db;

typedef struct lmdb_store {
    idem_store base; /* first: the generic store */
    MDB_env *env;
    MDB_dbi records, tokens, expiry, meta, tombs, tomb_buckets;
    bool has_meta;         /* false only for a read-only open of a store older than "meta" */
    bool has_tombs;        /* false only for a read-only open of a store older than "tombs" */
    bool has_tomb_buckets; /* likewise, older than "tomb_buckets" (tomb_db.c) */
    _Atomic uint64_t tomb_keep_ms; /* how long the sweep keeps a tombstone; 0: none */
    bool read_only; /* IDEM_STORE_READONLY */
    idem_group_commit gc;
    /* The largest fence a shared claim's redo re-applied or tried to (claim.c): a redo
     * that failed leaves the counter on disk below it, and no claim of this process
     * draws it again. */
    _Atomic uint64_t fence_floor;
    pthread_mutex_t db_mu; /* guards dbs */
    app_db dbs[IDEM_LMDB_MAX_DBS];
    size_t n_dbs;
    /* Reset read txns kept for reuse: mdb_txn_renew is far cheaper than a begin. */
    pthread_mutex_t rpool_mu;
    MDB_txn *rpool[READ_POOL];
    size_t rpool_n;
    /* The directory (st_dev, st_ino), in the process-wide list of open environments:
     * LMDB allows one per directory per process (env.c). */
    dev_t dir_dev;
    ino_t dir_ino;
    struct lmdb_store *next_open;
} lmdb_store;

/* Effective key bytes: caller \0 method \0 key. At most 511 bytes, LMDB's default
 * maximum key size, by the IDEM_MAX_* bounds. Unambiguous because no part can hold a
 * NUL: the API takes C strings, and the codec refuses a NUL in any wire string
 * (decode_request/rejects_embedded_nul_in_strings,
 * store/record_keys_keep_their_parts_apart). */
typedef struct rec_key {
    uint8_t bytes[IDEM_MAX_CALLER + IDEM_MAX_METHOD + IDEM_MAX_KEY + 2];
    size_t len;
} rec_key;

/* The token an IN_PROGRESS record keeps: be64 expiry ‖ token. */
typedef struct rec_token {
    uint8_t bytes[8 + IDEM_MAX_TOKEN];
    size_t len; /* 0: none */
} rec_token;

/* The arguments of one record or token write, for the group committer. */
typedef struct write_args {
    lmdb_store *st;
    const idem_key_ref *ref;
    rec_key key;
    uint64_t owner;
    const void *response;
    size_t len;
    uint64_t ms;      /* expiry, lease end, or now for a token consume */
    uint64_t entered; /* renew: monotonic ms when it was asked for */
    const char *token, *scope;
} write_args;

/* env.c */
extern const idem_store_ops idem__lmdb_ops;
int idem__lmdb_read_begin(lmdb_store *st, MDB_txn **txn);
void idem__lmdb_read_end(lmdb_store *st, MDB_txn *txn);
idem_code idem__lmdb_commit(lmdb_store *st, MDB_txn *txn);

/* records.c */
idem_code idem__lmdb_rec_key_make(rec_key *k, const idem_key_ref *ref);
idem_code idem__lmdb_rec_decode(const MDB_val *v, idem_record *rec, bool want_response);
int idem__lmdb_rec_put(lmdb_store *st, MDB_txn *txn, const rec_key *key, const rec_hdr *h,
                       const void *response, size_t len);
int idem__lmdb_rec_delete(lmdb_store *st, MDB_txn *txn, const rec_key *key, uint64_t expires_ms);
/* ref's record as txn sees it (IDEM_NOT_FOUND when absent); the response only when
 * want_response. */
idem_code idem__lmdb_rec_read(lmdb_store *st, MDB_txn *txn, const idem_key_ref *ref,
                              idem_record *rec, bool want_response);
idem_code idem__lmdb_get(idem_store *base, const idem_key_ref *ref, idem_record *rec);
idem_code idem__lmdb_get_borrowed(idem_store *base, const idem_key_ref *ref, idem_record *rec,
                                  idem_borrow *borrow);
idem_code idem__lmdb_delete(idem_store *base, const idem_key_ref *ref);
idem_code idem__lmdb_foreach(idem_store *base, idem_store_visit_fn fn, void *arg);
idem_code idem__lmdb_stats(idem_store *base, idem_store_stats *out);

/* fence.c: the next store-assigned owner; a redo's owner drawn again (or ABORTED). */
idem_code idem__lmdb_next_fence(lmdb_store *st, MDB_txn *txn, uint64_t *out);
idem_code idem__lmdb_fence_redraw(lmdb_store *st, MDB_txn *txn, uint64_t owner);

/* claim.c */
idem_code idem__lmdb_complete_in(lmdb_store *st, MDB_txn *txn, const idem_key_ref *ref,
                                 uint64_t owner, const void *response, size_t len,
                                 uint64_t expires_ms);
idem_code idem__lmdb_claim_in(lmdb_store *st, MDB_txn *txn, const idem_claim_req *req,
                              idem_claim_outcome *outcome, idem_record *rec);
idem_code idem__lmdb_claim(idem_store *base, const idem_claim_req *req, idem_claim_outcome *outcome,
                           idem_record *rec);
/* complete and release end a shared claim when ticket is its (group_commit.h). */
idem_code idem__lmdb_complete(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                              const void *response, size_t len, uint64_t expires_ms,
                              uint64_t now_ms, uint64_t ticket);
idem_code idem__lmdb_release(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                             uint64_t ticket);
/* Shared commits of a claim and its completion (group_commit.h; store.h's ops). */
idem_code idem__lmdb_claim_shared(idem_store *base, const idem_claim_req *req,
                                  idem_claim_outcome *outcome, idem_record *rec, uint64_t *ticket);
idem_code idem__lmdb_claim_shared_async(idem_store *base, const idem_claim_req *req,
                                        idem__store_claimed_fn done, void *arg);
idem_code idem__lmdb_complete_async(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                                    void *response, size_t len, uint64_t expires_ms,
                                    uint64_t ticket, idem__store_done_fn done, void *arg);
void idem__lmdb_ticket_drop(idem_store *base, uint64_t ticket);
void idem__lmdb_ticket_wait(idem_store *base, uint64_t ticket);
idem_code idem__lmdb_renew(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                           uint64_t lease_until_ms, uint64_t now_ms);

/* tokens.c */
idem_code idem__lmdb_token_take(lmdb_store *st, MDB_txn *txn, const char *token, const char *scope,
                                uint64_t now_ms, uint64_t *expires_ms);
/* The token a claim's record will keep, in *tok (on a takeover, what the record it
 * replaces kept). A takeover re-runs the same call, paid for by the token its record
 * kept, which a release gives back: another token it comes with is checked, consumed
 * nothing and never replaces the kept one. Otherwise the claim's token is consumed and
 * kept. Every check comes before the write. */
idem_code idem__lmdb_claim_token(lmdb_store *st, MDB_txn *txn, const idem_claim_req *req,
                                 bool took_over, rec_token *tok);
void idem__lmdb_rec_token_make(rec_token *t, const char *token, uint64_t expires_ms);
void idem__lmdb_rec_token_read(rec_token *t, const MDB_val *v);
bool idem__lmdb_rec_token_is(const rec_token *t, const char *token);
int idem__lmdb_rec_token_restore(lmdb_store *st, MDB_txn *txn, const rec_key *key,
                                 const rec_token *t);
idem_code idem__lmdb_token_put(idem_store *base, const char *token, const char *scope,
                               uint64_t expires_ms, uint64_t now_ms);
idem_code idem__lmdb_token_consume(idem_store *base, const char *token, const char *scope,
                                   uint64_t now_ms);

/* expiry.c; an entry's key: be64 expires ‖ sha256(name)[0..16] (rc-style: ENOMEM). */
#define IDEM__LMDB_INDEX_KEY_LEN 24
int idem__lmdb_index_key(uint8_t out[IDEM__LMDB_INDEX_KEY_LEN], uint64_t expires, const void *name,
                         size_t len);
int idem__lmdb_index_put(lmdb_store *st, MDB_txn *txn, uint64_t expires, uint8_t type,
                         const void *name, size_t len);
int idem__lmdb_index_del(lmdb_store *st, MDB_txn *txn, uint64_t expires, const void *name,
                         size_t len);
/* sweep.c */
idem_code idem__lmdb_sweep(idem_store *base, uint64_t now_ms, size_t max, size_t *deleted);

/* tombs.c: tombstones (idem_tombstone), their claim and sweep. */
/* A claim met no live record at key: `expired`, the COMPLETED record whose result expired
 * (NULL: none). Within req's horizon the tombstone (of that record, or swept) decides
 * the claim (*decided: TOMBSTONE or MISMATCH, rec filled when not NULL); else
 * *stale_until is the expiry of a swept tombstone the claim must delete (0: none). */
idem_code idem__lmdb_tomb_look(lmdb_store *st, MDB_txn *txn, const rec_key *key,
                               const MDB_val *expired, const idem_claim_req *req,
                               idem_claim_outcome *outcome, idem_record *rec, bool *decided,
                               uint64_t *stale_until);
/* rc-style (MDB_NOTFOUND: none). Deletes key's tombstone, of any layout. */
int idem__lmdb_tomb_delete(lmdb_store *st, MDB_txn *txn, const rec_key *key);
/* rc-style. The sweep of an expired record (v, at key): a COMPLETED one leaves its
 * tombstone when the store keeps them. */
int idem__lmdb_tomb_leave(lmdb_store *st, MDB_txn *txn, const MDB_val *key, const MDB_val *v);
idem_code idem__lmdb_tomb_keep(idem_store *base, uint64_t keep_ms);
idem_code idem__lmdb_tomb_get(idem_store *base, const idem_key_ref *ref, idem_tombstone *out);
idem_code idem__lmdb_tomb_del(idem_store *base, const idem_key_ref *ref);
idem_code idem__lmdb_tomb_foreach(idem_store *base, idem_tombstone_visit_fn fn, void *arg);
/* tomb_db.c: where a tombstone lives, by its key hash h (idem__lmdb_tomb_hash of the
 * effective key; rc-style: ENOMEM), in any layout. find: IDEM_NOT_FOUND when none. */
int idem__lmdb_tomb_hash(uint8_t h[IDEM__LMDB_TOMB_KEY_LEN], const void *key, size_t len);
idem_code idem__lmdb_tomb_find(lmdb_store *st, MDB_txn *txn,
                               const uint8_t h[IDEM__LMDB_TOMB_KEY_LEN], idem_tombstone *t);
/* rc-style; MDB_NOTFOUND when h has none (one that does not decode is deleted too). */
int idem__lmdb_tomb_remove(lmdb_store *st, MDB_txn *txn, const uint8_t h[IDEM__LMDB_TOMB_KEY_LEN]);
/* rc-style. h's tombstone is t from now on, in the present layout. */
int idem__lmdb_tomb_put(lmdb_store *st, MDB_txn *txn, const uint8_t h[IDEM__LMDB_TOMB_KEY_LEN],
                        const idem_tombstone *t);
/* rc-style. Visits every tombstone (key NULL, its hash), until fn returns false. */
int idem__lmdb_tomb_walk(lmdb_store *st, MDB_txn *txn, idem_tombstone_visit_fn fn, void *arg);
/* rc-style. The sweep's bounded scan of the tombstones: deletes at most max that are due. */
int idem__lmdb_tomb_scan(lmdb_store *st, MDB_txn *txn, uint64_t now_ms, size_t max,
                         size_t *deleted);

/* gate.c */
idem_code idem__lmdb_write(lmdb_store *st, idem_write_fn fn, void *ctx);
/* idem__gc_write_held and idem__gc_write_end behind the same gate. */
idem_code idem__lmdb_write_held(lmdb_store *st, idem_write_fn fn, idem_write_fn redo, void *ctx,
                                void (*unref)(void *ctx), void *op_mem, uint64_t *ticket);
idem_code idem__lmdb_write_held_async(lmdb_store *st, idem_write_fn fn, idem_write_fn redo,
                                      void *ctx, void (*unref)(void *ctx), void *op_mem,
                                      idem_gc_applied_fn applied);
idem_code idem__lmdb_write_end(lmdb_store *st, idem_write_fn fn, void *ctx, uint64_t ticket,
                               size_t value_len);
idem_code idem__lmdb_write_end_async(lmdb_store *st, idem_write_fn fn, void *ctx, uint64_t ticket,
                                     size_t value_len,
                                     void (*done)(void *ctx, idem_code code, const char *err),
                                     void *op_mem);
/* A write txn of this thread's own, outside group commit (a handler txn, a sweep): asks
 * an open shared batch to commit first, then waits for LMDB's writer lock. */
int idem__lmdb_write_begin(lmdb_store *st, MDB_txn **txn);
/* IDEM_FAILED_PRECONDITION when this thread holds a handler txn, else IDEM_OK. */
idem_code idem__lmdb_gate_check(void);
/* The handler txn this thread holds from now on (NULL: none). */
void idem__lmdb_gate_set(const void *txn);

/* txn.c */
idem_code idem__lmdb_txn_begin(idem_store *base, uint64_t idle_ms, idem_txn **out);
void idem__lmdb_txn_abort(idem_txn *t);
idem_code idem__lmdb_txn_commit(idem_txn *t);
idem_code idem__lmdb_txn_get(idem_txn *t, const char *db, const void *key, size_t klen,
                             const void **val, size_t *vlen);
idem_code idem__lmdb_txn_put(idem_txn *t, const char *db, const void *key, size_t klen,
                             const void *val, size_t vlen);
idem_code idem__lmdb_txn_del(idem_txn *t, const char *db, const void *key, size_t klen);
idem_code idem__lmdb_app_get(idem_store *base, const char *db, const void *key, size_t klen,
                             void **val, size_t *vlen);
idem_code idem__lmdb_txn_record(idem_txn *t, const idem_key_ref *ref, idem_record *rec);
/* The claim in a handler txn (ops.txn_claim; the cap is not advertised: see claim.c). */
idem_code idem__lmdb_txn_claim(idem_txn *t, const idem_claim_req *req, idem_claim_outcome *outcome,
                               idem_record *rec);
idem_code idem__lmdb_app_next(idem_store *base, const char *db, const void *after, size_t alen,
                              idem_app_entry *out);
idem_code idem__lmdb_txn_complete_commit(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                         const void *response, size_t len, uint64_t expires_ms,
                                         uint64_t now_ms);

#endif

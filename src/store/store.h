/* The idem_store interface behind include/idemrpc/store.h: each backend (lmdb/, pg/)
 * fills one ops table and embeds idem_store as its first member. store.c
 * checks the arguments common to every backend and dispatches. */
#ifndef IDEMRPC_STORE_INTERNAL_H
#define IDEMRPC_STORE_INTERNAL_H

#include "internal.h"

/* What a backend can do; the server and result_cache ask, never compare names. */
enum idem__store_caps {
    /* Handler transactions (txn.h): the txn_* entries below are set. */
    IDEM__STORE_CAP_TXN = 1u << 0,
    /* get never blocks for long (a local read): safe on nng's callback thread. */
    IDEM__STORE_CAP_NONBLOCKING_READ = 1u << 1,
    /* A transactional call claims its key inside its handler txn (txn_claim): the
     * claim, the business writes and the record commit together, and a claim whose
     * session dies vanishes with it. Without it the claim is committed first. */
    IDEM__STORE_CAP_TXN_CLAIM = 1u << 2,
    /* Completions in other processes are announced (watch): waiters wake at once. */
    IDEM__STORE_CAP_WATCH = 1u << 3,
};

/* Called with the idem__key_hash of a key whose record was completed or released, in
 * any process sharing the store; from the store's own thread. */
typedef void (*idem__store_watch_fn)(void *arg, uint32_t key_hash);
/* The key_hash of "every key": announcements may have been lost (the store listens
 * anew after its listening connection broke), so every waiter re-reads and every
 * cached record is dropped. A key whose own hash is this value costs spurious wakes,
 * never a missed one. */
#define IDEM__STORE_WATCH_ALL UINT32_MAX

/* How an asynchronous store write reports its end (err: the message when code is not
 * IDEM_OK). */
typedef void (*idem__store_done_fn)(void *arg, idem_code code, const char *err);
/* How an asynchronous shared claim reports what its caller would have been told
 * (claim_shared_async): the claim's code, its outcome, the owner it drew (an acquired
 * claim's) and its ticket (err: the message when code is not IDEM_OK). */
typedef void (*idem__store_claimed_fn)(void *arg, idem_code code, idem_claim_outcome outcome,
                                       uint64_t owner, uint64_t ticket, const char *err);

/* One business key-value entry, malloc'd (idem__app_entry_clear). */
typedef struct idem_app_entry {
    void *key, *val;
    size_t klen, vlen;
} idem_app_entry;
void idem__app_entry_clear(idem_app_entry *e);

/* Every backend's idem_txn starts with this, so that store.c finds the backend. */
typedef struct idem_txn_head {
    const struct idem_store_ops *ops;
} idem_txn_head;

/* One lease of a renewal round (renew_batch): lease_until_ms - now_ms is the lease. */
typedef struct idem__renewal {
    idem_key_ref key;
    uint64_t owner, lease_until_ms, now_ms;
    idem_code code; /* out */
} idem__renewal;

typedef struct idem_store_ops {
    const char *name;
    unsigned caps; /* idem__store_caps */
    idem_code (*claim)(idem_store *st, const idem_claim_req *req, idem_claim_outcome *outcome,
                       idem_record *rec);
    /* complete and release: ticket 0, or a shared claim's (claim_shared) to end it. */
    idem_code (*complete)(idem_store *st, const idem_key_ref *key, uint64_t owner,
                          const void *response, size_t len, uint64_t expires_ms, uint64_t now_ms,
                          uint64_t ticket);
    idem_code (*release)(idem_store *st, const idem_key_ref *key, uint64_t owner, uint64_t ticket);
    idem_code (*renew)(idem_store *st, const idem_key_ref *key, uint64_t owner,
                       uint64_t lease_until_ms, uint64_t now_ms);
    /* Optional (NULL: renew, one at a time). Renews every lease of r[0..n) at once and
     * never waits for a row another session holds: each r[i].code is IDEM_OK (renewed),
     * IDEM_ABORTED (not the owner's any more) or another code (not renewed this time:
     * the row was held, or the store did not answer). The function's own code is
     * IDEM_OK unless nothing could be tried at all. */
    idem_code (*renew_batch)(idem_store *st, idem__renewal *r, size_t n);
    idem_code (*get)(idem_store *st, const idem_key_ref *key, idem_record *rec);
    /* Optional (NULL: get). As get, but a COMPLETED record's response may be lent
     * (*borrow set: rec->response is the store's, valid until borrow->end; never free
     * it, never clear rec with it): LMDB's read transaction, held until the reply is
     * built, spares a copy of the record. Ended on every other outcome. */
    idem_code (*get_borrowed)(idem_store *st, const idem_key_ref *key, idem_record *rec,
                              idem_borrow *borrow);
    idem_code (*del)(idem_store *st, const idem_key_ref *key);
    /* Deletes up to max of what expired by now_ms; a COMPLETED record among them leaves
     * its tombstone (idem_tombstone) until its expiry plus the store's tombstone keep
     * (tomb_keep) when that is nonzero. */
    idem_code (*sweep)(idem_store *st, uint64_t now_ms, size_t max, size_t *deleted);
    /* Optional (NULL: no tombstones; the four go together). tomb_keep sets how long
     * the sweep keeps a tombstone after its result expired (0: none, the default). */
    idem_code (*tomb_keep)(idem_store *st, uint64_t keep_ms);
    idem_code (*tomb_get)(idem_store *st, const idem_key_ref *key, idem_tombstone *out);
    idem_code (*tomb_del)(idem_store *st, const idem_key_ref *key);
    idem_code (*tomb_foreach)(idem_store *st, idem_tombstone_visit_fn fn, void *arg);
    idem_code (*token_put)(idem_store *st, const char *token, const char *scope,
                           uint64_t expires_ms, uint64_t now_ms);
    idem_code (*token_consume)(idem_store *st, const char *token, const char *scope,
                               uint64_t now_ms);
    idem_code (*stats)(idem_store *st, idem_store_stats *out);
    idem_code (*foreach)(idem_store *st, idem_store_visit_fn fn, void *arg);
    void (*close)(idem_store *st);
    /* IDEM__STORE_CAP_TXN only (see idem__store_txn_* in internal.h). */
    /* idle_ms: how long the database lets the txn's session sit idle in it (0: the
     * backend's default); LMDB has no sessions to end. */
    idem_code (*txn_begin)(idem_store *st, uint64_t idle_ms, idem_txn **out);
    void (*txn_abort)(idem_txn *t);
    /* Optional (NULL: never): the txn's connection to the store broke. */
    bool (*txn_broken)(const idem_txn *t);
    idem_code (*txn_commit)(idem_txn *t);
    idem_code (*txn_complete_commit)(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                     const void *response, size_t len, uint64_t expires_ms,
                                     uint64_t now_ms);
    idem_code (*txn_get)(idem_txn *t, const char *db, const void *key, size_t klen,
                         const void **val, size_t *vlen);
    /* Optional (NULL: txn_get, for a backend whose txns never wait for each other's rows).
     * txn_get waiting for the row's lock at most the store's lock bound: IDEM_ABORTED when
     * another txn held it that long (t is then good only for its abort). */
    idem_code (*txn_get_bounded)(idem_txn *t, const char *db, const void *key, size_t klen,
                                 const void **val, size_t *vlen);
    idem_code (*txn_put)(idem_txn *t, const char *db, const void *key, size_t klen, const void *val,
                         size_t vlen);
    idem_code (*txn_del)(idem_txn *t, const char *db, const void *key, size_t klen);
    idem_code (*app_get)(idem_store *st, const char *db, const void *key, size_t klen, void **val,
                         size_t *vlen);
    /* The entry with the smallest key greater than after (byte order, shorter first),
     * in a read of its own; IDEM_NOT_FOUND when there is none. */
    idem_code (*app_next)(idem_store *st, const char *db, const void *after, size_t alen,
                          idem_app_entry *out);
    /* Key's record as t sees it, kept so until t ends (PostgreSQL: FOR SHARE): state,
     * owner and fingerprint only (no response, no times). IDEM_NOT_FOUND when absent. */
    idem_code (*txn_record)(idem_txn *t, const idem_key_ref *key, idem_record *rec);
    /* Every backend with IDEM__STORE_CAP_TXN_CLAIM; one without may set it too (then
     * only a journaled call's claim uses it, to list the call in the claim's own commit:
     * toolkit/steps.c). The claim inside t; IDEM_CLAIM_IN_PROGRESS also when another
     * session holds the key in its own handler txn (never waits for it). */
    idem_code (*txn_claim)(idem_txn *t, const idem_claim_req *req, idem_claim_outcome *outcome,
                           idem_record *rec);
    /* Undoes every write since the claim, keeping the claim: a final error is then
     * recorded in t without the handler's effect. */
    idem_code (*txn_undo)(idem_txn *t);
    /* Optional (NULL: IDEM_OK). The fence of the claim t holds (txn_claim), drawn in t
     * and not committed, made durable before it leaves the process: nothing may flush
     * such a draw before t commits, and a crash or a failover before then would draw
     * that fence again for the key's next holder. IDEM_OK at once when t holds no claim;
     * else an error, and the fence must not be used. */
    idem_code (*txn_fence_durable)(idem_txn *t);
    /* Optional (NULL: claims and completions commit apart). A claim whose completion may
     * share its commit (LMDB group commit, group_commit.h): it may return before its
     * commit, with *ticket nonzero; the caller then ends it with complete or release
     * (that ticket) or ticket_drop (no write follows), and calls
     * ticket_wait before it answers a result or a refusal decided on it (COMPLETED,
     * MISMATCH), then reads it back (the batch may have failed: only what the disk holds
     * is answered), and idem__store_claim_durable before it hands the claim's owner to
     * another system. A refusal (an error code) is returned only once decided on what
     * the disk holds. ticket 0 everywhere: the plain ops. */
    idem_code (*claim_shared)(idem_store *st, const idem_claim_req *req,
                              idem_claim_outcome *outcome, idem_record *rec, uint64_t *ticket);
    /* Optional: claim_shared without waiting (store-assigned owner): IDEM_OK when queued,
     * and done(arg, ...) is called once, on the store's writer thread, when claim_shared
     * would have returned (it must not wait for a store write); any other code: nothing
     * queued (claim_shared then). The request's strings are copied. */
    idem_code (*claim_shared_async)(idem_store *st, const idem_claim_req *req,
                                    idem__store_claimed_fn done, void *arg);
    /* complete without waiting: IDEM_OK when queued (response, malloc'd, is the
     * store's then), and done(arg, code, err) is called once the commit has ended, on the
     * store's writer thread (it must not wait for a store write); any other code: nothing
     * queued, response still the caller's. */
    idem_code (*complete_async)(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                void *response, size_t len, uint64_t expires_ms, uint64_t ticket,
                                idem__store_done_fn done, void *arg);
    void (*ticket_drop)(idem_store *st, uint64_t ticket);
    void (*ticket_wait)(idem_store *st, uint64_t ticket);
    /* IDEM__STORE_CAP_WATCH only. At most IDEM__STORE_MAX_WATCH watchers. */
    idem_code (*watch)(idem_store *st, idem__store_watch_fn fn, void *arg);
    void (*unwatch)(idem_store *st, idem__store_watch_fn fn, void *arg);
} idem_store_ops;

#define IDEM__STORE_MAX_WATCH 8

struct idem_store {
    const idem_store_ops *ops;
};

bool idem__store_has(const idem_store *st, unsigned cap);
/* idem_store_get through get_borrowed where the store has it (borrow->end NULL when
 * nothing was lent). */
idem_code idem__store_get_borrowed(idem_store *st, const idem_key_ref *key, idem_record *rec,
                                   idem_borrow *borrow);

/* The bounds every backend enforces on an effective key (IDEM_MAX_*). */
idem_code idem__key_check(const idem_key_ref *ref);

/* idem_store_complete and idem_store_token_put with the caller's clock: expires_ms -
 * now_ms is what PostgreSQL adds to its own clock. The public forms use this host's.
 * ticket: a shared claim's (idem__store_claim_shared) that the completion ends, or 0. */
idem_code idem__store_complete_at(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                  const void *response, size_t len, uint64_t expires_ms,
                                  uint64_t now_ms, uint64_t ticket);
idem_code idem__store_token_put_at(idem_store *st, const char *token, const char *scope,
                                   uint64_t expires_ms, uint64_t now_ms);

/* The shared-commit ops (store_ops.claim_shared): each falls back to the plain op (and
 * *ticket 0) on a store without them; ticket 0 is a no-op for drop and wait. */
idem_code idem__store_claim_shared(idem_store *st, const idem_claim_req *req,
                                   idem_claim_outcome *outcome, idem_record *rec, uint64_t *ticket);
idem_code idem__store_release_shared(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                     uint64_t ticket);
/* ops->claim_shared_async after the checks of a claim; IDEM_UNAVAILABLE (nothing
 * queued) without it. */
idem_code idem__store_claim_shared_async(idem_store *st, const idem_claim_req *req,
                                         idem__store_claimed_fn done, void *arg);
/* ops->complete_async; IDEM_UNAVAILABLE (nothing queued) without it or a ticket. */
idem_code idem__store_complete_async(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                     void *response, size_t len, uint64_t expires_ms,
                                     uint64_t ticket, idem__store_done_fn done, void *arg);
void idem__store_ticket_drop(idem_store *st, uint64_t ticket);
void idem__store_ticket_wait(idem_store *st, uint64_t ticket);
/* The claim (key, owner) of a shared commit (ticket) is on disk: waits for its batch
 * (asking it to commit now), then reads the claim back from the store. IDEM_OK at once
 * for ticket 0 (the claim committed before its handler ran); IDEM_UNAVAILABLE when the
 * claim is not there as (IN_PROGRESS, owner): its commit failed and its redo too, or
 * another writer took the key or the fence meanwhile. */
idem_code idem__store_claim_durable(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                    uint64_t ticket);

/* ops->tomb_keep: the longest tombstone horizon of the servers sharing st, which the
 * sweep keeps them for. FAILED_PRECONDITION for a nonzero one on a store without them. */
idem_code idem__store_tomb_keep(idem_store *st, uint64_t keep_ms);
/* Whether tombstone t answers claim req at now_ms: within req's horizon after the
 * result expired, and before t's own until. */
bool idem__tomb_decides(const idem_tombstone *t, const idem_claim_req *req, uint64_t now_ms);
/* Whether t was left by the request whose fingerprint is fp, as far as t kept it. */
bool idem__tomb_same(const idem_tombstone *t, const uint8_t fp[IDEM_FINGERPRINT_LEN]);
/* The claim's answer from a tombstone that decides it: IDEM_CLAIM_TOMBSTONE for the same
 * request, IDEM_CLAIM_MISMATCH for another; rec (may be NULL) gets the tombstone. */
void idem__tomb_answer(const idem_tombstone *t, const idem_claim_req *req,
                       idem_claim_outcome *outcome, idem_record *rec);
/* The code a serialized idem.v1.Response carries (field 1); IDEM_UNKNOWN when the bytes
 * hold none that is valid. */
idem_code idem__response_code(const void *buf, size_t len);

/* ops->renew_batch, or renew for each when the backend has no batch. */
idem_code idem__store_renew_batch(idem_store *st, idem__renewal *r, size_t n);

/* The bounds of a business key-value access (idem_txn_*, idem_store_app_get). */
#define IDEM__APP_MAX_KEY 511
idem_code idem__app_check(const char *db, size_t klen);

/* idem_txn_get waiting for the row's lock within the store's lock bound (ops->txn_get_bounded):
 * IDEM_ABORTED when another txn held the row that long; t then only aborts. */
idem_code idem__store_txn_get_bounded(idem_txn *t, const char *db, const void *key, size_t klen,
                                      const void **val, size_t *vlen);

/* ops->txn_record; rec is always initialised (clear it with idem_record_clear). */
idem_code idem__store_txn_record(idem_txn *t, const idem_key_ref *key, idem_record *rec);

/* idem_store_app_get's neighbour for scans (the re-driver): see ops->app_next. */
idem_code idem__store_app_next(idem_store *st, const char *db, const void *after, size_t alen,
                               idem_app_entry *out);

/* FNV-1a (64 bits) over caller \0 method \0 key, and its 32-bit fold: the in-flight
 * buckets and the stores' completion announcements use the fold, PostgreSQL's advisory
 * key locks the 64 bits. A collision only makes an unrelated key wait or wake. */
uint64_t idem__key_hash64(const idem_key_ref *key);
uint32_t idem__key_hash(const idem_key_ref *key);

/* Watching a store that cannot announce completions is a no-op (IDEM_OK): its waiters
 * re-read on their timers. */
idem_code idem__store_watch(idem_store *st, idem__store_watch_fn fn, void *arg);
void idem__store_unwatch(idem_store *st, idem__store_watch_fn fn, void *arg);

/* Handler transactions (txn.h), backend-neutral: begin; then either abort, or write the COMPLETED
 * record into the same txn and commit both (the txn is freed either way). */
idem_code idem__store_txn_begin(idem_store *st, idem_txn **out);
/* The same for a handler that holds its claim in the txn: a session left idle in it for
 * idle_ms (its process stopped, or cut off) is ended by the database, so that a stopped
 * instance holds the key for a bounded time (PostgreSQL; 0: the default, 5 min). */
idem_code idem__store_txn_begin_idle(idem_store *st, uint64_t idle_ms, idem_txn **out);
void idem__store_txn_abort(idem_txn *t);
/* True when t's connection to the store broke (PostgreSQL: a restart, a failover, a
 * statement that got no answer): whatever failed in t failed for the store's sake. */
bool idem__store_txn_broken(const idem_txn *t);
/* Commits the business writes alone (no idempotency record); frees t. */
idem_code idem__store_txn_commit(idem_txn *t);
idem_code idem__store_txn_complete_commit(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                          const void *response, size_t len, uint64_t expires_ms,
                                          uint64_t now_ms);
/* Stores with IDEM__STORE_CAP_TXN_CLAIM (store.h): the claim inside t (rec always
 * initialised); then, for a final error, undo the handler's writes but keep the claim. */
idem_code idem__store_txn_claim(idem_txn *t, const idem_claim_req *req, idem_claim_outcome *outcome,
                                idem_record *rec);
idem_code idem__store_txn_undo(idem_txn *t);
/* ops->txn_fence_durable, IDEM_OK without it. */
idem_code idem__store_txn_fence_durable(idem_txn *t);

#endif

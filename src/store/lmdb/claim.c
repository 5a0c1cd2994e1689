/* The claim lifecycle of a record: claim (acquire, take over, or report the stored
 * outcome), then complete, release or renew by its owner (store-assigned owners come
 * from the fence counter, fence.c). Each step runs in one write txn: a group-commit write,
 * or for idem__lmdb_complete_in the txn of a transactional handler. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmdb_internal.h"

/* Writes a fresh IN_PROGRESS record keeping tok (replacing `old` when it is not NULL). */
static int claim_write(lmdb_store *st, MDB_txn *txn, const rec_key *key, const idem_claim_req *req,
                       uint64_t owner, const rec_hdr *old, const rec_token *tok)
{
    rec_hdr h = {.magic = REC_MAGIC,
                 .state = IDEM_REC_IN_PROGRESS,
                 .owner = owner,
                 .lease_until_ms = req->lease_until_ms,
                 .first_at_ms = req->now_ms,
                 .expires_ms = req->expires_ms};
    memcpy(h.fingerprint, req->fingerprint, sizeof(h.fingerprint));
    int rc;
    if (old != NULL &&
        (rc = idem__lmdb_index_del(st, txn, old->expires_ms, key->bytes, key->len)) != 0) {
        return rc;
    }
    if ((rc = idem__lmdb_rec_put(st, txn, key, &h, tok->bytes, tok->len)) != 0) {
        return rc;
    }
    return idem__lmdb_index_put(st, txn, h.expires_ms, TYPE_RECORD, key->bytes, key->len);
}

typedef struct claim_ctx {
    lmdb_store *st;
    const idem_claim_req *req;
    const rec_key *key;
    idem_claim_outcome *outcome;
    idem_record *rec;      /* may be NULL */
    uint64_t entered_mono; /* when idem_store_claim was called */
} claim_ctx;

/* Sets the outcome of a claim that acquired (or took over) the record as written (at). */
static void claim_acquired(const claim_ctx *c, const idem_claim_req *at, bool took_over,
                           uint64_t owner)
{
    *c->outcome = took_over ? IDEM_CLAIM_TAKEN_OVER : IDEM_CLAIM_ACQUIRED;
    if (c->rec != NULL) {
        c->rec->state = IDEM_REC_IN_PROGRESS;
        c->rec->owner = owner;
        c->rec->first_at_ms = at->now_ms;
        c->rec->lease_until_ms = at->lease_until_ms;
        c->rec->expires_ms = at->expires_ms;
        memcpy(c->rec->fingerprint, at->fingerprint, IDEM_FINGERPRINT_LEN);
    }
}

/* Reads the key's record, if any, into *old (an IN_PROGRESS one's token into *tok) and
 * sets *decided when that record answers the claim: a different fingerprint (MISMATCH),
 * a live result (COMPLETED) or a live lease (IN_PROGRESS), with c->rec filled. Otherwise
 * the claim goes on: a new key, an expired result, or a lease to take over. */
static idem_code look_existing(MDB_txn *txn, const claim_ctx *c, rec_hdr *old, rec_token *tok,
                               bool *have_old, bool *decided, uint64_t *stale_tomb)
{
    const idem_claim_req *req = c->req;
    MDB_val k = {c->key->len, (void *)c->key->bytes}, v;
    idem_code code;
    int rc = mdb_get(txn, c->st->records, &k, &v);
    *stale_tomb = 0;
    if (rc == MDB_NOTFOUND) { /* a tombstone within the horizon decides, else none */
        return idem__lmdb_tomb_look(c->st, txn, c->key, NULL, req, c->outcome, c->rec, decided,
                                    stale_tomb);
    }
    if (rc != 0) {
        return idem__lmdb_code(rc, "claim get");
    }
    if ((code = idem__lmdb_rec_decode(&v, NULL, false)) != IDEM_OK) {
        return code;
    }
    memcpy(old, v.mv_data, sizeof(*old));
    *have_old = true;
    if (old->state == IDEM_REC_IN_PROGRESS) {
        idem__lmdb_rec_token_read(tok, &v); /* a takeover inherits the consumed token */
    }
    if (old->state == IDEM_REC_COMPLETED && old->expires_ms <= req->now_ms) {
        return idem__lmdb_tomb_look(c->st, txn, c->key, &v, req, c->outcome, c->rec, decided,
                                    stale_tomb); /* expired: its tombstone, or free */
    }
    if (memcmp(old->fingerprint, req->fingerprint, IDEM_FINGERPRINT_LEN) != 0) {
        *c->outcome = IDEM_CLAIM_MISMATCH;
        *decided = true;
        return c->rec != NULL ? idem__lmdb_rec_decode(&v, c->rec, false) : IDEM_OK;
    }
    if (old->state == IDEM_REC_COMPLETED || old->lease_until_ms > req->now_ms) {
        *c->outcome =
            old->state == IDEM_REC_COMPLETED ? IDEM_CLAIM_COMPLETED : IDEM_CLAIM_IN_PROGRESS;
        *decided = true;
        return c->rec != NULL ? idem__lmdb_rec_decode(&v, c->rec, true) : IDEM_OK;
    }
    return IDEM_OK; /* IN_PROGRESS with an expired lease: the owner crashed or hung. */
}

static idem_code claim_apply(MDB_txn *txn, void *arg)
{
    const claim_ctx *c = arg;
    const idem_claim_req *req = c->req;
    rec_hdr old;
    rec_token tok = {.len = 0};
    bool have_old = false, decided = false;
    uint64_t owner = req->owner, stale_tomb;
    idem_code code;
    int rc;

    if (c->rec != NULL) { /* this may be a re-run after a failed batch */
        idem_record_clear(c->rec);
        memset(c->rec, 0, sizeof(*c->rec));
    }
    code = look_existing(txn, c, &old, &tok, &have_old, &decided, &stale_tomb);
    if (code != IDEM_OK || decided) {
        return code;
    }
    if (owner == 0 && !c->st->has_meta) { /* no fence counter; refused before any write */
        return idem__err(IDEM_FAILED_PRECONDITION, "store opened read-only");
    }
    bool took_over = have_old && old.state == IDEM_REC_IN_PROGRESS;
    /* The lease runs from this commit, not from the request: a claim that waited for the
     * writer (a transactional handler holds it, another process is stopped while holding
     * it) for longer than its lease would otherwise commit already expired, and the next
     * duplicate would take over a handler that has only just started. The decisions above
     * keep the request's time: a late reader errs on the side of "still leased". */
    uint64_t waited = idem__mono_ms() - c->entered_mono;
    idem_claim_req at = *req;
    at.lease_until_ms = idem__add_sat(at.lease_until_ms, waited);
    at.expires_ms = idem__add_sat(at.expires_ms, waited);
    if ((code = idem__lmdb_claim_token(c->st, txn, req, took_over, &tok)) != IDEM_OK) {
        return code; /* a takeover keeps the first token (lmdb_internal.h) */
    }
    if (owner == 0 && (code = idem__lmdb_next_fence(c->st, txn, &owner)) != IDEM_OK) {
        return code;
    }
    if ((stale_tomb != 0 && (rc = idem__lmdb_tomb_delete(c->st, txn, c->key)) != 0) ||
        (rc = claim_write(c->st, txn, c->key, &at, owner, have_old ? &old : NULL, &tok)) != 0) {
        return idem__lmdb_code(rc, "claim put");
    }
    claim_acquired(c, &at, took_over, owner);
    return IDEM_OK;
}

idem_code idem__lmdb_claim(idem_store *base, const idem_claim_req *req, idem_claim_outcome *outcome,
                           idem_record *rec)
{
    lmdb_store *st = (lmdb_store *)base;
    rec_key key;
    idem_code code = idem__lmdb_rec_key_make(&key, &req->key);
    if (code != IDEM_OK) {
        return code;
    }
    claim_ctx c = {st, req, &key, outcome, rec, idem__mono_ms()};
    return idem__lmdb_write(st, claim_apply, &c);
}

/* The claim inside a write txn this thread holds (a handler txn: txn.c): what a
 * journaled call uses to list itself for the re-driver in its claim's own commit. The
 * store does not advertise IDEM__STORE_CAP_TXN_CLAIM: transactional handlers still
 * claim first, through group commit. */
idem_code idem__lmdb_claim_in(lmdb_store *st, MDB_txn *txn, const idem_claim_req *req,
                              idem_claim_outcome *outcome, idem_record *rec)
{
    rec_key key;
    idem_code code = idem__lmdb_rec_key_make(&key, &req->key);
    if (code != IDEM_OK) {
        return code;
    }
    claim_ctx c = {st, req, &key, outcome, rec, idem__mono_ms()};
    return claim_apply(txn, &c);
}

/* A shared claim (group_commit.h): its request and outputs live here, with the writer
 * thread, which may re-apply the claim after its caller has moved on. */
typedef struct shared_claim {
    claim_ctx c; /* points at the members below */
    idem_claim_req req;
    rec_key key;
    char caller[IDEM_MAX_CALLER + 1], token[IDEM_MAX_TOKEN + 1];
    idem_claim_outcome outcome;
    idem_record rec;
    uint64_t owner; /* drawn when the claim acquired the record (0: it did not): redo's */
    atomic_int refs;
    _Alignas(max_align_t) unsigned char op[IDEM_GC_OP_BYTES]; /* its group commit op */
} shared_claim;

static idem_code shared_apply(MDB_txn *txn, void *arg)
{
    shared_claim *h = arg;
    idem_code code = claim_apply(txn, &h->c);
    bool owned = h->outcome == IDEM_CLAIM_ACQUIRED || h->outcome == IDEM_CLAIM_TAKEN_OVER;
    h->owner = code == IDEM_OK && owned ? h->rec.owner : 0;
    return code;
}

/* The claim again, in a txn of its own, as it was first applied: same owner, the counter
 * moved to it. Writes nothing unless it acquires with that owner (the key was taken, or
 * the fence drawn, meanwhile: its caller's completion then finds the claim lost, and
 * its fence is refused). Only reads what its caller no longer writes. */
static idem_code shared_redo(MDB_txn *txn, void *arg)
{
    const shared_claim *h = arg;
    if (h->owner == 0) {
        return IDEM_OK;
    }
    idem_claim_req req = h->req;
    idem_claim_outcome outcome;
    req.owner = h->owner;
    claim_ctx c = {h->c.st, &req, &h->key, &outcome, NULL, h->c.entered_mono};
    idem_code code = idem__lmdb_fence_redraw(h->c.st, txn, h->owner);
    if (code == IDEM_OK && (code = claim_apply(txn, &c)) == IDEM_OK &&
        outcome != IDEM_CLAIM_ACQUIRED && outcome != IDEM_CLAIM_TAKEN_OVER) {
        code = idem__err(IDEM_ABORTED, "claim lost: taken while its batch was re-run");
    }
    return code;
}

static void shared_unref(void *arg)
{
    shared_claim *h = arg;
    if (atomic_fetch_sub(&h->refs, 1) == 1) {
        idem_record_clear(&h->rec);
        free(h);
    }
}

/* A shared claim's request, copied (its strings too) into a new shared_claim of size
 * bytes (at least its own) with two references. */
static idem_code shared_new(lmdb_store *st, const idem_claim_req *req, size_t size,
                            shared_claim **out)
{
    shared_claim *h = *out = calloc(1, size);
    if (h == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory for a claim");
    }
    idem_code code = idem__lmdb_rec_key_make(&h->key, &req->key);
    if (code != IDEM_OK) {
        free(h);
        *out = NULL;
        return code;
    }
    h->req = *req;
    snprintf(h->caller, sizeof(h->caller), "%s", req->key.caller); /* bounds checked */
    h->req.key = (idem_key_ref){h->caller, NULL, NULL};            /* claim_apply: caller */
    if (req->token != NULL) {
        snprintf(h->token, sizeof(h->token), "%s", req->token);
        h->req.token = h->token;
    }
    h->c = (claim_ctx){st, &h->req, &h->key, &h->outcome, &h->rec, idem__mono_ms()};
    atomic_init(&h->refs, 2);
    return IDEM_OK;
}

idem_code idem__lmdb_claim_shared(idem_store *base, const idem_claim_req *req,
                                  idem_claim_outcome *outcome, idem_record *rec, uint64_t *ticket)
{
    lmdb_store *st = (lmdb_store *)base;
    shared_claim *h;
    *ticket = 0;
    idem_code code = shared_new(st, req, sizeof(*h), &h);
    if (code != IDEM_OK) {
        return code;
    }
    code = idem__lmdb_write_held(st, shared_apply, shared_redo, h, shared_unref, h->op, ticket);
    if (code == IDEM_OK) {
        *outcome = h->outcome;
        *rec = h->rec; /* moved: the writer thread's runs are over for these */
        memset(&h->rec, 0, sizeof(h->rec));
    }
    shared_unref(h);
    return code;
}

/* An asynchronous shared claim: its caller is told the outcome, not the record. */
typedef struct async_claim {
    shared_claim h; /* first: the shared claim's functions take it for a shared_claim */
    idem__store_claimed_fn done;
    void *arg;
} async_claim;

/* On the writer thread; group commit drops the caller's reference after it. */
static void async_claim_applied(void *ctx, idem_code code, uint64_t ticket, const char *err)
{
    async_claim *a = ctx;
    a->done(a->arg, code, a->h.outcome, code == IDEM_OK ? a->h.owner : 0, ticket, err);
}

idem_code idem__lmdb_claim_shared_async(idem_store *base, const idem_claim_req *req,
                                        idem__store_claimed_fn done, void *arg)
{
    lmdb_store *st = (lmdb_store *)base;
    shared_claim *h;
    if (!st->gc.started) {
        return idem__err(IDEM_UNAVAILABLE, "no writer thread: claim and wait");
    }
    idem_code code = shared_new(st, req, sizeof(async_claim), &h);
    if (code != IDEM_OK) {
        return code;
    }
    ((async_claim *)h)->done = done;
    ((async_claim *)h)->arg = arg;
    code = idem__lmdb_write_held_async(st, shared_apply, shared_redo, h, shared_unref, h->op,
                                       async_claim_applied);
    if (code != IDEM_OK) {
        free(h); /* nothing queued: no other reference */
    }
    return code;
}

/* Reads the record for key in txn and checks that owner holds it. */
static idem_code owned_get(lmdb_store *st, MDB_txn *txn, const rec_key *key, uint64_t owner,
                           rec_hdr *h, rec_token *tok)
{
    MDB_val k = {key->len, (void *)key->bytes}, v;
    int rc = mdb_get(txn, st->records, &k, &v);
    if (rc == MDB_NOTFOUND) {
        return idem__err(IDEM_ABORTED, "claim lost: record is gone");
    } else if (rc != 0) {
        return idem__lmdb_code(rc, "get");
    }
    idem_code code = idem__lmdb_rec_decode(&v, NULL, false);
    if (code != IDEM_OK) {
        return code;
    }
    memcpy(h, v.mv_data, sizeof(*h));
    if (h->state != IDEM_REC_IN_PROGRESS || h->owner != owner) {
        return idem__err(IDEM_ABORTED, "claim lost: lease expired and taken over");
    }
    if (tok != NULL) {
        idem__lmdb_rec_token_read(tok, &v);
    }
    return IDEM_OK;
}

idem_code idem__lmdb_complete_in(lmdb_store *st, MDB_txn *txn, const idem_key_ref *ref,
                                 uint64_t owner, const void *response, size_t len,
                                 uint64_t expires_ms)
{
    rec_key key;
    rec_hdr h;
    idem_code code;
    int rc;
    if ((code = idem__lmdb_rec_key_make(&key, ref)) != IDEM_OK ||
        (code = owned_get(st, txn, &key, owner, &h, NULL)) != IDEM_OK) {
        return code;
    }
    if ((rc = idem__lmdb_index_del(st, txn, h.expires_ms, key.bytes, key.len)) != 0) {
        return idem__lmdb_code(rc, "complete index");
    }
    h.state = IDEM_REC_COMPLETED;
    h.expires_ms = expires_ms;
    if ((rc = idem__lmdb_rec_put(st, txn, &key, &h, response, len)) != 0 ||
        (rc = idem__lmdb_index_put(st, txn, expires_ms, TYPE_RECORD, key.bytes, key.len)) != 0) {
        return idem__lmdb_code(rc, "complete put");
    }
    return IDEM_OK;
}

static idem_code complete_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    return idem__lmdb_complete_in(w->st, txn, w->ref, w->owner, w->response, w->len, w->ms);
}

idem_code idem__lmdb_complete(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                              const void *response, size_t len, uint64_t expires_ms,
                              uint64_t now_ms, uint64_t ticket)
{
    (void)now_ms; /* LMDB keeps the caller's absolute times */
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {
        .st = st, .ref = ref, .owner = owner, .response = response, .len = len, .ms = expires_ms};
    return idem__lmdb_write_end(st, complete_apply, &w, ticket, len);
}

/* An asynchronous completion: its key and response, with the writer thread until done. */
typedef struct async_complete {
    write_args w;
    idem_key_ref ref;
    char caller[IDEM_MAX_CALLER + 1], method[IDEM_MAX_METHOD + 1], key[IDEM_MAX_KEY + 1];
    void *response;
    idem__store_done_fn done;
    void *arg;
    _Alignas(max_align_t) unsigned char op[IDEM_GC_OP_BYTES]; /* its group commit op */
} async_complete;

static void async_complete_done(void *ctx, idem_code code, const char *err)
{
    async_complete *a = ctx;
    a->done(a->arg, code, err);
    free(a->response);
    free(a);
}

idem_code idem__lmdb_complete_async(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                                    void *response, size_t len, uint64_t expires_ms,
                                    uint64_t ticket, idem__store_done_fn done, void *arg)
{
    async_complete *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory for a completion");
    }
    snprintf(a->caller, sizeof(a->caller), "%s", ref->caller); /* bounds checked */
    snprintf(a->method, sizeof(a->method), "%s", ref->method);
    snprintf(a->key, sizeof(a->key), "%s", ref->key);
    a->ref = (idem_key_ref){a->caller, a->method, a->key};
    a->w = (write_args){.st = (lmdb_store *)base,
                        .ref = &a->ref,
                        .owner = owner,
                        .response = response,
                        .len = len,
                        .ms = expires_ms};
    a->response = response;
    a->done = done;
    a->arg = arg;
    idem_code code = idem__lmdb_write_end_async(a->w.st, complete_apply, a, ticket, len,
                                                async_complete_done, a->op);
    if (code != IDEM_OK) {
        free(a); /* the response stays the caller's */
    }
    return code;
}

static idem_code release_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    rec_hdr h;
    rec_token tok;
    idem_code code = owned_get(w->st, txn, &w->key, w->owner, &h, &tok);
    if (code != IDEM_OK) {
        return code;
    }
    int rc = idem__lmdb_rec_delete(w->st, txn, &w->key, h.expires_ms);
    if (rc == 0) {
        rc = idem__lmdb_rec_token_restore(w->st, txn, &w->key, &tok);
    }
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "release delete");
}

/* w->ms is the new lease end, w->entered the monotonic time the renewal was asked for:
 * like a claim's, the lease runs from this txn, not from the request. A renewal that
 * waited for the writer longer than a lease (a process stopped holding it, a slow fsync)
 * would otherwise commit a lease that has already run out, and a takeover queued behind
 * it would win over an owner that is alive and renewing. */
static idem_code renew_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    rec_hdr h;
    rec_token tok;
    idem_code code = owned_get(w->st, txn, &w->key, w->owner, &h, &tok);
    if (code != IDEM_OK) {
        return code;
    }
    uint64_t lease_until = idem__add_sat(w->ms, idem__mono_ms() - w->entered);
    int rc = 0;
    if (h.expires_ms < lease_until) { /* the sweep must not take a record still leased */
        if ((rc = idem__lmdb_index_del(w->st, txn, h.expires_ms, w->key.bytes, w->key.len)) == 0) {
            h.expires_ms = lease_until;
            rc = idem__lmdb_index_put(w->st, txn, h.expires_ms, TYPE_RECORD, w->key.bytes,
                                      w->key.len);
        }
    }
    h.lease_until_ms = lease_until;
    if (rc == 0) {
        rc = idem__lmdb_rec_put(w->st, txn, &w->key, &h, tok.bytes, tok.len);
    }
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "renew");
}

idem_code idem__lmdb_renew(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                           uint64_t lease_until_ms, uint64_t now_ms)
{
    (void)now_ms;
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st, .owner = owner, .ms = lease_until_ms, .entered = idem__mono_ms()};
    idem_code code = idem__lmdb_rec_key_make(&w.key, ref);
    return code != IDEM_OK ? code : idem__lmdb_write(st, renew_apply, &w);
}

idem_code idem__lmdb_release(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                             uint64_t ticket)
{
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st, .owner = owner};
    idem_code code = idem__lmdb_rec_key_make(&w.key, ref);
    if (code != IDEM_OK) {
        idem__gc_drop(&st->gc, ticket);
        return code;
    }
    return idem__lmdb_write_end(st, release_apply, &w, ticket, 0);
}

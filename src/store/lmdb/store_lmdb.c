/* LMDB backend of idem_store.
 *
 * Databases in one env:
 *   records  effective key → rec_hdr + serialized idem.v1.Response (COMPLETED only)
 *   tokens   token         → tok_hdr + scope
 *   expiry   be64(expires) ‖ sha256(name)[0..16] → type ‖ name   (the sweep index)
 *   meta     "fence" → be64 last owner id handed out (store-assigned owners)
 * An IN_PROGRESS record keeps, after its header, the token its claim consumed
 * (be64 token expiry ‖ token bytes; the scope is the key's caller), so that a release
 * can put the token back in the same txn. Every record and token has exactly one expiry
 * entry; they change in the same write txn. LMDB allows one write txn at a time per env across all processes: that is the
 * unique constraint that makes a claim atomic. */
#include <errno.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "group_commit.h"
#include "store.h"
#include "store_lmdb.h"

#define REC_MAGIC 0x69640001u /* "id" v1 */
#define INDEX_KEY_LEN 24
#define DEFAULT_MAP_SIZE ((size_t)1 << 30)
#define GROUP_COMMIT_BATCH 256 /* writes per shared txn at most */
#define READ_POOL 64           /* reset read txns kept (each holds a reader slot) */

enum { TYPE_RECORD = 'r', TYPE_TOKEN = 't' };

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

/* The handler txn this thread holds, if any. LMDB's writer lock is not recursive: a
 * second write txn begun on this thread would wait for itself forever. */
static _Thread_local const void *thread_write_txn;

static idem_code nested_write(void)
{
    return idem__err(IDEM_FAILED_PRECONDITION,
                     "this thread holds a transactional handler's write txn: use idem_txn_* "
                     "inside it, not another store write");
}

typedef struct tok_hdr {
    uint64_t expires_ms;
} tok_hdr;

#define APP_DB_NAME (IDEM_MAX_DB_NAME + 5) /* "app." + name + NUL */

typedef struct app_db {
    char name[APP_DB_NAME];
    MDB_dbi dbi;
} app_db;

typedef struct lmdb_store {
    idem_store base; /* first: the generic store */
    MDB_env *env;
    MDB_dbi records, tokens, expiry, meta;
    bool has_meta; /* false only for a read-only open of a store older than "meta" */
    idem_group_commit gc;
    pthread_mutex_t db_mu; /* guards dbs */
    app_db dbs[IDEM_LMDB_MAX_DBS];
    size_t n_dbs;
    /* Reset read txns kept for reuse: mdb_txn_renew is far cheaper than a begin. */
    pthread_mutex_t rpool_mu;
    MDB_txn *rpool[READ_POOL];
    size_t rpool_n;
} lmdb_store;

static const idem_store_ops lmdb_ops;

/* The LMDB store behind base, or NULL for another backend. */
static lmdb_store *lmdb_of(idem_store *base)
{
    return base != NULL && base->ops == &lmdb_ops ? (lmdb_store *)base : NULL;
}

/* Effective key bytes: caller \0 method \0 key. At most 511 bytes, LMDB's default
 * maximum key size, by the IDEM_MAX_* bounds. */
typedef struct rec_key {
    uint8_t bytes[IDEM_MAX_CALLER + IDEM_MAX_METHOD + IDEM_MAX_KEY + 2];
    size_t len;
} rec_key;

static idem_code lmdb_code(int rc, const char *what)
{
    if (rc == MDB_MAP_FULL || rc == MDB_TXN_FULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "store full (%s): %s", what, mdb_strerror(rc));
    }
    return idem__err(IDEM_INTERNAL, "%s: %s", what, mdb_strerror(rc));
}

/* Every write outside a handler txn goes through the group committer. */
static idem_code lmdb_write(lmdb_store *st, idem_write_fn fn, void *ctx)
{
    return thread_write_txn != NULL ? nested_write() : idem__gc_write(&st->gc, fn, ctx);
}

static idem_code rec_key_make(rec_key *k, const idem_key_ref *ref)
{
    idem_code code = idem__key_check(ref);
    if (code != IDEM_OK) {
        return code;
    }
    const char *caller = ref->caller != NULL ? ref->caller : "";
    size_t lc = strlen(caller), lm = strlen(ref->method), lk = strlen(ref->key);
    memcpy(k->bytes, caller, lc);
    k->bytes[lc] = 0;
    memcpy(k->bytes + lc + 1, ref->method, lm);
    k->bytes[lc + 1 + lm] = 0;
    memcpy(k->bytes + lc + lm + 2, ref->key, lk);
    k->len = lc + lm + lk + 2;
    return IDEM_OK;
}

static void index_key(uint8_t out[INDEX_KEY_LEN], uint64_t expires, const void *name, size_t len)
{
    uint8_t digest[32];
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(expires >> (56 - 8 * i));
    }
    idem__sha256((const void *const[]){name}, (const size_t[]){len}, 1, digest);
    memcpy(out + 8, digest, INDEX_KEY_LEN - 8);
}

static int index_put(lmdb_store *st, MDB_txn *txn, uint64_t expires, uint8_t type, const void *name,
                     size_t len)
{
    uint8_t kb[INDEX_KEY_LEN];
    index_key(kb, expires, name, len);
    MDB_val k = {INDEX_KEY_LEN, kb}, v = {len + 1, NULL};
    int rc = mdb_put(txn, st->expiry, &k, &v, MDB_RESERVE);
    if (rc == 0) {
        ((uint8_t *)v.mv_data)[0] = type;
        memcpy((uint8_t *)v.mv_data + 1, name, len);
    }
    return rc;
}

static int index_del(lmdb_store *st, MDB_txn *txn, uint64_t expires, const void *name, size_t len)
{
    uint8_t kb[INDEX_KEY_LEN];
    index_key(kb, expires, name, len);
    MDB_val k = {INDEX_KEY_LEN, kb};
    int rc = mdb_del(txn, st->expiry, &k, NULL);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/* Decodes a stored record; copies the response only when want_response. */
static idem_code rec_decode(const MDB_val *v, idem_record *rec, bool want_response)
{
    rec_hdr h;
    if (v->mv_size < sizeof(h)) {
        return idem__err(IDEM_DATA_LOSS, "record truncated (%zu bytes)", v->mv_size);
    }
    memcpy(&h, v->mv_data, sizeof(h));
    if (h.magic != REC_MAGIC ||
        (h.state != IDEM_REC_IN_PROGRESS && h.state != IDEM_REC_COMPLETED)) {
        return idem__err(IDEM_DATA_LOSS, "record has unknown format %#x/%u", h.magic, h.state);
    }
    if (rec == NULL) {
        return IDEM_OK;
    }
    memset(rec, 0, sizeof(*rec));
    rec->state = (idem_record_state)h.state;
    memcpy(rec->fingerprint, h.fingerprint, sizeof(h.fingerprint));
    rec->owner = h.owner;
    rec->lease_until_ms = h.lease_until_ms;
    rec->first_at_ms = h.first_at_ms;
    rec->expires_ms = h.expires_ms;
    size_t n = h.state == IDEM_REC_COMPLETED ? v->mv_size - sizeof(h) : 0; /* else a token */
    rec->response_len = n; /* also without the copy: foreach reports the stored size */
    if (want_response && n > 0) {
        if ((rec->response = malloc(n)) == NULL) {
            return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
        }
        memcpy(rec->response, (const uint8_t *)v->mv_data + sizeof(h), n);
    }
    return IDEM_OK;
}

static int rec_put(lmdb_store *st, MDB_txn *txn, const rec_key *key, const rec_hdr *h,
                   const void *response, size_t len)
{
    MDB_val k = {key->len, (void *)key->bytes}, v = {sizeof(*h) + len, NULL};
    int rc = mdb_put(txn, st->records, &k, &v, MDB_RESERVE);
    if (rc == 0) {
        memcpy(v.mv_data, h, sizeof(*h));
        if (len > 0) {
            memcpy((uint8_t *)v.mv_data + sizeof(*h), response, len);
        }
    }
    return rc;
}

static idem_code txn_commit(MDB_txn *txn)
{
    int rc = mdb_txn_commit(txn);
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "commit");
}

static int read_begin(lmdb_store *st, MDB_txn **txn)
{
    pthread_mutex_lock(&st->rpool_mu);
    *txn = st->rpool_n > 0 ? st->rpool[--st->rpool_n] : NULL;
    pthread_mutex_unlock(&st->rpool_mu);
    if (*txn != NULL) {
        if (mdb_txn_renew(*txn) == 0) {
            return 0;
        }
        mdb_txn_abort(*txn);
    }
    return mdb_txn_begin(st->env, NULL, MDB_RDONLY, txn);
}

static void read_end(lmdb_store *st, MDB_txn *txn)
{
    mdb_txn_reset(txn);
    pthread_mutex_lock(&st->rpool_mu);
    if (st->rpool_n < READ_POOL) {
        st->rpool[st->rpool_n++] = txn;
        txn = NULL;
    }
    pthread_mutex_unlock(&st->rpool_mu);
    if (txn != NULL) {
        mdb_txn_abort(txn);
    }
}

idem_code idem_store_open_lmdb(idem_store **out, const char *dir, size_t map_size, unsigned flags)
{
    lmdb_store *st;
    MDB_txn *txn = NULL;
    int rc;
    bool ro = (flags & IDEM_STORE_READONLY) != 0;

    *out = NULL;
    if (dir == NULL || *dir == '\0') {
        return idem__err(IDEM_INVALID_ARGUMENT, "store directory not set");
    }
    if (!ro && mkdir(dir, 0700) != 0 && errno != EEXIST) {
        return idem__err(IDEM_UNAVAILABLE, "mkdir %s: %s", dir, strerror(errno));
    }
    if ((st = calloc(1, sizeof(*st))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    unsigned env_flags =
        MDB_NOTLS | (ro ? MDB_RDONLY : 0) | ((flags & IDEM_STORE_NOSYNC) ? MDB_NOSYNC : 0);
    if ((rc = mdb_env_create(&st->env)) != 0 ||
        (rc = mdb_env_set_maxdbs(st->env, IDEM_LMDB_MAX_DBS)) != 0 ||
        (rc = mdb_env_set_maxreaders(st->env, 512)) != 0 ||
        (rc = mdb_env_set_mapsize(st->env, map_size ? map_size : DEFAULT_MAP_SIZE)) != 0 ||
        (rc = mdb_env_open(st->env, dir, env_flags, 0600)) != 0) {
        idem_code c = idem__err(IDEM_UNAVAILABLE, "open LMDB store %s: %s", dir, mdb_strerror(rc));
        if (st->env != NULL) {
            mdb_env_close(st->env);
        }
        free(st);
        return c;
    }
    int dead;
    mdb_reader_check(st->env, &dead); /* clear reader slots of crashed processes */
    unsigned dbi_flags = ro ? 0 : MDB_CREATE;
    if ((rc = mdb_txn_begin(st->env, NULL, ro ? MDB_RDONLY : 0, &txn)) != 0) {
        goto fail;
    }
    if ((rc = mdb_dbi_open(txn, "records", dbi_flags, &st->records)) != 0 ||
        (rc = mdb_dbi_open(txn, "tokens", dbi_flags, &st->tokens)) != 0 ||
        (rc = mdb_dbi_open(txn, "expiry", dbi_flags, &st->expiry)) != 0) {
        mdb_txn_abort(txn);
        goto fail;
    }
    rc = mdb_dbi_open(txn, "meta", dbi_flags, &st->meta);
    st->has_meta = rc == 0;
    if (rc != 0 && !(ro && rc == MDB_NOTFOUND)) {
        mdb_txn_abort(txn);
        goto fail;
    }
    if ((rc = mdb_txn_commit(txn)) != 0) { /* commit frees txn even when it fails */
        goto fail;
    }
    idem__gc_init(&st->gc, st->env, !(flags & IDEM_STORE_NO_GROUP_COMMIT), GROUP_COMMIT_BATCH);
    pthread_mutex_init(&st->rpool_mu, NULL);
    pthread_mutex_init(&st->db_mu, NULL);
    st->base.ops = &lmdb_ops;
    *out = &st->base;
    return IDEM_OK;
fail:;
    idem_code c = lmdb_code(rc, "open databases");
    mdb_env_close(st->env);
    free(st);
    return c;
}

static void lmdb_close(idem_store *base)
{
    lmdb_store *st = (lmdb_store *)base;
    if (st != NULL) {
        for (size_t i = 0; i < st->rpool_n; i++) {
            mdb_txn_abort(st->rpool[i]);
        }
        pthread_mutex_destroy(&st->rpool_mu);
        pthread_mutex_destroy(&st->db_mu);
        idem__gc_fini(&st->gc);
        mdb_env_close(st->env);
        free(st);
    }
}

/* Consumes token inside txn: it must exist, be unexpired and be scoped to scope. */
static idem_code token_take(lmdb_store *st, MDB_txn *txn, const char *token, const char *scope,
                            uint64_t now_ms, uint64_t *expires_ms)
{
    size_t tl = strlen(token);
    if (tl == 0 || tl > IDEM_MAX_TOKEN) {
        return idem__err(IDEM_FAILED_PRECONDITION, "token unknown");
    }
    MDB_val k = {tl, (void *)token}, v;
    int rc = mdb_get(txn, st->tokens, &k, &v);
    if (rc == MDB_NOTFOUND) {
        return idem__err(IDEM_FAILED_PRECONDITION, "token unknown or already used");
    } else if (rc != 0) {
        return lmdb_code(rc, "token get");
    } else if (v.mv_size < sizeof(tok_hdr)) {
        return idem__err(IDEM_DATA_LOSS, "token record truncated");
    }
    tok_hdr h;
    memcpy(&h, v.mv_data, sizeof(h));
    const char *s = scope != NULL ? scope : "";
    size_t sl = v.mv_size - sizeof(h);
    if (sl != strlen(s) || memcmp((const uint8_t *)v.mv_data + sizeof(h), s, sl) != 0) {
        return idem__err(IDEM_PERMISSION_DENIED, "token was issued to another caller");
    }
    if (h.expires_ms <= now_ms) {
        return idem__err(IDEM_FAILED_PRECONDITION, "token expired");
    }
    if ((rc = mdb_del(txn, st->tokens, &k, NULL)) != 0 ||
        (rc = index_del(st, txn, h.expires_ms, token, tl)) != 0) {
        return lmdb_code(rc, "token delete");
    }
    *expires_ms = h.expires_ms;
    return IDEM_OK;
}

/* Stores token (scoped to scope) unless it exists; rc-style. */
static int token_store(lmdb_store *st, MDB_txn *txn, const char *token, size_t tl,
                       const char *scope, uint64_t expires_ms)
{
    size_t sl = strlen(scope);
    tok_hdr h = {.expires_ms = expires_ms};
    MDB_val k = {tl, (void *)token}, v = {sizeof(h) + sl, NULL};
    int rc = mdb_put(txn, st->tokens, &k, &v, MDB_RESERVE | MDB_NOOVERWRITE);
    if (rc == 0) {
        memcpy(v.mv_data, &h, sizeof(h));
        memcpy((uint8_t *)v.mv_data + sizeof(h), scope, sl);
        rc = index_put(st, txn, expires_ms, TYPE_TOKEN, token, tl);
    }
    return rc;
}

/* The token an IN_PROGRESS record keeps: be64 expiry ‖ token. */
typedef struct rec_token {
    uint8_t bytes[8 + IDEM_MAX_TOKEN];
    size_t len; /* 0: none */
} rec_token;

static void rec_token_make(rec_token *t, const char *token, uint64_t expires_ms)
{
    size_t tl = strlen(token);
    for (int i = 0; i < 8; i++) {
        t->bytes[i] = (uint8_t)(expires_ms >> (56 - 8 * i));
    }
    memcpy(t->bytes + 8, token, tl);
    t->len = 8 + tl;
}

/* Copies the token tail of a stored IN_PROGRESS record (none for v1 records). */
static void rec_token_read(rec_token *t, const MDB_val *v)
{
    size_t n = v->mv_size - sizeof(rec_hdr);
    t->len = n > 8 && n <= sizeof(t->bytes) ? n : 0;
    memcpy(t->bytes, (const uint8_t *)v->mv_data + sizeof(rec_hdr), t->len);
}

static bool rec_token_is(const rec_token *t, const char *token)
{
    size_t tl = strlen(token);
    return t->len == 8 + tl && memcmp(t->bytes + 8, token, tl) == 0;
}

/* Puts a kept token back (a released claim had consumed it); rc-style. */
static int rec_token_restore(lmdb_store *st, MDB_txn *txn, const rec_key *key, const rec_token *t)
{
    if (t->len == 0) {
        return 0;
    }
    uint64_t expires = 0;
    for (int i = 0; i < 8; i++) {
        expires = expires << 8 | t->bytes[i];
    }
    int rc = token_store(st, txn, (const char *)t->bytes + 8, t->len - 8,
                         (const char *)key->bytes, expires); /* the caller leads the key */
    return rc == MDB_KEYEXIST ? 0 : rc;
}

/* The next store-assigned owner: a counter that only grows, in the claim's txn. */
static idem_code next_fence(lmdb_store *st, MDB_txn *txn, uint64_t *out)
{
    MDB_val k = {5, "fence"}, v;
    uint8_t b[8];
    uint64_t last = 0;
    if (!st->has_meta) {
        return idem__err(IDEM_FAILED_PRECONDITION, "store opened read-only");
    }
    int rc = mdb_get(txn, st->meta, &k, &v);
    if (rc == 0 && v.mv_size == 8) {
        for (int i = 0; i < 8; i++) {
            last = last << 8 | ((const uint8_t *)v.mv_data)[i];
        }
    } else if (rc != 0 && rc != MDB_NOTFOUND) {
        return lmdb_code(rc, "fence get");
    }
    *out = last + 1;
    for (int i = 0; i < 8; i++) {
        b[i] = (uint8_t)(*out >> (56 - 8 * i));
    }
    v = (MDB_val){8, b};
    rc = mdb_put(txn, st->meta, &k, &v, 0);
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "fence put");
}

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
    if (old != NULL && (rc = index_del(st, txn, old->expires_ms, key->bytes, key->len)) != 0) {
        return rc;
    }
    if ((rc = rec_put(st, txn, key, &h, tok->bytes, tok->len)) != 0) {
        return rc;
    }
    return index_put(st, txn, h.expires_ms, TYPE_RECORD, key->bytes, key->len);
}

typedef struct claim_ctx {
    lmdb_store *st;
    const idem_claim_req *req;
    const rec_key *key;
    idem_claim_outcome *outcome;
    idem_record *rec; /* may be NULL */
} claim_ctx;

/* Sets the outcome of a claim that acquired (or took over) the record. */
static void claim_acquired(const claim_ctx *c, bool took_over, uint64_t owner)
{
    *c->outcome = took_over ? IDEM_CLAIM_TAKEN_OVER : IDEM_CLAIM_ACQUIRED;
    if (c->rec != NULL) {
        c->rec->state = IDEM_REC_IN_PROGRESS;
        c->rec->owner = owner;
        c->rec->first_at_ms = c->req->now_ms;
        c->rec->lease_until_ms = c->req->lease_until_ms;
        c->rec->expires_ms = c->req->expires_ms;
        memcpy(c->rec->fingerprint, c->req->fingerprint, IDEM_FINGERPRINT_LEN);
    }
}

static idem_code claim_apply(MDB_txn *txn, void *arg)
{
    const claim_ctx *c = arg;
    const idem_claim_req *req = c->req;
    MDB_val k = {c->key->len, (void *)c->key->bytes}, v;
    rec_hdr old;
    rec_token tok = {.len = 0};
    bool have_old = false;
    uint64_t owner = req->owner;
    idem_code code;
    int rc;

    if (c->rec != NULL) { /* this may be a re-run after a failed batch */
        idem_record_clear(c->rec);
        memset(c->rec, 0, sizeof(*c->rec));
    }
    rc = mdb_get(txn, c->st->records, &k, &v);
    if (rc != 0 && rc != MDB_NOTFOUND) {
        return lmdb_code(rc, "claim get");
    }
    if (rc == 0) {
        if ((code = rec_decode(&v, NULL, false)) != IDEM_OK) {
            return code;
        }
        memcpy(&old, v.mv_data, sizeof(old));
        have_old = true;
        if (old.state == IDEM_REC_IN_PROGRESS) {
            rec_token_read(&tok, &v); /* a takeover inherits the consumed token */
        }
        bool expired = old.state == IDEM_REC_COMPLETED && old.expires_ms <= req->now_ms;
        if (!expired) {
            if (memcmp(old.fingerprint, req->fingerprint, IDEM_FINGERPRINT_LEN) != 0) {
                *c->outcome = IDEM_CLAIM_MISMATCH;
                return c->rec != NULL ? rec_decode(&v, c->rec, false) : IDEM_OK;
            }
            if (old.state == IDEM_REC_COMPLETED || old.lease_until_ms > req->now_ms) {
                *c->outcome =
                    old.state == IDEM_REC_COMPLETED ? IDEM_CLAIM_COMPLETED : IDEM_CLAIM_IN_PROGRESS;
                return c->rec != NULL ? rec_decode(&v, c->rec, true) : IDEM_OK;
            }
            /* IN_PROGRESS with an expired lease: the owner crashed or hung. */
        }
    }
    bool took_over = have_old && old.state == IDEM_REC_IN_PROGRESS;
    /* A takeover re-runs the same call: the token it kept is the one it needs. Any other
     * token must be valid, and is consumed. */
    if (req->token != NULL && !(took_over && rec_token_is(&tok, req->token))) {
        uint64_t tok_expires;
        if ((code = token_take(c->st, txn, req->token, req->key.caller, req->now_ms,
                               &tok_expires)) != IDEM_OK) {
            return code;
        }
        rec_token_make(&tok, req->token, tok_expires);
    }
    if (owner == 0 && (code = next_fence(c->st, txn, &owner)) != IDEM_OK) {
        return code;
    }
    if ((rc = claim_write(c->st, txn, c->key, req, owner, have_old ? &old : NULL, &tok)) != 0) {
        return lmdb_code(rc, "claim put");
    }
    claim_acquired(c, took_over, owner);
    return IDEM_OK;
}

static idem_code lmdb_claim(idem_store *base, const idem_claim_req *req,
                            idem_claim_outcome *outcome, idem_record *rec)
{
    lmdb_store *st = (lmdb_store *)base;
    rec_key key;
    idem_code code = rec_key_make(&key, &req->key);
    if (code != IDEM_OK) {
        return code;
    }
    claim_ctx c = {st, req, &key, outcome, rec};
    return lmdb_write(st, claim_apply, &c);
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
        return lmdb_code(rc, "get");
    }
    idem_code code = rec_decode(&v, NULL, false);
    if (code != IDEM_OK) {
        return code;
    }
    memcpy(h, v.mv_data, sizeof(*h));
    if (h->state != IDEM_REC_IN_PROGRESS || h->owner != owner) {
        return idem__err(IDEM_ABORTED, "claim lost: lease expired and taken over");
    }
    if (tok != NULL) {
        rec_token_read(tok, &v);
    }
    return IDEM_OK;
}

static idem_code store_complete_txn(lmdb_store *st, MDB_txn *txn, const idem_key_ref *ref,
                                    uint64_t owner, const void *response, size_t len,
                                    uint64_t expires_ms)
{
    rec_key key;
    rec_hdr h;
    idem_code code;
    int rc;
    if ((code = rec_key_make(&key, ref)) != IDEM_OK ||
        (code = owned_get(st, txn, &key, owner, &h, NULL)) != IDEM_OK) {
        return code;
    }
    if ((rc = index_del(st, txn, h.expires_ms, key.bytes, key.len)) != 0) {
        return lmdb_code(rc, "complete index");
    }
    h.state = IDEM_REC_COMPLETED;
    h.expires_ms = expires_ms;
    if ((rc = rec_put(st, txn, &key, &h, response, len)) != 0 ||
        (rc = index_put(st, txn, expires_ms, TYPE_RECORD, key.bytes, key.len)) != 0) {
        return lmdb_code(rc, "complete put");
    }
    return IDEM_OK;
}

/* The arguments of one record or token write, for the group committer. */
typedef struct write_args {
    lmdb_store *st;
    const idem_key_ref *ref;
    rec_key key;
    uint64_t owner;
    const void *response;
    size_t len;
    uint64_t ms; /* expiry, lease end, or now for a token consume */
    const char *token, *scope;
} write_args;

static idem_code complete_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    return store_complete_txn(w->st, txn, w->ref, w->owner, w->response, w->len, w->ms);
}

static idem_code lmdb_complete(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                               const void *response, size_t len, uint64_t expires_ms,
                               uint64_t now_ms)
{
    (void)now_ms; /* LMDB keeps the caller's absolute times */
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {
        .st = st, .ref = ref, .owner = owner, .response = response, .len = len, .ms = expires_ms};
    return lmdb_write(st, complete_apply, &w);
}

/* Deletes the record at key and its index entry; rc-style. */
static int rec_delete(lmdb_store *st, MDB_txn *txn, const rec_key *key, uint64_t expires_ms)
{
    MDB_val k = {key->len, (void *)key->bytes};
    int rc = mdb_del(txn, st->records, &k, NULL);
    return rc != 0 ? rc : index_del(st, txn, expires_ms, key->bytes, key->len);
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
    int rc = rec_delete(w->st, txn, &w->key, h.expires_ms);
    if (rc == 0) {
        rc = rec_token_restore(w->st, txn, &w->key, &tok);
    }
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "release delete");
}

static idem_code renew_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    rec_hdr h;
    rec_token tok;
    idem_code code = owned_get(w->st, txn, &w->key, w->owner, &h, &tok);
    if (code != IDEM_OK) {
        return code;
    }
    int rc = 0;
    if (h.expires_ms < w->ms) { /* the sweep must not take a record that is still leased */
        if ((rc = index_del(w->st, txn, h.expires_ms, w->key.bytes, w->key.len)) == 0) {
            h.expires_ms = w->ms;
            rc = index_put(w->st, txn, h.expires_ms, TYPE_RECORD, w->key.bytes, w->key.len);
        }
    }
    h.lease_until_ms = w->ms;
    if (rc == 0) {
        rc = rec_put(w->st, txn, &w->key, &h, tok.bytes, tok.len);
    }
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "renew");
}

static idem_code lmdb_renew(idem_store *base, const idem_key_ref *ref, uint64_t owner,
                            uint64_t lease_until_ms, uint64_t now_ms)
{
    (void)now_ms;
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st, .owner = owner, .ms = lease_until_ms};
    idem_code code = rec_key_make(&w.key, ref);
    return code != IDEM_OK ? code : lmdb_write(st, renew_apply, &w);
}

static idem_code lmdb_release(idem_store *base, const idem_key_ref *ref, uint64_t owner)
{
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st, .owner = owner};
    idem_code code = rec_key_make(&w.key, ref);
    return code != IDEM_OK ? code : lmdb_write(st, release_apply, &w);
}

static idem_code lmdb_get(idem_store *base, const idem_key_ref *ref, idem_record *rec)
{
    lmdb_store *st = (lmdb_store *)base;
    rec_key key;
    MDB_txn *txn;
    MDB_val k, v;
    idem_code code;
    int rc;
    if ((code = rec_key_make(&key, ref)) != IDEM_OK) {
        return code;
    }
    if ((rc = read_begin(st, &txn)) != 0) {
        return lmdb_code(rc, "get begin");
    }
    k = (MDB_val){key.len, key.bytes};
    rc = mdb_get(txn, st->records, &k, &v);
    if (rc == MDB_NOTFOUND) {
        code = idem__err(IDEM_NOT_FOUND, "no record");
    } else if (rc != 0) {
        code = lmdb_code(rc, "get");
    } else {
        code = rec_decode(&v, rec, true);
    }
    read_end(st, txn);
    return code;
}

static idem_code delete_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    MDB_val k = {w->key.len, (void *)w->key.bytes}, v;
    rec_hdr h;
    idem_code code;
    int rc = mdb_get(txn, w->st->records, &k, &v);
    if (rc == MDB_NOTFOUND) {
        return idem__err(IDEM_NOT_FOUND, "no record");
    } else if (rc != 0) {
        return lmdb_code(rc, "delete get");
    } else if ((code = rec_decode(&v, NULL, false)) != IDEM_OK) {
        return code;
    }
    memcpy(&h, v.mv_data, sizeof(h));
    rc = rec_delete(w->st, txn, &w->key, h.expires_ms);
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "delete");
}

static idem_code lmdb_delete(idem_store *base, const idem_key_ref *ref)
{
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st};
    idem_code code = rec_key_make(&w.key, ref);
    return code != IDEM_OK ? code : lmdb_write(st, delete_apply, &w);
}

/* Deletes what one expiry entry points at; the cursor stays on the entry. */
static int sweep_one(lmdb_store *st, MDB_txn *txn, const MDB_val *iv)
{
    const uint8_t *p = iv->mv_data;
    if (iv->mv_size < 2) {
        return 0; /* malformed entry: dropping it below is all we can do */
    }
    MDB_val k = {iv->mv_size - 1, (void *)(p + 1)};
    MDB_dbi dbi = p[0] == TYPE_TOKEN ? st->tokens : st->records;
    int rc = mdb_del(txn, dbi, &k, NULL);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

static idem_code lmdb_sweep(idem_store *base, uint64_t now_ms, size_t max, size_t *deleted)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val ik, iv;
    size_t n = 0;
    int rc;

    *deleted = 0;
    if ((rc = mdb_txn_begin(st->env, NULL, 0, &txn)) != 0) {
        return lmdb_code(rc, "sweep begin");
    }
    if ((rc = mdb_cursor_open(txn, st->expiry, &cur)) != 0) {
        mdb_txn_abort(txn);
        return lmdb_code(rc, "sweep cursor");
    }
    for (rc = mdb_cursor_get(cur, &ik, &iv, MDB_FIRST); rc == 0 && n < max;
         rc = mdb_cursor_get(cur, &ik, &iv, MDB_NEXT)) {
        uint64_t exp = 0;
        for (size_t i = 0; i < 8 && i < ik.mv_size; i++) {
            exp = exp << 8 | ((const uint8_t *)ik.mv_data)[i];
        }
        if (exp > now_ms) {
            break; /* the index is ordered by expiry: nothing further is due */
        }
        if ((rc = sweep_one(st, txn, &iv)) != 0 || (rc = mdb_cursor_del(cur, 0)) != 0) {
            break;
        }
        n++;
    }
    mdb_cursor_close(cur);
    if (rc != 0 && rc != MDB_NOTFOUND) {
        mdb_txn_abort(txn);
        return lmdb_code(rc, "sweep");
    }
    idem_code code = txn_commit(txn);
    if (code == IDEM_OK) {
        *deleted = n;
    }
    return code;
}

static idem_code token_put_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    int rc = token_store(w->st, txn, w->token, strlen(w->token), w->scope, w->ms);
    if (rc == MDB_KEYEXIST) {
        return idem__err(IDEM_ALREADY_EXISTS, "token exists");
    }
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "token put");
}

static idem_code lmdb_token_put(idem_store *base, const char *token, const char *scope,
                                uint64_t expires_ms, uint64_t now_ms)
{
    (void)now_ms;
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st, .token = token, .scope = scope, .ms = expires_ms};
    return lmdb_write(st, token_put_apply, &w);
}

static idem_code token_consume_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    uint64_t expires;
    return token_take(w->st, txn, w->token, w->scope, w->ms, &expires);
}

static idem_code lmdb_token_consume(idem_store *base, const char *token, const char *scope,
                                    uint64_t now_ms)
{
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st, .token = token, .scope = scope, .ms = now_ms};
    return lmdb_write(st, token_consume_apply, &w);
}

/* Splits stored key bytes caller \0 method \0 key into three C strings. */
static bool rec_key_split(const MDB_val *k, char *buf, idem_key_ref *ref)
{
    if (k->mv_size > sizeof(((rec_key *)0)->bytes)) {
        return false;
    }
    memcpy(buf, k->mv_data, k->mv_size);
    buf[k->mv_size] = '\0';
    char *m = memchr(buf, 0, k->mv_size);
    char *key = m != NULL ? memchr(m + 1, 0, k->mv_size - (size_t)(m + 1 - buf)) : NULL;
    if (key == NULL) {
        return false;
    }
    *ref = (idem_key_ref){buf, m + 1, key + 1};
    return true;
}

static idem_code lmdb_foreach(idem_store *base, idem_store_visit_fn fn, void *arg)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val k, v;
    char buf[sizeof(((rec_key *)0)->bytes) + 1];
    idem_code code = IDEM_OK;
    int rc;
    if ((rc = read_begin(st, &txn)) != 0) {
        return lmdb_code(rc, "foreach begin");
    }
    if ((rc = mdb_cursor_open(txn, st->records, &cur)) != 0) {
        read_end(st, txn);
        return lmdb_code(rc, "foreach cursor");
    }
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == 0;
         rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        idem_key_ref ref;
        idem_record rec;
        if (!rec_key_split(&k, buf, &ref) || rec_decode(&v, &rec, false) != IDEM_OK) {
            continue; /* not ours to interpret; the operator tool skips it */
        }
        if (!fn(arg, &ref, &rec)) {
            break;
        }
    }
    if (rc != 0 && rc != MDB_NOTFOUND) {
        code = lmdb_code(rc, "foreach");
    }
    mdb_cursor_close(cur);
    read_end(st, txn);
    return code;
}

static idem_code lmdb_stats_get(idem_store *base, idem_store_stats *out)
{
    lmdb_store *st = (lmdb_store *)base;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val k, v;
    MDB_stat ms;
    MDB_envinfo info;
    int rc;

    memset(out, 0, sizeof(*out));
    if ((rc = mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn)) != 0) {
        return lmdb_code(rc, "stats begin");
    }
    if ((rc = mdb_stat(txn, st->tokens, &ms)) != 0 ||
        (rc = mdb_cursor_open(txn, st->records, &cur)) != 0) {
        mdb_txn_abort(txn);
        return lmdb_code(rc, "stats");
    }
    out->tokens = ms.ms_entries;
    while ((rc = mdb_cursor_get(cur, &k, &v, out->records ? MDB_NEXT : MDB_FIRST)) == 0) {
        out->records++;
        rec_hdr h;
        if (v.mv_size >= sizeof(h)) {
            memcpy(&h, v.mv_data, sizeof(h));
            out->in_progress += h.state == IDEM_REC_IN_PROGRESS;
            out->completed += h.state == IDEM_REC_COMPLETED;
        }
    }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    mdb_env_info(st->env, &info);
    mdb_env_stat(st->env, &ms);
    pthread_mutex_lock(&st->gc.mu);
    out->commits = st->gc.commits;
    out->writes = st->gc.writes;
    pthread_mutex_unlock(&st->gc.mu);
    out->map_size = info.me_mapsize;
    out->map_used = (info.me_last_pgno + 1) * (size_t)ms.ms_psize;
    return rc == MDB_NOTFOUND ? IDEM_OK : lmdb_code(rc, "stats scan");
}

/* ---- transactional handlers (txn.h) ---- */

/* Business databases ("app.<name>") of transactional handlers.
 *
 * LMDB forbids mdb_dbi_open in concurrent txns, and a handle opened in a txn that aborts
 * dies with it. So handles are opened only in write txns (which LMDB serialises), and
 * enter the store's cache only once such a txn has committed; readers use the cache. */
#define TXN_NEW_DBS 8 /* databases one handler txn may create before it commits */

struct idem_txn {
    idem_txn_head head; /* first: store.c dispatches through it */
    lmdb_store *st;
    MDB_txn *txn;
    app_db opened[TXN_NEW_DBS]; /* opened here: cached if this txn commits */
    size_t n_opened;
};

static idem_code app_db_name(const char *db, char name[APP_DB_NAME])
{
    size_t n = db != NULL ? strlen(db) : 0;
    if (n == 0 || n > IDEM_MAX_DB_NAME) {
        return idem__err(IDEM_INVALID_ARGUMENT, "database name must be 1..%d bytes",
                         IDEM_MAX_DB_NAME);
    }
    snprintf(name, APP_DB_NAME, "app.%s", db);
    return IDEM_OK;
}

static bool app_db_cached(lmdb_store *st, const char *name, MDB_dbi *dbi)
{
    bool found = false;
    pthread_mutex_lock(&st->db_mu);
    for (size_t i = 0; i < st->n_dbs && !found; i++) {
        if (strcmp(st->dbs[i].name, name) == 0) {
            *dbi = st->dbs[i].dbi;
            found = true;
        }
    }
    pthread_mutex_unlock(&st->db_mu);
    return found;
}

static void app_db_cache(lmdb_store *st, const app_db *db)
{
    MDB_dbi ignored;
    if (app_db_cached(st, db->name, &ignored)) {
        return;
    }
    pthread_mutex_lock(&st->db_mu);
    if (st->n_dbs < IDEM_ARRAY_LEN(st->dbs)) {
        st->dbs[st->n_dbs++] = *db;
    }
    pthread_mutex_unlock(&st->db_mu);
}

/* The handle of a business database inside a handler's write txn. */
static idem_code txn_dbi(idem_txn *t, const char *db, MDB_dbi *dbi)
{
    char name[APP_DB_NAME];
    idem_code code = app_db_name(db, name);
    if (code != IDEM_OK || app_db_cached(t->st, name, dbi)) {
        return code;
    }
    for (size_t i = 0; i < t->n_opened; i++) {
        if (strcmp(t->opened[i].name, name) == 0) {
            *dbi = t->opened[i].dbi;
            return IDEM_OK;
        }
    }
    if (t->n_opened == TXN_NEW_DBS) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d new databases per transaction",
                         TXN_NEW_DBS);
    }
    int rc = mdb_dbi_open(t->txn, name, MDB_CREATE, dbi);
    if (rc != 0) {
        return lmdb_code(rc, "open database");
    }
    app_db *o = &t->opened[t->n_opened++];
    snprintf(o->name, sizeof(o->name), "%s", name);
    o->dbi = *dbi;
    return IDEM_OK;
}

typedef struct dbi_open_args {
    lmdb_store *st;
    app_db db;
} dbi_open_args;

static idem_code dbi_open_apply(MDB_txn *txn, void *arg)
{
    dbi_open_args *a = arg;
    int rc = mdb_dbi_open(txn, a->db.name, MDB_CREATE, &a->db.dbi);
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "open database");
}

/* The handle of a business database for a reader: created by a write of its own. */
static idem_code store_dbi(lmdb_store *st, const char *db, MDB_dbi *dbi)
{
    dbi_open_args a = {.st = st};
    idem_code code = app_db_name(db, a.db.name);
    if (code != IDEM_OK || app_db_cached(st, a.db.name, dbi)) {
        return code;
    }
    if ((code = lmdb_write(st, dbi_open_apply, &a)) != IDEM_OK) {
        return code;
    }
    app_db_cache(st, &a.db);
    *dbi = a.db.dbi;
    return IDEM_OK;
}

static idem_code lmdb_txn_begin(idem_store *base, idem_txn **out)
{
    lmdb_store *st = (lmdb_store *)base;
    if (thread_write_txn != NULL) {
        return nested_write();
    }
    idem_txn *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    int rc = mdb_txn_begin(st->env, NULL, 0, &t->txn);
    if (rc != 0) {
        free(t);
        return lmdb_code(rc, "handler txn begin");
    }
    t->head.ops = &lmdb_ops;
    t->st = st;
    thread_write_txn = t;
    *out = t;
    return IDEM_OK;
}

static void lmdb_txn_abort(idem_txn *t)
{
    thread_write_txn = NULL;
    mdb_txn_abort(t->txn);
    free(t);
}

static idem_code lmdb_txn_commit(idem_txn *t)
{
    thread_write_txn = NULL;
    idem_code code = txn_commit(t->txn);
    for (size_t i = 0; code == IDEM_OK && i < t->n_opened; i++) {
        app_db_cache(t->st, &t->opened[i]);
    }
    free(t);
    return code;
}

static idem_code lmdb_txn_complete_commit(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                          const void *response, size_t len, uint64_t expires_ms)
{
    idem_code code = store_complete_txn(t->st, t->txn, ref, owner, response, len, expires_ms);
    if (code != IDEM_OK) {
        lmdb_txn_abort(t);
        return code;
    }
    return lmdb_txn_commit(t);
}

static idem_code app_key(const void *key, size_t klen, MDB_val *k)
{
    if (klen == 0 || klen > 511) {
        return idem__err(IDEM_INVALID_ARGUMENT, "key must be 1..511 bytes");
    }
    *k = (MDB_val){klen, (void *)key};
    return IDEM_OK;
}

idem_code idem_txn_get(idem_txn *t, const char *db, const void *key, size_t klen, const void **val,
                       size_t *vlen)
{
    MDB_dbi dbi;
    MDB_val k, v;
    idem_code code;
    if ((code = app_key(key, klen, &k)) != IDEM_OK || (code = txn_dbi(t, db, &dbi)) != IDEM_OK) {
        return code;
    }
    int rc = mdb_get(t->txn, dbi, &k, &v);
    if (rc == MDB_NOTFOUND) {
        return idem__err(IDEM_NOT_FOUND, "no such key");
    } else if (rc != 0) {
        return lmdb_code(rc, "get");
    }
    *val = v.mv_data;
    *vlen = v.mv_size;
    return IDEM_OK;
}

idem_code idem_txn_put(idem_txn *t, const char *db, const void *key, size_t klen, const void *val,
                       size_t vlen)
{
    MDB_dbi dbi;
    MDB_val k, v = {vlen, (void *)val};
    idem_code code;
    if ((code = app_key(key, klen, &k)) != IDEM_OK || (code = txn_dbi(t, db, &dbi)) != IDEM_OK) {
        return code;
    }
    int rc = mdb_put(t->txn, dbi, &k, &v, 0);
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "put");
}

idem_code idem_txn_del(idem_txn *t, const char *db, const void *key, size_t klen)
{
    MDB_dbi dbi;
    MDB_val k;
    idem_code code;
    if ((code = app_key(key, klen, &k)) != IDEM_OK || (code = txn_dbi(t, db, &dbi)) != IDEM_OK) {
        return code;
    }
    int rc = mdb_del(t->txn, dbi, &k, NULL);
    if (rc == MDB_NOTFOUND) {
        return idem__err(IDEM_NOT_FOUND, "no such key");
    }
    return rc == 0 ? IDEM_OK : lmdb_code(rc, "del");
}

idem_code idem_store_app_get(idem_store *base, const char *db, const void *key, size_t klen,
                             void **val, size_t *vlen)
{
    lmdb_store *st = lmdb_of(base);
    if (st == NULL) {
        return idem__err(IDEM_UNIMPLEMENTED, "business databases need the LMDB store");
    }
    MDB_txn *txn;
    MDB_dbi dbi;
    MDB_val k, v;
    idem_code code;
    int rc;
    *val = NULL;
    *vlen = 0;
    if ((code = app_key(key, klen, &k)) != IDEM_OK || (code = store_dbi(st, db, &dbi)) != IDEM_OK) {
        return code;
    }
    if ((rc = read_begin(st, &txn)) != 0) {
        return lmdb_code(rc, "read begin");
    }
    rc = mdb_get(txn, dbi, &k, &v);
    if (rc == MDB_NOTFOUND) {
        code = idem__err(IDEM_NOT_FOUND, "no such key");
    } else if (rc != 0) {
        code = lmdb_code(rc, "get");
    } else if ((*val = malloc(v.mv_size ? v.mv_size : 1)) == NULL) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        memcpy(*val, v.mv_data, v.mv_size);
        *vlen = v.mv_size;
    }
    read_end(st, txn);
    return code;
}

static const idem_store_ops lmdb_ops = {
    .name = "lmdb",
    .caps = IDEM__STORE_CAP_TXN | IDEM__STORE_CAP_NONBLOCKING_READ,
    .claim = lmdb_claim,
    .complete = lmdb_complete,
    .release = lmdb_release,
    .renew = lmdb_renew,
    .get = lmdb_get,
    .del = lmdb_delete,
    .sweep = lmdb_sweep,
    .token_put = lmdb_token_put,
    .token_consume = lmdb_token_consume,
    .stats = lmdb_stats_get,
    .foreach = lmdb_foreach,
    .close = lmdb_close,
    .txn_begin = lmdb_txn_begin,
    .txn_abort = lmdb_txn_abort,
    .txn_commit = lmdb_txn_commit,
    .txn_complete_commit = lmdb_txn_complete_commit,
};

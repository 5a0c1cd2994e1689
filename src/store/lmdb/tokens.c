/* Tokens: put, take (consume inside a claim's txn) and consume; and the token an
 * IN_PROGRESS record keeps so that a release can put it back. */
#include <string.h>

#include "lmdb_internal.h"

typedef struct tok_hdr {
    uint64_t expires_ms;
} tok_hdr;

/* Reads token's expiry in txn into *h: it must exist, be unexpired and be scoped to scope. */
static idem_code token_find(lmdb_store *st, MDB_txn *txn, const char *token, const char *scope,
                            uint64_t now_ms, tok_hdr *h)
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
        return idem__lmdb_code(rc, "token get");
    } else if (v.mv_size < sizeof(tok_hdr)) {
        return idem__err(IDEM_DATA_LOSS, "token record truncated");
    }
    memcpy(h, v.mv_data, sizeof(*h));
    const char *s = scope != NULL ? scope : "";
    size_t sl = v.mv_size - sizeof(*h);
    if (sl != strlen(s) || memcmp((const uint8_t *)v.mv_data + sizeof(*h), s, sl) != 0) {
        return idem__err(IDEM_PERMISSION_DENIED, "token was issued to another caller");
    }
    if (h->expires_ms <= now_ms) {
        return idem__err(IDEM_FAILED_PRECONDITION, "token expired");
    }
    return IDEM_OK;
}

/* Consumes token inside txn: it must exist, be unexpired and be scoped to scope. */
idem_code idem__lmdb_token_take(lmdb_store *st, MDB_txn *txn, const char *token, const char *scope,
                                uint64_t now_ms, uint64_t *expires_ms)
{
    tok_hdr h;
    idem_code code = token_find(st, txn, token, scope, now_ms, &h);
    if (code != IDEM_OK) {
        return code;
    }
    size_t tl = strlen(token);
    MDB_val k = {tl, (void *)token};
    int rc;
    if ((rc = mdb_del(txn, st->tokens, &k, NULL)) != 0 ||
        (rc = idem__lmdb_index_del(st, txn, h.expires_ms, token, tl)) != 0) {
        return idem__lmdb_code(rc, "token delete");
    }
    *expires_ms = h.expires_ms;
    return IDEM_OK;
}

idem_code idem__lmdb_claim_token(lmdb_store *st, MDB_txn *txn, const idem_claim_req *req,
                                 bool took_over, rec_token *tok)
{
    if (req->token == NULL) {
        return IDEM_OK;
    }
    if (took_over && tok->len > 0) {
        tok_hdr h;
        return idem__lmdb_rec_token_is(tok, req->token)
                   ? IDEM_OK
                   : token_find(st, txn, req->token, req->key.caller, req->now_ms, &h);
    }
    uint64_t expires;
    idem_code code =
        idem__lmdb_token_take(st, txn, req->token, req->key.caller, req->now_ms, &expires);
    if (code == IDEM_OK) {
        idem__lmdb_rec_token_make(tok, req->token, expires);
    }
    return code;
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
        rc = idem__lmdb_index_put(st, txn, expires_ms, TYPE_TOKEN, token, tl);
    }
    return rc;
}

void idem__lmdb_rec_token_make(rec_token *t, const char *token, uint64_t expires_ms)
{
    size_t tl = strlen(token);
    idem__put_be64(t->bytes, expires_ms);
    memcpy(t->bytes + 8, token, tl);
    t->len = 8 + tl;
}

/* Copies the token tail of a stored IN_PROGRESS record (none for v1 records). */
void idem__lmdb_rec_token_read(rec_token *t, const MDB_val *v)
{
    size_t n = v->mv_size - sizeof(rec_hdr);
    t->len = n > 8 && n <= sizeof(t->bytes) ? n : 0;
    memcpy(t->bytes, (const uint8_t *)v->mv_data + sizeof(rec_hdr), t->len);
}

bool idem__lmdb_rec_token_is(const rec_token *t, const char *token)
{
    size_t tl = strlen(token);
    return t->len == 8 + tl && memcmp(t->bytes + 8, token, tl) == 0;
}

/* Puts a kept token back (a released claim had consumed it); rc-style. */
int idem__lmdb_rec_token_restore(lmdb_store *st, MDB_txn *txn, const rec_key *key,
                                 const rec_token *t)
{
    if (t->len == 0) {
        return 0;
    }
    int rc = token_store(st, txn, (const char *)t->bytes + 8, t->len - 8, (const char *)key->bytes,
                         idem__get_be64(t->bytes)); /* the caller leads the key */
    return rc == MDB_KEYEXIST ? 0 : rc;
}

static idem_code token_put_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    int rc = token_store(w->st, txn, w->token, strlen(w->token), w->scope, w->ms);
    if (rc == MDB_KEYEXIST) {
        return idem__err(IDEM_ALREADY_EXISTS, "token exists");
    }
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "token put");
}

idem_code idem__lmdb_token_put(idem_store *base, const char *token, const char *scope,
                               uint64_t expires_ms, uint64_t now_ms)
{
    (void)now_ms;
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st, .token = token, .scope = scope, .ms = expires_ms};
    return idem__lmdb_write(st, token_put_apply, &w);
}

static idem_code token_consume_apply(MDB_txn *txn, void *arg)
{
    const write_args *w = arg;
    uint64_t expires;
    return idem__lmdb_token_take(w->st, txn, w->token, w->scope, w->ms, &expires);
}

idem_code idem__lmdb_token_consume(idem_store *base, const char *token, const char *scope,
                                   uint64_t now_ms)
{
    lmdb_store *st = (lmdb_store *)base;
    write_args w = {.st = st, .token = token, .scope = scope, .ms = now_ms};
    return idem__lmdb_write(st, token_consume_apply, &w);
}

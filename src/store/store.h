/* The idem_store interface behind include/idemrpc/store.h: each backend (store_lmdb.c,
 * store_pg.c) fills one ops table and embeds idem_store as its first member. store.c
 * checks the arguments common to every backend and dispatches. */
#ifndef IDEMRPC_STORE_INTERNAL_H
#define IDEMRPC_STORE_INTERNAL_H

#include "internal.h"

typedef struct idem_store_ops {
    const char *name;
    idem_code (*claim)(idem_store *st, const idem_claim_req *req, idem_claim_outcome *outcome,
                       idem_record *rec);
    idem_code (*complete)(idem_store *st, const idem_key_ref *key, uint64_t owner,
                          const void *response, size_t len, uint64_t expires_ms, uint64_t now_ms);
    idem_code (*release)(idem_store *st, const idem_key_ref *key, uint64_t owner);
    idem_code (*renew)(idem_store *st, const idem_key_ref *key, uint64_t owner,
                       uint64_t lease_until_ms, uint64_t now_ms);
    idem_code (*get)(idem_store *st, const idem_key_ref *key, idem_record *rec);
    idem_code (*del)(idem_store *st, const idem_key_ref *key);
    idem_code (*sweep)(idem_store *st, uint64_t now_ms, size_t max, size_t *deleted);
    idem_code (*token_put)(idem_store *st, const char *token, const char *scope,
                           uint64_t expires_ms, uint64_t now_ms);
    idem_code (*token_consume)(idem_store *st, const char *token, const char *scope,
                               uint64_t now_ms);
    idem_code (*stats)(idem_store *st, idem_store_stats *out);
    idem_code (*foreach)(idem_store *st, idem_store_visit_fn fn, void *arg);
    void (*close)(idem_store *st);
} idem_store_ops;

struct idem_store {
    const idem_store_ops *ops;
};

/* The bounds every backend enforces on an effective key (IDEM_MAX_*). */
idem_code idem__key_check(const idem_key_ref *ref);

/* idem_store_complete and idem_store_token_put with the caller's clock: expires_ms -
 * now_ms is what PostgreSQL adds to its own clock. The public forms use this host's. */
idem_code idem__store_complete_at(idem_store *st, const idem_key_ref *key, uint64_t owner,
                                  const void *response, size_t len, uint64_t expires_ms,
                                  uint64_t now_ms);
idem_code idem__store_token_put_at(idem_store *st, const char *token, const char *scope,
                                   uint64_t expires_ms, uint64_t now_ms);

#endif

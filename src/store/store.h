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
};

/* Every backend's idem_txn starts with this, so that store.c finds the backend. */
typedef struct idem_txn_head {
    const struct idem_store_ops *ops;
} idem_txn_head;

typedef struct idem_store_ops {
    const char *name;
    unsigned caps; /* idem__store_caps */
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
    /* IDEM__STORE_CAP_TXN only (see idem__store_txn_* in internal.h). */
    idem_code (*txn_begin)(idem_store *st, idem_txn **out);
    void (*txn_abort)(idem_txn *t);
    idem_code (*txn_commit)(idem_txn *t);
    idem_code (*txn_complete_commit)(idem_txn *t, const idem_key_ref *ref, uint64_t owner,
                                     const void *response, size_t len, uint64_t expires_ms);
} idem_store_ops;

struct idem_store {
    const idem_store_ops *ops;
};

bool idem__store_has(const idem_store *st, unsigned cap);

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

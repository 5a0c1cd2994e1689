/* LMDB-specific limits of idem_store. */
#ifndef IDEMRPC_STORE_LMDB_H
#define IDEMRPC_STORE_LMDB_H

#define IDEM_LMDB_OWN_DBS 6 /* records, tokens, expiry, meta, tombs, tomb_buckets */
#define IDEM_LMDB_MAX_DBS (IDEM_LMDB_OWN_DBS + 29) /* named databases per env: 29 business (0.1) */

#include <stddef.h>
#include <stdint.h>

#include <idemrpc/store.h>

/* The benchmark's bulk load (load.c): n COMPLETED records, each a copy of tmpl (its
 * fingerprint, owner, times and response) under the key and expiry key_at gives for i.
 * key_at must give ascending effective keys (caller \0 method \0 key, bytewise) and
 * ascending expiries as i grows: both databases are appended to. every > 1: each
 * every-th record is put in a second pass instead, which leaves the leaves about 2/3
 * full as random inserts do (0 or 1: all appended, pages full). For a store no server
 * is using; IDEM_INVALID_ARGUMENT when the order is broken. */
typedef struct idem__lmdb_load_src {
    size_t n;
    size_t every;
    const idem_record *tmpl;
    void (*key_at)(void *arg, size_t i, idem_key_ref *ref, uint64_t *expires_ms);
    void *arg;
} idem__lmdb_load_src;
idem_code idem__lmdb_load(idem_store *st, const idem__lmdb_load_src *src);

#endif

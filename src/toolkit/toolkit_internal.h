/* Helpers shared by the toolkit's files (state_machine.c, versioned.c, consume.c, ...). */
#ifndef IDEMRPC_TOOLKIT_INTERNAL_H
#define IDEMRPC_TOOLKIT_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "internal.h"

#include "idemrpc/toolkit.h"

/* Length of s if it is 1..max bytes, else 0. */
static inline size_t idem__bounded_len(const char *s, size_t max)
{
    size_t n = s != NULL ? strnlen(s, max + 1) : 0;
    return n <= max ? n : 0;
}

/* The bounds of an append-only log in business database db (log_bounds.c): head, the
 * oldest entry that may still be there, and next, the next append's number; 0, 0 when
 * absent. _read: outside a txn. */
/* idem_consume_purge_group, for the purges of one owner only (a NATS stream: whose
 * retention the group's markers follow, recorded at the first purge): a purge by another
 * owner is FAILED_PRECONDITION. owner NULL: no check, and the recorded owner is forgotten
 * (the caller's cutoff takes over; the next owned purge records its owner). */
#define IDEM__CONSUME_MAX_OWNER 256 /* bytes */
idem_code idem__consume_purge_owned(idem_store *st, const char *group, const char *owner,
                                    uint64_t before_ms, size_t max, size_t *purged);

idem_code idem__log_bounds_get(idem_txn *t, const char *db, uint64_t *head, uint64_t *next);
idem_code idem__log_bounds_read(idem_store *st, const char *db, uint64_t *head, uint64_t *next);
idem_code idem__log_bounds_put(idem_txn *t, const char *db, uint64_t head, uint64_t next);
/* The same under one-byte key key instead of 'q' (a second log in db). */
idem_code idem__log_bounds_get_at(idem_txn *t, const char *db, uint8_t key, uint64_t *head,
                                  uint64_t *next);
idem_code idem__log_bounds_read_at(idem_store *st, const char *db, uint8_t key, uint64_t *head,
                                   uint64_t *next);
idem_code idem__log_bounds_put_at(idem_txn *t, const char *db, uint8_t key, uint64_t head,
                                  uint64_t next);

/* The outbox (outbox.c): the key of message seq ('m' ‖ be64 seq); _advance moves head
 * past the removed messages at the front (at most IDEM_OUTBOX_MAX_BATCH) and writes the
 * bounds row when it moved. */
#define IDEM__OUTBOX_KEY_LEN 9
void idem__outbox_msg_key(uint8_t k[IDEM__OUTBOX_KEY_LEN], uint64_t seq);
idem_code idem__outbox_advance(idem_txn *t, uint64_t head, uint64_t next);
/* In one write txn: moves the outbox's head past up to IDEM_OUTBOX_MAX_BATCH removed
 * slots; *moved: it moved. A relay whose peek found nothing though messages are pending
 * calls it: a restore (idem_outbox_kept_restore) moves head back across every slot
 * removed since, farther than a peek looks. */
idem_code idem__outbox_skip_removed(idem_store *st, bool *moved);
/* How many restores (idem_outbox_kept_restore) the store has seen ('R' in IDEM_OUTBOX_DB,
 * 0 when absent). A relay reads it before it peeks; _keep_since keeps its acks only when
 * no restore came since (else a restored row, whose ack came from a broker that may have
 * forgotten it since, would go back into the kept log under that stale ack: left in the
 * outbox instead, it is published again). restores UINT64_MAX: no such check. */
idem_code idem__outbox_restores(idem_store *st, uint64_t *n);
idem_code idem__outbox_keep_since(idem_store *st, const idem_outbox_ack *acks, size_t n,
                                  uint64_t now_ms, uint64_t restores);
/* Splits a stored message v[0..n) into out (data copied: idem_outbox_msgs_free). */
idem_code idem__outbox_msg_decode(const uint8_t *v, size_t n, uint64_t seq, idem_outbox_msg *out);
/* The msg_id of a stored message v[0..n) (nothing allocated). */
idem_code idem__outbox_msg_id(const uint8_t *v, size_t n, uint64_t seq,
                              char msg_id[IDEM_OUTBOX_MAX_MSG_ID + 1]);

/* The kept log's stream directory (outbox_kept_streams.c): per stream the relay published
 * to, the kept message of its highest sequence, so that a relay coming back to a broker
 * checks every stream, not only the one acked last. One record ('N' in IDEM_OUTBOX_DB)
 * of at most IDEM__KEPT_STREAMS entries; when full, the stream acked longest ago gives
 * way and the directory overflows.
 * An entry goes once everything kept from its stream expired (i < the kept log's head),
 * all of them once nothing is kept. */
#define IDEM__KEPT_STREAMS 64
typedef struct idem__kept_stream {
    uint64_t i;          /* its place in the kept log */
    idem_outbox_ack ack; /* the message: outbox seq, stream, stream_seq */
    char msg_id[IDEM_OUTBOX_MAX_MSG_ID + 1];
} idem__kept_stream;
typedef struct idem__kept_dir {
    size_t n;
    bool changed;
    bool present; /* the record was there when loaded or read */
    /* Some kept message may be in no entry (a stream gave way, a kept log of a release
     * before the directory, a record that did not decode): the relay cannot check them
     * one by one and publishes every kept message again at its next check. Cleared with
     * the directory, once nothing is kept. */
    bool overflow;
    idem__kept_stream s[IDEM__KEPT_STREAMS];
} idem__kept_dir;
idem_code idem__kept_dir_load(idem_txn *t, idem__kept_dir *d);
/* Outside a txn (the relay's check). */
idem_code idem__kept_dir_read(idem_store *st, idem__kept_dir *d);
/* Kept record i (its ack, its outbox bytes m[0..n)) joins its stream's entry: the entry
 * keeps the highest i (pruning) and the message of the highest stream sequence (two
 * relays may keep out of order). */
idem_code idem__kept_dir_note(idem__kept_dir *d, uint64_t i, const idem_outbox_ack *a,
                              const uint8_t *m, size_t n);
/* Entries whose messages all left the kept log [head, next): i < head (expired), and
 * every entry once the log is empty (all expired or restored). */
void idem__kept_dir_prune(idem__kept_dir *d, uint64_t head, uint64_t next);
/* Writes d back when it changed. */
idem_code idem__kept_dir_store(idem_txn *t, idem__kept_dir *d);

#endif

/* The write-ahead log's private layout, shared by wal.c (a batch's notes, its entry, the
 * log's thread, the wrap) and wal_open.c (open, replay, close). wal.h says what it is. */
#ifndef IDEMRPC_LMDB_WAL_PRIV_H
#define IDEMRPC_LMDB_WAL_PRIV_H

#include <pthread.h>
#include <sys/types.h>

#include "wal.h"

#define WAL_DBS 6
#define WAL_META 3                /* dbis[WAL_META]: the store's meta database (env.c) */
#define WAL_EPOCH_KEY "wal-epoch" /* in meta: the epoch of the log beside it, be64 */
#define WAL_HEAD 4096             /* the header block; entries follow */
#define WAL_ENTRY_HDR 24          /* be32 length ‖ be32 crc32 ‖ be64 epoch ‖ be64 txnid */
#define WAL_WRAP ((off_t)1 << 20) /* a new epoch once entries pass this */
#define WAL_SIZE (WAL_WRAP + ((off_t)1 << 20)) /* zeros written at creation */
#define WAL_MAGIC "idemwal1"
#define NOTE_SLOTS 4096 /* the dedupe table of a batch's notes (power of two) */

enum { REC_PUT = 1, REC_DEL = 2 };

typedef struct wal_note {
    uint8_t db; /* index in dbis */
    uint16_t klen;
    size_t koff; /* in keys */
} wal_note;

struct idem_wal {
    int fd;
    MDB_env *env;
    MDB_dbi dbis[WAL_DBS];
    uint64_t epoch;    /* 0 until this process started one (never drawn as 0) */
    off_t off;         /* where the next entry goes */
    bool off_for_good; /* a failure turned the log off */
    /* Built with -DIDEM_TEST_HOOKS (never by default) and $IDEMRPC_TEST_ANSWER_AT_COMMIT=1:
     * an entry is not flushed, so a batch is answered at its commit, its meta page not on
     * disk yet: the bug tests/test_power_cut.c must catch. */
    bool no_flush;
    /* A batch's notes (writer thread). */
    wal_note *notes;
    size_t n_notes, cap_notes;
    uint32_t slots[NOTE_SLOTS]; /* note index + 1; 0: empty */
    uint8_t *keys;
    size_t keys_len, keys_cap;
    bool unloggable;
    /* The entry being written: the writer thread fills buf while the log's thread is
     * idle, the log's thread writes and flushes it (busy), then sets rc. */
    uint8_t *buf;
    size_t len, cap;
    pthread_t thread;
    bool started, busy, stopping;
    int rc;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

uint32_t idem__wal_crc32(const uint8_t *p, size_t n);
/* Writes all of p at off (an errno; EIO when nothing could be written). */
int idem__wal_pwrite(int fd, const void *p, size_t n, off_t off);
/* Starts a new epoch: its id put in the store's meta in a txn that commit(txn, arg) commits
 * and syncs with every commit before it (0 or an LMDB rc; the txn is freed either way), so
 * that a replay applies the log only to the store that names its epoch; then a fresh
 * header, flushed; entries from WAL_HEAD. An LMDB rc or errno; on failure the store may
 * name the new epoch while the file's header does not. */
int idem__wal_new_epoch(idem_wal *w, int (*commit)(MDB_txn *txn, void *arg), void *arg);
/* The log's thread: writes and flushes each entry it is handed. */
void *idem__wal_thread(void *arg);

#endif

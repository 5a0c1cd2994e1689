/* The store's write-ahead log: a batch of group commit answered after ONE flush.
 *
 * Without it a batch's callers wait for two: its commit's fdatasync (its data pages),
 * then a later one that puts its meta page on disk (group_commit_pipe.c). With it, the
 * writer thread encodes the final state of every key the batch wrote (its value, or its
 * absence; every duplicate of a MDB_DUPSORT key) as one log entry before the commit,
 * hands it to the log's thread, which writes it to dir/wal.log and fdatasyncs it WHILE
 * LMDB's commit syncs data.mdb, and answers the batch once both are done. LMDB itself is
 * unchanged: durable with MDB_NOMETASYNC, its integrity LMDB's own, so a power cut leaves
 * it at some earlier commit R, whole; the log holds what came after.
 *
 * An entry names its LMDB txnid. Replay (at a read-write open, before any write) applies,
 * in order, the entries of the current epoch (below) with txnids R + 1, R + 2, ...: each
 * entry turns the state of txnid - 1 into the state of txnid, so only an unbroken chain
 * from R is applied, and it stops at the first gap, bad checksum or other epoch. A batch
 * is answered from its entry only when that chain holds at its answer: the commit before
 * it is on disk or logged (group_commit_pipe.c, idem__gc_pipe_committed). A commit the
 * log does not hold (a sweep, a handler txn, an inline write, another process's, a batch
 * the log cannot name) breaks the chain until it is on disk: those sync themselves
 * (idem__gc_commit_durable), and the next batch waits for the sync as without the log.
 *
 * An epoch belongs to one store: its id is committed to the store's meta (WAL_EPOCH_KEY)
 * and synced before a header names it, and a replay applies nothing when the store names
 * another, so a data.mdb put in the place of the one the log was written beside (a backup
 * of an earlier epoch, another store's file) takes no entry, however its txnids chain.
 *
 * The file: a 4096-byte header (magic, a random epoch, crc32) and entries after it,
 *   be32 length (of what follows the crc) ‖ be32 crc32 ‖ be64 epoch ‖ be64 txnid ‖ records,
 *   record: op ‖ db ‖ be16 key length ‖ be32 value length ‖ key ‖ value.
 * The file is written with zeros to WAL_SIZE when created, so that an entry overwrites
 * blocks it has (no size change to journal). Once past WAL_WRAP bytes, the writer syncs
 * LMDB (every entry so far is then on disk in data.mdb) and starts a new epoch: a new
 * header, flushed, entries from offset 4096 again, the file cut back to WAL_SIZE if a
 * batch larger than the wrap grew it; an entry left from an older epoch ends a replay.
 * The open replays, syncs LMDB and starts a new epoch.
 *
 * One log per store: the process that opens it takes an exclusive flock on wal.log; a
 * second process opening the same store (idemctl beside a server) finds it taken and
 * writes without a log, its batches waiting for LMDB's sync as before. The flock's
 * holder replayed the log at its open; after a crash the next read-write open replays
 * it, whatever its flags (IDEM_STORE_NO_LOG, NOSYNC, no group commit: a store last
 * written with the log). A read-only open replays nothing: until a read-write open has,
 * it may show a store a few batches behind what was answered.
 *
 * Failures: a log write or flush that fails, a batch commit or a wrap that fails, turns the log
 * off for the rest of the process (the batches then wait for LMDB's sync, as without
 * it); an entry whose flush failed was not answered from. The entry of a batch whose
 * commit failed, or that committed nothing, is voided (its header zeroed and flushed)
 * before anything else commits: its txnid is the next commit's. When that void fails
 * too (a disk failing twice), a crash before LMDB's next sync may apply the failed
 * batch's entry: its callers were answered with an error, whose outcome is unknown. */
#ifndef IDEMRPC_LMDB_WAL_H
#define IDEMRPC_LMDB_WAL_H

#include <lmdb.h>
#include <stdbool.h>
#include <stdint.h>

#include "internal.h"

typedef struct idem_wal idem_wal;

/* The log of the writer thread's open batch (NULL elsewhere): the wrappers of
 * group_commit.h note in it what the batch writes. */
extern _Thread_local idem_wal *idem__wal_cur;

/* At a read-write open, once the store's databases are open (dbis, in the log's
 * order: env.c) and before any other write to env: when dir/wal.log exists and no other
 * process holds its flock, takes it, replays the log (above), syncs env and starts a new
 * epoch; *out: the locked file (NULL: none, or another process's). A file that is not a
 * log is left as it is. */
idem_code idem__wal_replay(idem_wal **out, const char *dir, MDB_env *env, const MDB_dbi dbis[6]);
/* On a durable env with group commit: the log (*wal, from idem__wal_replay, or created
 * and locked now) written to WAL_SIZE, in a new epoch (the replay's, when it started
 * one), its thread started; *wal NULL when another process holds it, or when the store
 * is too full for the epoch's commit. */
idem_code idem__wal_start(idem_wal **wal, const char *dir, MDB_env *env, const MDB_dbi dbis[6]);
/* Syncs env, so that the log holds nothing a replay needs (an older release, which
 * does not replay it, may open the store next), and closes the log. */
void idem__wal_close(idem_wal *wal);

/* The writer thread: notes a batch's writes from here (idem__wal_cur = wal) ... */
void idem__wal_batch_begin(idem_wal *wal);
/* ... and, its ops applied, hands its entry to the log's thread: true when it is being
 * written (call idem__wal_batch_end after the commit), false when the batch cannot be
 * logged (the log is off, a write it cannot name, out of memory). */
bool idem__wal_batch_start(idem_wal *wal, MDB_txn *txn);
/* Waits for the entry's flush: true when it is on disk and stands for the commit.
 * committed: the batch's commit succeeded (else the log goes off: LMDB hands its txnid
 * out again); advanced: LMDB's last txnid is the entry's (a batch whose writes all failed
 * commits nothing). An entry that does not stand for its commit is voided on disk. */
bool idem__wal_batch_end(idem_wal *wal, bool committed, bool advanced);
/* The log is past WAL_WRAP: the writer thread, between batches, starts a new epoch, whose
 * commit (commit(txn, arg): committed and synced, every commit before it on disk, under
 * group commit's rules for a failed sync; 0 or an LMDB rc) puts every entry so far in
 * data.mdb. */
void idem__wal_wrap_due(idem_wal *wal, int (*commit)(MDB_txn *txn, void *arg), void *arg);
/* Whether the log is on (it goes off on a failure, for good). */
bool idem__wal_on(const idem_wal *wal);

/* The wrappers' notes: a key written or deleted in dbi; a write the log cannot hold. */
void idem__wal_note(MDB_dbi dbi, const MDB_val *key);
void idem__wal_note_cursor(MDB_cursor *cur);
void idem__wal_unloggable(void);

#endif

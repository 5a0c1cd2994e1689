/* A power cut for the programs that link power_cut.c: every write to the store's files
 * that no fdatasync/fsync has covered yet is undone, as a disk that loses its cache would,
 * or (keep-subset) a drawn subset of them survives, as a disk that wrote some of its
 * cache back, in any order.
 *
 * Recording (in the process writing the store): with $IDEMRPC_UNDO_LOG and
 * $IDEMRPC_UNDO_DATA (the data file's path) set, pwrite, pwrite64, write and writev on the
 * data file (data.mdb) or on wal.log in its directory first append one record: which
 * file, where, the bytes they overwrite, the bytes they write and the file's old size.
 * ftruncate and fallocate (mode 0: the size grows; KEEP_SIZE: nothing visible) on those
 * two files are recorded as a size change (with the bytes a shrink cuts off); any other
 * fallocate mode on them is logged as OTHER. An fdatasync/fsync of one of the two files
 * (through any descriptor) appends a mark for THAT file only: its writes logged before
 * the sync began are on disk. A write through an O_DSYNC descriptor is on disk when it
 * returns: not logged. Each record is one write(2) to the log, made before the data's:
 * a SIGKILL leaves it whole or absent.
 *
 * A failing disk (power_cut_plan, data.mdb's syncs only: wal.log's always succeed and do
 * not take a step): a sync of the data file may answer EIO, logged as a failed mark.
 * Linux may then have marked the pages that failed clean without writing them
 * ("fsyncgate"): the writes logged before that sync are lost, even when a later sync
 * succeeds, unless a later write to the same page is synced (the page is written again).
 *
 * The cut (in the test, after the SIGKILL or after closing the store):
 * power_cut_apply_keeping, per file, restores newest first the bytes of every write not
 * on disk (logged after the file's last mark, or lost to a failed sync), then the file's
 * size (a file created by its first unsynced write: back to 0): the synced image. Then it
 * re-applies, in their original order, the unsynced (not lost) writes its draw keeps.
 *
 * Every file the store writes: data.mdb and wal.log through these calls, and lock.mdb
 * through its map only (LMDB's reader table and writer mutex: nothing that must survive;
 * the first process to open the store after a cut holds it alone and rebuilds it, mdb.c
 * mdb_env_setup_locks and mdb_env_share_locks, whatever it holds: test_power_cut.c
 * leaves it, truncates it or fills it with noise). A write(), pwrite() or writev() to
 * any other file of the data file's directory is logged (POWER_CUT_OTHER), and the cut
 * refuses such a log (-1, errno ENOTSUP): a store that begins writing a new file fails
 * the test until the recorder covers it. */
#ifndef IDEMRPC_TEST_POWER_CUT_H
#define IDEMRPC_TEST_POWER_CUT_H

#include <stdint.h>

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

enum {
    POWER_CUT_WRITE = 0x57,
    POWER_CUT_SIZE = 0x5a, /* ftruncate, or an fallocate that grew the file */
    POWER_CUT_SYNC = 0x53,
    POWER_CUT_FAILED = 0x46,
    POWER_CUT_OTHER = 0x4f
};

/* The files a record names. */
enum { POWER_CUT_DATA = 0, POWER_CUT_WAL = 1, POWER_CUT_FILES = 2 };

/* One log record. A write's is followed by its pre-image (len bytes) then its new bytes
 * (new_len); a size change's by the bytes it cut off (len, from off); an other's (a write
 * to another file of the data file's directory, which the cut cannot undo) by that file's
 * path (len bytes). */
typedef struct undo_rec {
    uint64_t type;
    uint64_t file;     /* write, size, sync, failed: POWER_CUT_DATA or POWER_CUT_WAL */
    uint64_t off;      /* write: where; size: the new size; sync, failed: the log's size when
                          the sync began */
    uint64_t len;      /* bytes of pre-image that follow */
    uint64_t new_len;  /* write: bytes written, after the pre-image */
    uint64_t old_size; /* write, size: the file's size before it */
} undo_rec;

/* wal.log beside data (its directory's) into out. */
static inline void power_cut_wal_path(const char *data, char *out, size_t size)
{
    const char *slash = strrchr(data, '/');
    snprintf(out, size, "%.*swal.log", slash != NULL ? (int)(slash - data) + 1 : 0, data);
}

/* power_cut.c, in the recording process: records to log the writes to data and to
 * wal.log beside it (instead of $IDEMRPC_UNDO_LOG and $IDEMRPC_UNDO_DATA; before the store
 * is opened; log NULL: stops, as it must before the cut runs in this process). */
void power_cut_record(const char *log, const char *data);
/* The next syncs of data (data.mdb only), one character each (a static string): 'p'
 * succeeds, 'f' answers EIO; after the plan, every sync succeeds. */
void power_cut_plan(const char *plan);
/* The syncs of the plan not yet taken. */
size_t power_cut_plan_left(void);
/* Called (when set) on the syncing thread before each sync of data takes its step. */
extern void (*_Atomic power_cut_before_sync)(void);

/* power_cut_apply.c, linked by the test (power_cut.c, the recorder, by the server). */

/* Whether the cut keeps the nth (from 0, in log order) unsynced write of file. */
typedef bool power_cut_keep_fn(void *arg, int file, long nth);

/* What a cut did, per file: unsynced writes undone (lost to a failed sync included) and
 * unsynced writes kept. */
typedef struct power_cut_stats {
    long undone[POWER_CUT_FILES];
    long kept[POWER_CUT_FILES];
} power_cut_stats;

/* The cut of the writes log recorded to data and to wal.log beside it: every write not on
 * disk undone, then those keep (NULL: none) draws re-applied. 0 (*st filled), or -1 (errno
 * set) when a file cannot be read or written, or ENOTSUP when the log holds a write to
 * another file of the store (POWER_CUT_OTHER). */
int power_cut_apply_keeping(const char *log, const char *data, power_cut_keep_fn *keep, void *arg,
                            power_cut_stats *st);
/* Drop-all: power_cut_apply_keeping without keep; the number of writes undone, or -1. */
long power_cut_apply(const char *log, const char *data);
/* How many writes log has recorded since their file's last sync (a live server's log: a
 * record being written is not counted); -1 when it cannot be read. */
long power_cut_pending(const char *log);

#endif

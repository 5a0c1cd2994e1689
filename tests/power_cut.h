/* A power cut for the programs that link power_cut.c: every write to the LMDB data file
 * that no fdatasync/fsync has covered yet is undone, as a disk that loses its cache would.
 *
 * Recording (in the process writing the store): with $IDEMRPC_UNDO_LOG and
 * $IDEMRPC_UNDO_DATA (the data file's path) set, pwrite, write and writev on that file
 * first append the bytes they overwrite (and the file's size) to the undo log, and
 * fdatasync/fsync of it append a mark: everything logged before the sync began is on
 * disk. A write through an O_DSYNC descriptor is on disk when it returns: not logged.
 * The log is written before the data, so a SIGKILL leaves it complete.
 *
 * A failing disk (power_cut_plan): a sync of the data file may answer EIO, logged
 * as a failed mark. Linux may then have marked the pages that failed clean without
 * writing them ("fsyncgate"): the writes logged before that sync are lost, even when a
 * later sync succeeds, unless a later write to the same page is synced (the page is
 * written again, in whole).
 *
 * The cut (in the test, after the SIGKILL or after closing the store): power_cut_apply
 * restores, newest first, the bytes of every write not on disk (logged after the last
 * mark, or lost to a failed sync), then the file's size.
 *
 * Every file the store writes: data.mdb through these calls, and lock.mdb through its
 * map only (LMDB's reader table and writer mutex: nothing that must survive; the first
 * process to open the store after a cut holds it alone and rebuilds it, mdb.c
 * mdb_env_setup_locks and mdb_env_share_locks, whatever it holds: test_power_cut.c
 * leaves it, truncates it or fills it with noise). A write(), pwrite() or writev() to
 * any other file of the data file's directory is logged (POWER_CUT_OTHER), and
 * power_cut_apply refuses such a log (-1, errno ENOTSUP): a store that begins writing a
 * new file fails the test until the recorder covers it. */
#ifndef IDEMRPC_TEST_POWER_CUT_H
#define IDEMRPC_TEST_POWER_CUT_H

#include <stdint.h>

#include <stdatomic.h>
#include <stddef.h>

enum {
    POWER_CUT_WRITE = 0x57,
    POWER_CUT_SYNC = 0x53,
    POWER_CUT_FAILED = 0x46,
    POWER_CUT_OTHER = 0x4f
};

/* One log record; a write's is followed by its pre-image (len bytes), an other's (a
 * write to another file of the data file's directory, which the cut cannot undo) by
 * that file's path (len bytes). */
typedef struct undo_rec {
    uint64_t type;
    uint64_t off;      /* write: where; sync, failed: the log's size when the sync began */
    uint64_t len;      /* bytes of pre-image that follow */
    uint64_t old_size; /* write: the file's size before it */
} undo_rec;

/* power_cut.c, in the recording process: records to log the writes to data (instead of
 * $IDEMRPC_UNDO_LOG and $IDEMRPC_UNDO_DATA; before the store is opened; log NULL: stops,
 * as it must before power_cut_apply runs in this process). */
void power_cut_record(const char *log, const char *data);
/* The next syncs of data, one character each (a static string): 'p' succeeds, 'f'
 * answers EIO; after the plan, every sync succeeds. */
void power_cut_plan(const char *plan);
/* The syncs of the plan not yet taken. */
size_t power_cut_plan_left(void);
/* Called (when set) on the syncing thread before each sync of data takes its step. */
extern void (*_Atomic power_cut_before_sync)(void);

/* power_cut_apply.c, linked by the test (power_cut.c, the recorder, by the server). */
/* Undoes the unsynced writes log recorded to data; the number undone, or -1 (errno set)
 * when a file cannot be read or written, or ENOTSUP when the log holds a write to
 * another file of the store (POWER_CUT_OTHER). */
long power_cut_apply(const char *log, const char *data);
/* How many writes log has recorded since the last sync (a live server's log: a record
 * being written is not counted); -1 when it cannot be read. */
long power_cut_pending(const char *log);

#endif

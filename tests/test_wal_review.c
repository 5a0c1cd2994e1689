/* A stranger's review of the store's write-ahead log (src/store/lmdb/wal.h): each test
 * here failed on branch r9-wal (d629ed6) when it was written. The cut is test_wal.c's:
 * data.mdb put back to a copy taken while no write ran (every LMDB write since lost),
 * the log kept as the child left it. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "failing_disk.h"
#include "lmdb_internal.h"
#include "supplemental.h"
#include "testutil.h"

#define KEYS 40 /* written one after another: 2 logged batches each (claim, complete) */

static char *dir;
static char data[600], kept[600];
static idem_store *st;

static void setup(void)
{
    dir = tu_tempdir("walrev");
    snprintf(data, sizeof(data), "%s/data.mdb", dir);
    snprintf(kept, sizeof(kept), "%s/data.kept", dir);
    atomic_store(&failing_syncs, 0);
    atomic_store(&failing_log_syncs, 0);
}

static void teardown(void)
{
    atomic_store(&failing_syncs, 0);
    atomic_store(&failing_log_syncs, 0);
    idem_store_close(st);
    st = NULL;
    tu_rmtree(dir);
}

TestSuite(wal_review, .init = setup, .fini = teardown, .timeout = 60);

static idem_claim_req claim_req(const char *key)
{
    idem_claim_req r = {
        .key = {"c", "wal.Test/Write", key}, .owner = idem__random_u64(), .now_ms = idem__now_ms()};
    r.lease_until_ms = r.now_ms + 60000;
    r.expires_ms = r.lease_until_ms + 60000;
    return r;
}

/* Claims key and completes it with value; 0 when both answered OK. */
static int put(const char *key, const char *value)
{
    idem_claim_req r = claim_req(key);
    idem_claim_outcome out;
    return idem_store_claim(st, &r, &out, NULL) == IDEM_OK && out == IDEM_CLAIM_ACQUIRED &&
                   idem_store_complete(st, &r.key, r.owner, value, strlen(value),
                                       r.expires_ms) == IDEM_OK
               ? 0
               : 1;
}

/* The result key reads (malloc'd), NULL when it is not COMPLETED. */
static char *result_of(const char *key)
{
    idem_key_ref ref = {"c", "wal.Test/Write", key};
    idem_record rec;
    if (idem_store_get(st, &ref, &rec) != IDEM_OK) {
        return NULL;
    }
    char *v = rec.state == IDEM_REC_COMPLETED ? strndup(rec.response, rec.response_len) : NULL;
    idem_record_clear(&rec);
    return v;
}

/* A child opens the store (default flags: the log on), copies data.mdb, writes k0..k39
 * (each answered OK, value = key) and dies; data.mdb goes back to the copy. */
static void write_then_cut(void)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        char cmd[1400], key[16];
        if (idem_store_open_lmdb(&st, dir, 0, 0) != IDEM_OK) {
            _exit(2);
        }
        snprintf(cmd, sizeof(cmd), "cp '%s' '%s'", data, kept);
        if (system(cmd) != 0) {
            _exit(3);
        }
        for (int i = 0; i < KEYS; i++) {
            snprintf(key, sizeof(key), "k%d", i);
            if (put(key, key) != 0) {
                _exit(4);
            }
        }
        raise(SIGKILL);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "the child wrote and died");
    char cmd[1400];
    snprintf(cmd, sizeof(cmd), "cp '%s' '%s'", kept, data);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

/* How many of k0..k39 read COMPLETED with themselves. */
static int answered_kept(void)
{
    int n = 0;
    for (int i = 0; i < KEYS; i++) {
        char key[16];
        snprintf(key, sizeof(key), "k%d", i);
        char *v = result_of(key);
        n += v != NULL && strcmp(v, key) == 0;
        free(v);
    }
    return n;
}

static void reopen_keeps_every_answered_write(unsigned flags)
{
    write_then_cut();
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, flags), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(answered_kept(), KEYS, "every write answered OK before the cut reads back");
}

Test(wal_review, a_read_write_open_without_the_log_keeps_every_answered_write)
{
    reopen_keeps_every_answered_write(IDEM_STORE_NO_LOG); /* store.h: "the same guarantees" */
}

Test(wal_review, a_read_write_open_without_group_commit_keeps_every_answered_write)
{
    reopen_keeps_every_answered_write(IDEM_STORE_NO_GROUP_COMMIT);
}

/* After the cut a process writes without the log (IDEM_STORE_NO_LOG, a release before
 * the log, a server without group commit): the last key is gone, so a retry of its call
 * claims it again and stores its new result, answered OK. The next open with the log
 * must not put the dead process's entries over that. */
Test(wal_review, a_crashed_logs_entries_are_not_replayed_over_writes_made_without_the_log)
{
    char last[16];
    snprintf(last, sizeof(last), "k%d", KEYS - 1);
    write_then_cut();
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NO_LOG), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(put(last, "retried"), 0, "the retry's write is answered OK");
    idem_store_close(st);
    st = NULL;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    char *v = result_of(last);
    cr_expect(v != NULL && strcmp(v, "retried") == 0,
              "the result answered OK last is the one kept (read: %s)", v ? v : "(none)");
    free(v);
    int stale = answered_kept();
    cr_expect_eq(stale, 0, "no key of the lost run came back half-way (%d did)", stale);
}

/* A write whose commit fails is answered with an error; its log entry was flushed all
 * the same. Nothing commits after it in this process; the next open must not apply it. */
Test(wal_review, a_write_answered_with_an_error_is_not_applied_at_the_next_open)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    idem_claim_req r = claim_req("failed");
    idem_claim_outcome out;
    cr_assert_eq(idem_store_claim(st, &r, &out, NULL), IDEM_OK, "%s", idem_errmsg());
    atomic_store(&failing_syncs, 1000); /* data.mdb: every commit and sync fails */
    idem_code c = idem_store_complete(st, &r.key, r.owner, "done", 4, r.expires_ms);
    cr_assert_neq(c, IDEM_OK, "the completion is answered with an error");
    idem_store_close(st);
    st = NULL;
    atomic_store(&failing_syncs, 0);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    char *v = result_of("failed");
    cr_expect_null(v, "a completion answered %s reads COMPLETED (%s) after a restart",
                   idem_code_name(c), v);
    free(v);
}

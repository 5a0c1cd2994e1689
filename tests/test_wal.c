/* The store's write-ahead log (src/store/lmdb/wal.h): a write answered after its log
 * entry's flush survives the loss of LMDB's writes since a state the disk had, replayed
 * at the next read-write open; a damaged entry ends the replay, and nothing after it is
 * applied; a second process writes without the log; a log that fails to flush turns
 * itself off and the answers wait for LMDB's own sync; and the edges a stranger's review
 * of the first version broke (a failed commit's entry, a large batch, another program's
 * directory), each test failing there. The cut here is data.mdb put
 * back to bytes it had (a copy taken while no write ran), a harsher loss than a power
 * cut (test_power_cut.c records every write and undoes the unsynced ones). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "failing_disk.h"
#include "lmdb_internal.h"
#include "supplemental.h"
#include "testutil.h"
#include "wal_priv.h"

#define WRITERS 8
#define PER_WRITER 10
#define BIG (64 * 1024) /* a value that fills the log fast: 40 of them pass its wrap */

static char *dir;
static char data[600], kept[600], wal[600];
static idem_store *st;

static void setup(void)
{
    dir = tu_tempdir("wal");
    snprintf(data, sizeof(data), "%s/data.mdb", dir);
    snprintf(kept, sizeof(kept), "%s/data.kept", dir);
    snprintf(wal, sizeof(wal), "%s/wal.log", dir);
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

TestSuite(wal, .init = setup, .fini = teardown, .timeout = 60);

static idem_claim_req claim_req(const char *key)
{
    idem_claim_req r = {
        .key = {"c", "wal.Test/Write", key}, .owner = idem__random_u64(), .now_ms = idem__now_ms()};
    r.lease_until_ms = r.now_ms + 60000;
    r.expires_ms = r.lease_until_ms + 60000;
    return r;
}

/* Claims key and completes it with value (len bytes); 0 when both returned OK. */
static int put(const char *key, const void *value, size_t len)
{
    idem_claim_req r = claim_req(key);
    idem_claim_outcome out;
    return idem_store_claim(st, &r, &out, NULL) == IDEM_OK && out == IDEM_CLAIM_ACQUIRED &&
                   idem_store_complete(st, &r.key, r.owner, value, len, r.expires_ms) == IDEM_OK
               ? 0
               : 1;
}

/* PER_WRITER keys, each written with itself as its value and printed once answered. */
static void *writer(void *arg)
{
    for (int i = 0; i < PER_WRITER; i++) {
        char key[32];
        int n = snprintf(key, sizeof(key), "w%ld-%d", (long)arg, i);
        if (put(key, key, (size_t)n) != 0) {
            return (void *)1;
        }
        key[n] = '\n'; /* one write of a line: whole in the pipe */
        if (write(STDOUT_FILENO, key, (size_t)n + 1) != n + 1) {
            return (void *)1;
        }
    }
    return NULL;
}

static int copy_file(const char *from, const char *to)
{
    char cmd[1400];
    snprintf(cmd, sizeof(cmd), "cp '%s' '%s'", from, to);
    return system(cmd);
}

/* A child (DIR BIG COPY_TO): opens the store, writes BIG big values first (the log passes
 * its wrap), copies data.mdb to COPY_TO (a state the disk had: nothing runs), prints
 * "ready", then runs the writers and dies without closing. */
TU_CHILD_MAIN(writes)
{
    char data_mdb[600];
    static char value[BIG];
    if (argc != 3 || idem_store_open_lmdb(&st, argv[0], 0, 0) != IDEM_OK) {
        return 2;
    }
    int big = atoi(argv[1]);
    for (int i = 0; i < big; i++) {
        char key[32];
        snprintf(key, sizeof(key), "big-%d", i);
        if (put(key, value, sizeof(value)) != 0) {
            return 3;
        }
    }
    /* The wrap runs on the writer thread after the batch that passed it is answered: one
     * more write waits for it (a copy taken during it is a state no disk had: the store
     * naming the old epoch beside a header of the new one). */
    if (big > 0 && put("after-the-wrap", "", 0) != 0) {
        return 3;
    }
    snprintf(data_mdb, sizeof(data_mdb), "%s/data.mdb", argv[0]);
    if (copy_file(data_mdb, argv[2]) != 0) {
        return 4;
    }
    printf("ready\n");
    fflush(stdout);
    pthread_t t[WRITERS];
    for (long i = 0; i < WRITERS; i++) {
        pthread_create(&t[i], NULL, writer, (void *)i);
    }
    for (int i = 0; i < WRITERS; i++) {
        pthread_join(t[i], NULL);
    }
    raise(SIGKILL);
    return 5;
}

/* The child above writes (after big values) and is killed, then data.mdb goes back to
 * the copy it took before its writers ran: the keys it reported answered, one per line. */
static char *write_then_cut(int big)
{
    char big_s[16];
    snprintf(big_s, sizeof(big_s), "%d", big);
    tu_child c;
    tu_spawn_child(&c, "writes", (const char *const[]){dir, big_s, kept, NULL});
    static char lines[WRITERS * PER_WRITER * 32 + 1];
    size_t len = fread(lines, 1, sizeof(lines) - 1, c.out);
    lines[len] = '\0';
    cr_assert_eq(tu_reap(&c), SIGKILL, "the child wrote and was killed");
    cr_assert_eq(copy_file(kept, data), 0); /* the cut: LMDB's writes since the copy are gone */
    return strdup(lines);
}

/* How many of the keys (lines, consumed) read COMPLETED with themselves as result;
 * *wrong: how many read COMPLETED with another (a claim whose completion was not
 * replayed reads IN_PROGRESS: not wrong). */
static int completed(char *lines, int *wrong)
{
    int found = 0;
    *wrong = 0;
    for (char *save, *k = strtok_r(lines, "\n", &save); k != NULL;
         k = strtok_r(NULL, "\n", &save)) {
        idem_key_ref ref = {"c", "wal.Test/Write", k};
        idem_record rec;
        idem_code c = idem_store_get(st, &ref, &rec);
        if (c == IDEM_OK && rec.state == IDEM_REC_COMPLETED) {
            bool same =
                rec.response_len == strlen(k) && memcmp(rec.response, k, rec.response_len) == 0;
            found += same;
            *wrong += !same;
        }
        if (c == IDEM_OK) {
            idem_record_clear(&rec);
        }
    }
    return found;
}

/* What the cut left, read without a replay (a read-only open replays nothing). */
static int completed_without_replay(const char *lines)
{
    char *copy = strdup(lines);
    int wrong;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_READONLY), IDEM_OK);
    int n = completed(copy, &wrong);
    idem_store_close(st);
    st = NULL;
    free(copy);
    return n;
}

Test(wal, an_answered_write_whose_store_pages_were_lost_is_replayed_from_the_log)
{
    char *lines = write_then_cut(0);
    int wrong;
    cr_assert_eq(completed_without_replay(lines), 0, "the cut took every write from data.mdb");
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(completed(lines, &wrong), WRITERS * PER_WRITER,
                 "every answered write is back, with its result");
    cr_expect_eq(wrong, 0);
    free(lines);
}

Test(wal, writes_after_the_log_started_a_new_epoch_are_replayed_from_it)
{
    char *lines = write_then_cut(40); /* 40 x 64 KiB: past the log's 1 MiB wrap */
    int wrong;
    cr_assert_eq(completed_without_replay(lines), 0);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(completed(lines, &wrong), WRITERS * PER_WRITER);
    cr_expect_eq(wrong, 0);
    free(lines);
}

/* A log applies only to the store it was written beside: a data.mdb put in its place (a
 * backup of another store, another shard's file) whose txnids happen to chain with the
 * log's entries must not take them: they are another store's keys and results. Here
 * another store, as fresh as the child's was when it took its copy, chains exactly. */
Test(wal, a_log_beside_another_store_is_not_replayed_into_it)
{
    char *lines = write_then_cut(0), other_data[600];
    char *other = tu_tempdir("wal-other");
    int wrong;
    cr_assert_eq(idem_store_open_lmdb(&st, other, 0, 0), IDEM_OK, "%s", idem_errmsg());
    idem_store_close(st);
    st = NULL;
    snprintf(other_data, sizeof(other_data), "%s/data.mdb", other);
    cr_assert_eq(copy_file(other_data, data), 0);
    tu_rmtree(other);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(completed(lines, &wrong), 0, "another store's answered writes were replayed");
    cr_expect_eq(wrong, 0);
    free(lines);
}

/* The offset of the last entry of the log's epoch (its header checked by the replay). */
static off_t last_entry(const uint8_t *buf, size_t len)
{
    off_t last = -1;
    for (size_t at = 4096; len - at >= 24;) {
        size_t n = idem__get_be32(buf + at);
        if (n < 16 || len - at - 8 < n || idem__get_be64(buf + at + 8) != idem__get_be64(buf + 8)) {
            break;
        }
        last = (off_t)at;
        at += 8 + n;
    }
    return last;
}

Test(wal, a_damaged_entry_ends_the_replay_and_nothing_of_it_is_applied)
{
    char *lines = write_then_cut(0);
    static uint8_t buf[4 << 20];
    int fd = open(wal, O_RDWR);
    cr_assert_geq(fd, 0);
    ssize_t len = pread(fd, buf, sizeof(buf), 0);
    cr_assert_gt(len, 4096);
    off_t at = last_entry(buf, (size_t)len);
    cr_assert_gt(at, 4096, "the log holds entries");
    uint8_t flip = buf[at + 30] ^ 0x40; /* a byte of its first record: its crc no longer holds */
    cr_assert_eq(pwrite(fd, &flip, 1, at + 30), 1);
    close(fd);
    int wrong;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    int back = completed(lines, &wrong);
    cr_expect_lt(back, WRITERS * PER_WRITER, "the damaged entry's writes were not applied");
    cr_expect_gt(back, 0, "the entries before it were");
    cr_expect_eq(wrong, 0, "no key read a value it was not written with");
    free(lines);
}

/* A child (DIR): opens the store another process holds, writes "second" and prints
 * whether it had the log and wrote. */
TU_CHILD_MAIN(second)
{
    printf("ready\n");
    fflush(stdout);
    if (argc != 1 || idem_store_open_lmdb(&st, argv[0], 0, 0) != IDEM_OK) {
        return 2;
    }
    bool without = ((lmdb_store *)st)->gc.wal == NULL;
    int rc = put("second", "2", 1);
    idem_store_close(st);
    printf("%s, %s\n", without ? "without the log" : "with the log",
           rc == 0 ? "written" : "failed");
    return 0;
}

Test(wal, a_second_process_on_the_store_writes_without_the_log)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_assert_not_null(((lmdb_store *)st)->gc.wal, "the first opener holds the log");
    cr_assert_eq(put("first", "1", 1), 0);
    tu_child c;
    char line[64] = "";
    tu_spawn_child(&c, "second", (const char *const[]){dir, NULL});
    (void)!fgets(line, sizeof(line), c.out);
    cr_assert_eq(tu_reap(&c), 0);
    cr_assert_str_eq(line, "without the log, written\n", "the second opener");
    cr_expect_eq(put("third", "3", 1), 0, "the first goes on writing, through its log");
    idem_key_ref ref = {"c", "wal.Test/Write", "second"};
    idem_record rec;
    cr_assert_eq(idem_store_get(st, &ref, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(rec.state, IDEM_REC_COMPLETED);
    idem_record_clear(&rec);
}

Test(wal, a_log_that_fails_to_flush_turns_off_and_the_write_waits_for_lmdb)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    lmdb_store *ls = (lmdb_store *)st;
    cr_assert(idem__wal_on(ls->gc.wal));
    atomic_store(&failing_log_syncs, 1);
    cr_assert_eq(put("k1", "1", 1), 0, "answered OK all the same: %s", idem_errmsg());
    cr_expect_eq(atomic_load(&failing_log_syncs), 0, "the log's flush failed");
    cr_expect(!idem__wal_on(ls->gc.wal), "the log is off");
    MDB_envinfo info;
    cr_assert_eq(mdb_env_info(ls->env, &info), 0);
    cr_expect_geq(atomic_load(&ls->gc.durable_txnid), (uint64_t)info.me_last_txnid,
                  "the answer waited for LMDB's sync of its meta page");
    cr_expect_eq(put("k2", "2", 1), 0, "and writes go on without it");
    idem_store_close(st);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_expect(idem__wal_on(((lmdb_store *)st)->gc.wal), "a new open has its log again");
}

/* An epoch's commit that fails (its txn freed, as the callback must). */
static int commit_fails(MDB_txn *txn, void *arg)
{
    (void)arg;
    mdb_txn_abort(txn);
    return EIO;
}

/* A wrap commits the new epoch to the store and syncs it before a header names it: when
 * that fails, the store may come back naming an epoch that no header has, and a replay
 * would refuse the entries written after it. So the log goes off, and answers wait for
 * LMDB's sync. */
Test(wal, a_wrap_whose_epoch_commit_fails_turns_the_log_off)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    lmdb_store *ls = (lmdb_store *)st;
    cr_assert_eq(put("k1", "1", 1), 0);
    ls->gc.wal->off = WAL_WRAP; /* the writer thread is idle: nothing is queued */
    idem__wal_wrap_due(ls->gc.wal, commit_fails, NULL);
    cr_expect(!idem__wal_on(ls->gc.wal), "the log is off");
    cr_expect_eq(put("k2", "2", 1), 0, "writes go on without it: %s", idem_errmsg());
    MDB_envinfo info;
    cr_assert_eq(mdb_env_info(ls->env, &info), 0);
    cr_expect_geq(atomic_load(&ls->gc.durable_txnid), (uint64_t)info.me_last_txnid,
                  "the answer waited for LMDB's sync of its meta page");
}

Test(wal, a_store_opened_without_the_log_after_a_cut_still_replays_it)
{
    char *lines = write_then_cut(0);
    int wrong;
    cr_assert_eq(completed_without_replay(lines), 0);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NO_LOG), IDEM_OK, "%s",
                 idem_errmsg());
    cr_expect_null(((lmdb_store *)st)->gc.wal, "replayed, not kept");
    cr_expect_eq(completed(lines, &wrong), WRITERS * PER_WRITER);
    cr_expect_eq(wrong, 0);
    free(lines);
}

/* ---- the edges a stranger's review of the first version broke ---- */

/* A write whose commit (and its redo) fails is answered with an error; its log entry
 * was flushed all the same. Nothing commits after it in this process; the next open
 * must not apply it (docs/semantics.md: a claim whose commit and redo fail: "nothing is
 * recorded, the retry runs"). */
Test(wal, a_claim_answered_with_an_error_is_not_applied_at_the_next_open)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(put("before", "b", 1), 0, "a write before the failures, logged");
    idem_claim_req r = claim_req("failed");
    idem_claim_outcome out;
    atomic_store(&failing_syncs, 1000); /* data.mdb: every commit and sync fails */
    idem_code c = idem_store_claim(st, &r, &out, NULL);
    cr_assert_neq(c, IDEM_OK, "the claim is answered with an error");
    idem_store_close(st);
    st = NULL;
    atomic_store(&failing_syncs, 0);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    idem_key_ref ref = {"c", "wal.Test/Write", "failed"};
    idem_record rec;
    idem_code got = idem_store_get(st, &ref, &rec);
    cr_expect_eq(got, IDEM_NOT_FOUND, "a claim answered %s is recorded after a restart (%s)",
                 idem_code_name(c), idem_code_name(got));
    if (got == IDEM_OK) {
        idem_record_clear(&rec);
    }
}

/* wal.h: "The file is written with zeros to WAL_SIZE when created, so that an entry
 * overwrites blocks it has (no size change to journal)": an entry larger than what is
 * left of those blocks grows the file, for good (the brief asks for a bounded entry and
 * a bounded file). */
Test(wal, one_large_result_leaves_the_log_within_its_presized_file)
{
    enum { LARGE = 4 << 20 };
    char path[600];
    struct stat sb;
    snprintf(path, sizeof(path), "%s/wal.log", dir);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    char *value = malloc(LARGE + 1);
    cr_assert_not_null(value);
    memset(value, 'v', LARGE);
    value[LARGE] = '\0';
    cr_assert_eq(put("large", value, LARGE), 0, "%s", idem_errmsg());
    free(value);
    idem_store_close(st);
    st = NULL;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(stat(path, &sb), 0);
    cr_expect_leq(sb.st_size, (off_t)WAL_SIZE, "wal.log holds %lld bytes after a reopen",
                  (long long)sb.st_size);
}

/* store.h: IDEM_STORE_EXISTING opens "only a directory that already holds an idemrpc
 * store: IDEM_NOT_FOUND, and nothing created, for ... another program's LMDB environment"
 * (idemctl on a mistyped path). The log is opened (created, presized, its header
 * written) before the databases are looked for: here over that program's own wal.log. */
Test(wal, opening_another_programs_lmdb_environment_writes_nothing_there)
{
    char path[600], got[64] = {0};
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    MDB_val k = {1, "k"}, v = {1, "v"};
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_open(env, dir, 0, 0600), 0);
    cr_assert_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    cr_assert_eq(mdb_put(txn, dbi, &k, &v, 0), 0);
    cr_assert_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    snprintf(path, sizeof(path), "%s/wal.log", dir);
    FILE *f = fopen(path, "w"); /* that program's own log */
    cr_assert_not_null(f);
    cr_assert_eq(fputs("its own log", f) >= 0, true);
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_EXISTING), IDEM_NOT_FOUND, "%s",
                 idem_errmsg());
    f = fopen(path, "r");
    cr_assert_not_null(f);
    size_t n = fread(got, 1, sizeof(got) - 1, f);
    fclose(f);
    cr_expect(n == strlen("its own log") && strcmp(got, "its own log") == 0,
              "its wal.log was written over (%zu bytes read, starting \"%.8s\")", n, got);
}

/* ---- a full store (the chaos campaign's fill: a reader pins the pages a write frees) ---- */

#define FULL_MAP ((size_t)4 << 20)

/* Ballast in the main db, one txn per value, until not even a small one fits. */
static void fill(void)
{
    static char big[65536];
    static const size_t sizes[] = {65536, 4096, 256, 16};
    MDB_env *e;
    cr_assert_eq(mdb_env_create(&e), 0);
    cr_assert_eq(mdb_env_set_maxdbs(e, 16), 0);
    cr_assert_eq(mdb_env_set_mapsize(e, FULL_MAP), 0);
    cr_assert_eq(mdb_env_open(e, dir, 0, 0600), 0);
    unsigned n = 0;
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        for (int rc = 0; rc != MDB_MAP_FULL;) {
            MDB_txn *txn;
            MDB_dbi dbi;
            char key[32];
            snprintf(key, sizeof(key), "ballast-%u", n++);
            MDB_val k = {strlen(key), key}, v = {sizes[s], big};
            cr_assert_eq(mdb_txn_begin(e, NULL, 0, &txn), 0);
            cr_assert_eq(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
            if ((rc = mdb_put(txn, dbi, &k, &v, 0)) == 0) {
                rc = mdb_txn_commit(txn);
            } else {
                mdb_txn_abort(txn);
            }
            cr_assert(rc == 0 || rc == MDB_MAP_FULL, "%s", mdb_strerror(rc));
        }
    }
    mdb_env_close(e);
}

/* A child (DIR): holds a read txn on the store (the pin) until it is killed. */
TU_CHILD_MAIN(pin)
{
    MDB_env *e;
    MDB_txn *txn;
    if (argc != 1 || mdb_env_create(&e) || mdb_env_set_maxdbs(e, 16) ||
        mdb_env_set_mapsize(e, FULL_MAP) || mdb_env_open(e, argv[0], MDB_RDONLY, 0600) ||
        mdb_txn_begin(e, NULL, MDB_RDONLY, &txn)) {
        return 2;
    }
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        pause();
    }
}

/* A store first opened with first_flags, filled while another process holds a read txn
 * (so no freed page can be reused), opens again with flags: a full store serves its
 * reads and replays, and answers new keys RESOURCE_EXHAUSTED; the log's epoch, which
 * needs a commit, is not a reason to refuse the open. */
static void a_full_store_opens(unsigned first_flags, unsigned flags)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, FULL_MAP, first_flags), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(put("before", "1", 1), 0);
    idem_store_close(st);
    st = NULL;
    tu_child pin;
    tu_spawn_child(&pin, "pin", (const char *const[]){dir, NULL});
    fill();
    idem_code code = idem_store_open_lmdb(&st, dir, FULL_MAP, flags);
    cr_expect_eq(code, IDEM_OK, "the full store does not open: %s", idem_errmsg());
    if (code == IDEM_OK) {
        idem_key_ref ref = {"c", "wal.Test/Write", "before"};
        idem_record rec;
        cr_expect_eq(idem_store_get(st, &ref, &rec), IDEM_OK, "%s", idem_errmsg());
        idem_record_clear(&rec);
        cr_expect_neq(put("after", "2", 1), 0, "a new key in a full store is refused");
    }
    kill(pin.pid, SIGKILL);
    tu_reap(&pin);
}

Test(wal, a_full_store_with_a_log_opens_for_its_reads)
{
    a_full_store_opens(0, 0);
}

Test(wal, a_full_store_without_a_log_opens_for_its_reads)
{
    a_full_store_opens(IDEM_STORE_NO_LOG, 0);
}

/* The power-cut recorder itself (power_cut.c, power_cut_apply.c), on files this process
 * writes: data.mdb and wal.log, written and synced in turn, then cut. What each cut leaves
 * is checked byte for byte: drop-all (the synced image: each file as its own last sync
 * left it, a sync of one file saving nothing of the other) and a fixed keep-subset draw
 * (the synced image, then the kept writes in their order). A write to a third file of the
 * store makes the cut refuse; a file created by unsynced writes is empty after the cut;
 * the failing-sync plan takes data.mdb's syncs only; an fallocate that grows wal.log is
 * undone like a write, one that punches a hole makes the cut refuse. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "power_cut.h"
#include "testutil.h"

static char *dir;
static char store[512], data[600], wal[600], undo[600];

static void setup(void)
{
    dir = tu_tempdir("power_cut_recorder");
    snprintf(store, sizeof(store), "%s/store", dir);
    snprintf(data, sizeof(data), "%s/data.mdb", store);
    snprintf(wal, sizeof(wal), "%s/wal.log", store);
    snprintf(undo, sizeof(undo), "%s/undo.log", dir);
    cr_assert_eq(mkdir(store, 0700), 0, "mkdir %s: %s", store, strerror(errno));
    power_cut_record(undo, data);
}

static void teardown(void)
{
    power_cut_record(NULL, NULL);
    power_cut_plan("");
    tu_rmtree(dir);
}

TestSuite(power_cut_recorder, .init = setup, .fini = teardown, .timeout = 30);

static int open_rw(const char *path)
{
    int fd = open(path, O_RDWR | O_CREAT, 0600);
    cr_assert_geq(fd, 0, "open %s: %s", path, strerror(errno));
    return fd;
}

static void put(int fd, const char *s, off_t at)
{
    ssize_t n = (ssize_t)strlen(s);
    cr_assert_eq(at < 0 ? write(fd, s, (size_t)n) : pwrite(fd, s, (size_t)n, at), n);
}

/* The two files' history (closed after it): synced, then unsynced writes and a shrink
 * of each file. A sync of one file between the other's writes must not save them. */
static void write_both(void)
{
    int d = open_rw(data), w = open_rw(wal);
    put(d, "AAAA", 0);
    put(w, "wwww", 0);
    cr_assert_eq(fdatasync(d), 0); /* data: AAAA on disk */
    put(d, "BBBB", 4);             /* data #0, pending */
    cr_assert_eq(lseek(w, 4, SEEK_SET), 4);
    put(w, "xxxx", -1);                /* write(), at the position */
    cr_assert_eq(fdatasync(w), 0);     /* wal: wwwwxxxx on disk; data #0 still pending */
    put(w, "yyyy", 8);                 /* wal #0 */
    put(d, "CCCC", 0);                 /* data #1 */
    cr_assert_eq(ftruncate(w, 10), 0); /* wal #1: cuts "yy" off */
    cr_assert_eq(close(d), 0);
    cr_assert_eq(close(w), 0);
    power_cut_record(NULL, NULL); /* the cut's own writes are not recorded */
}

static void expect_file(const char *path, const char *bytes, size_t size)
{
    char got[64] = {0};
    int fd = open(path, O_RDONLY);
    cr_assert_geq(fd, 0, "open %s: %s", path, strerror(errno));
    ssize_t n = read(fd, got, sizeof(got));
    close(fd);
    cr_expect_eq(n, (ssize_t)size, "%s holds %zd bytes, not %zu", path, n, size);
    cr_expect(n == (ssize_t)size && memcmp(got, bytes, size) == 0, "%s holds \"%.*s\"", path,
              (int)(n > 0 ? n : 0), got);
}

Test(power_cut_recorder, drop_all_leaves_each_file_as_its_own_last_sync_left_it)
{
    write_both();
    power_cut_stats st;
    cr_assert_eq(power_cut_apply_keeping(undo, data, NULL, NULL, &st), 0, "%s", strerror(errno));
    expect_file(data, "AAAA", 4);
    expect_file(wal, "wwwwxxxx", 8);
    cr_expect_eq(st.undone[POWER_CUT_DATA], 2);
    cr_expect_eq(st.undone[POWER_CUT_WAL], 2);
    cr_expect_eq(st.kept[POWER_CUT_DATA] + st.kept[POWER_CUT_WAL], 0);
}

/* Keeps data's first pending write and wal's second (the shrink, without the write). */
static bool keep_fixed(void *arg, int file, long nth)
{
    (void)arg;
    return nth == (file == POWER_CUT_DATA ? 0 : 1);
}

Test(power_cut_recorder, keep_subset_reapplies_the_kept_writes_over_the_synced_image)
{
    write_both();
    power_cut_stats st;
    cr_assert_eq(power_cut_apply_keeping(undo, data, keep_fixed, NULL, &st), 0, "%s",
                 strerror(errno));
    expect_file(data, "AAAABBBB", 8);
    expect_file(wal, "wwwwxxxx\0\0", 10); /* the kept shrink to 10 grows the synced 8 */
    for (int f = 0; f < POWER_CUT_FILES; f++) {
        cr_expect_eq(st.undone[f], 1, "file %d", f);
        cr_expect_eq(st.kept[f], 1, "file %d", f);
    }
}

Test(power_cut_recorder, a_file_created_by_unsynced_writes_is_empty_after_the_cut)
{
    int w = open_rw(wal);
    put(w, "wwww", 0);
    put(w, "xxxx", -1);
    cr_assert_eq(close(w), 0);
    power_cut_record(NULL, NULL);
    cr_assert_eq(power_cut_apply(undo, data), 2, "%s", strerror(errno));
    expect_file(wal, "", 0);
}

Test(power_cut_recorder, a_write_to_a_third_file_of_the_store_makes_the_cut_refuse)
{
    char other[600];
    snprintf(other, sizeof(other), "%s/other.log", store);
    int d = open_rw(data), o = open_rw(other);
    put(d, "AAAA", 0);
    put(o, "oooo", 0);
    cr_assert_eq(close(d), 0);
    cr_assert_eq(close(o), 0);
    power_cut_record(NULL, NULL);
    power_cut_stats st;
    errno = 0;
    cr_expect_eq(power_cut_apply_keeping(undo, data, NULL, NULL, &st), -1);
    cr_expect_eq(errno, ENOTSUP, "%s", strerror(errno));
    expect_file(data, "AAAA", 4); /* refused before it changed anything */
}

Test(power_cut_recorder, the_failing_sync_plan_takes_only_the_data_files_syncs)
{
    int d = open_rw(data), w = open_rw(wal);
    power_cut_plan("f");
    put(w, "wwww", 0);
    cr_expect_eq(fdatasync(w), 0, "wal.log's sync takes no step of the plan");
    cr_expect_eq(power_cut_plan_left(), 1);
    put(d, "AAAA", 0);
    errno = 0;
    cr_expect_eq(fdatasync(d), -1);
    cr_expect_eq(errno, EIO);
    cr_expect_eq(power_cut_plan_left(), 0);
    cr_assert_eq(close(d), 0);
    cr_assert_eq(close(w), 0);
    power_cut_record(NULL, NULL);
    cr_assert_eq(power_cut_apply(undo, data), 1, "the failed sync lost AAAA: %s", strerror(errno));
    expect_file(data, "", 0);
    expect_file(wal, "wwww", 4);
}

Test(power_cut_recorder, an_unsynced_fallocate_that_grew_wal_log_is_undone)
{
    int w = open_rw(wal);
    put(w, "wwww", 0);
    cr_assert_eq(fdatasync(w), 0);
    cr_assert_eq(fallocate(w, 0, 0, 8192), 0, "%s", strerror(errno));
    cr_assert_eq(close(w), 0);
    power_cut_record(NULL, NULL);
    cr_assert_eq(power_cut_apply(undo, data), 1, "%s", strerror(errno));
    expect_file(wal, "wwww", 4);
}

Test(power_cut_recorder, a_hole_punched_in_wal_log_makes_the_cut_refuse)
{
    int w = open_rw(wal);
    put(w, "wwww", 0);
    int rc = fallocate(w, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4);
    cr_assert_eq(close(w), 0);
    power_cut_record(NULL, NULL);
    power_cut_stats st;
    errno = 0;
    cr_expect_eq(power_cut_apply_keeping(undo, data, NULL, NULL, &st), -1, "punch: %d", rc);
    cr_expect_eq(errno, ENOTSUP, "%s", strerror(errno));
}

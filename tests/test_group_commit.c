/* Group commit: concurrent writers share transactions, and nobody returns before the
 * commit holding its write. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "call.h"
#include "testutil.h"

#define WRITERS 32
#define PER_WRITER 20

static char *dir;
static idem_store *st;
static int report_fd = -1; /* child → parent: keys whose claim has returned */

static void setup(void)
{
    dir = tu_tempdir("gc");
}

static void teardown(void)
{
    idem_store_close(st);
    st = NULL;
    tu_rmtree(dir);
}

TestSuite(group_commit, .init = setup, .fini = teardown, .timeout = 60);

static idem_claim_req claim_req(const char *key)
{
    idem_claim_req r = {
        .key = {"c", "gc.Test/Write", key}, .owner = idem__random_u64(), .now_ms = idem__now_ms()};
    r.lease_until_ms = r.now_ms + 60000;
    r.expires_ms = r.lease_until_ms + 60000;
    memset(r.fingerprint, 7, sizeof(r.fingerprint));
    return r;
}

/* claim + complete of PER_WRITER distinct keys; the key goes to report_fd after both
 * calls returned. */
static void *writer(void *arg)
{
    long id = (long)arg;
    for (int i = 0; i < PER_WRITER; i++) {
        char key[32];
        snprintf(key, sizeof(key), "w%ld-%d", id, i);
        idem_claim_req r = claim_req(key);
        idem_claim_outcome out;
        if (idem_store_claim(st, &r, &out, NULL) != IDEM_OK || out != IDEM_CLAIM_ACQUIRED ||
            idem_store_complete(st, &r.key, r.owner, key, strlen(key), r.expires_ms) != IDEM_OK) {
            return (void *)1;
        }
        if (report_fd >= 0) {
            char line[40];
            int n = snprintf(line, sizeof(line), "%s\n", key);
            if (write(report_fd, line, (size_t)n) != n) {
                return (void *)1;
            }
        }
    }
    return NULL;
}

static int run_writers(void)
{
    pthread_t t[WRITERS];
    int failed = 0;
    for (long i = 0; i < WRITERS; i++) {
        pthread_create(&t[i], NULL, writer, (void *)i);
    }
    for (int i = 0; i < WRITERS; i++) {
        void *rv;
        pthread_join(t[i], &rv);
        failed += rv != NULL;
    }
    return failed;
}

Test(group_commit, concurrent_writers_share_commits)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(run_writers(), 0);
    idem_store_stats s;
    cr_assert_eq(idem_store_stats_get(st, &s), IDEM_OK);
    cr_expect_eq(s.completed, WRITERS * PER_WRITER);
    cr_expect_eq(s.writes, 2 * WRITERS * PER_WRITER);
    cr_expect_lt(s.commits, s.writes, "durable writers at once share transactions (%llu in %llu)",
                 (unsigned long long)s.writes, (unsigned long long)s.commits);
}

Test(group_commit, switched_off_every_write_is_its_own_commit)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NO_GROUP_COMMIT), IDEM_OK);
    cr_assert_eq(run_writers(), 0);
    idem_store_stats s;
    cr_assert_eq(idem_store_stats_get(st, &s), IDEM_OK);
    cr_expect_eq(s.commits, s.writes);
    cr_expect_eq(s.completed, WRITERS * PER_WRITER);
}

Test(group_commit, every_returned_write_survives_a_kill)
{
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) { /* writers report each key after its calls returned, then die */
        close(fds[0]);
        report_fd = fds[1];
        if (idem_store_open_lmdb(&st, dir, 0, 0) != IDEM_OK) {
            _exit(2);
        }
        run_writers();
        raise(SIGKILL);
    }
    close(fds[1]);
    FILE *in = fdopen(fds[0], "r");
    char line[64];
    int reported = 0;
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, 0), IDEM_OK);
    while (fgets(line, sizeof(line), in) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        idem_key_ref k = {"c", "gc.Test/Write", line};
        idem_record rec;
        cr_expect_eq(idem_store_get(st, &k, &rec), IDEM_OK, "%s was reported done", line);
        cr_expect_eq(rec.state, IDEM_REC_COMPLETED);
        idem_record_clear(&rec);
        reported++;
    }
    fclose(in);
    cr_expect_eq(reported, WRITERS * PER_WRITER);
}

static void *fill(void *arg)
{
    long id = (long)arg;
    static char blob[8192];
    for (int i = 0; i < 40; i++) {
        char key[32];
        snprintf(key, sizeof(key), "f%ld-%d", id, i);
        idem_claim_req r = claim_req(key);
        idem_claim_outcome out;
        idem_code c = idem_store_claim(st, &r, &out, NULL);
        if (c == IDEM_OK) {
            c = idem_store_complete(st, &r.key, r.owner, blob, sizeof(blob), r.expires_ms);
        }
        if (c != IDEM_OK && c != IDEM_RESOURCE_EXHAUSTED) {
            return (void *)1;
        }
    }
    return NULL;
}

Test(group_commit, a_full_map_fails_only_the_writes_that_do_not_fit)
{
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 1 << 20, 0), IDEM_OK);
    pthread_t t[8];
    for (long i = 0; i < 8; i++) {
        pthread_create(&t[i], NULL, fill, (void *)i);
    }
    int odd = 0;
    for (int i = 0; i < 8; i++) {
        void *rv;
        pthread_join(t[i], &rv);
        odd += rv != NULL;
    }
    cr_expect_eq(odd, 0, "each write is OK or RESOURCE_EXHAUSTED, nothing else");
    idem_store_stats s;
    cr_assert_eq(idem_store_stats_get(st, &s), IDEM_OK);
    cr_expect_gt(s.completed, 0);
    cr_expect_lt(s.completed, 8 * 40, "the map did fill up");
}

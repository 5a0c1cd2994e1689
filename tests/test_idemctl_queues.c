/* idemctl's queue verbs against a real store ($IDEMRPC_TEST_BACKEND: LMDB, or a schema of
 * its own in real PostgreSQL): what the toolkit put there, as the tool prints it. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

/* Runs idemctl (the store's --db or --pg, then args, NULL-terminated) and returns its
 * exit status; out gets its stdout and stderr (NUL-terminated, cut at cap). */
static int run_ctl(const tu_backend *b, char *out, size_t cap, const char *const *args)
{
    const char *argv[16] = {getenv("IDEMCTL"), b->dir ? "--db" : "--pg",
                            b->dir ? b->dir : b->conninfo};
    size_t n = 3, got = 0;
    for (; *args != NULL && n < 15; args++) {
        argv[n++] = *args;
    }
    int fd[2];
    cr_assert_not_null(argv[0], "IDEMCTL not set (meson test sets it)");
    cr_assert_eq(pipe(fd), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close(fd[0]);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fd[1]);
    for (ssize_t r; got + 1 < cap && (r = read(fd[0], out + got, cap - 1 - got)) > 0;) {
        got += (size_t)r;
    }
    out[got] = '\0';
    close(fd[0]);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

typedef struct put_arg {
    const char *subject, *msg_id, *data;
    size_t len;
} put_arg;

static idem_code put(idem_txn *t, void *arg)
{
    put_arg *p = arg;
    return idem_outbox_put(t, p->subject, p->msg_id, p->data, p->len);
}

Test(idemctl_queues, outbox_shows_the_pending_count_and_the_oldest_message_escaped)
{
    tu_backend b;
    idem_store *st = tu_backend_open(&b, "ctl-outbox");
    char out[8192];
    cr_assert_eq(run_ctl(&b, out, sizeof(out), (const char *[]){"outbox", NULL}), 0, "%s", out);
    cr_assert(strstr(out, "pending      0\n") != NULL, "empty outbox: %s", out);

    put_arg first = {"refunds.done", "refund-\"7\"", "id=7\n\x01\"", 7};
    put_arg second = {"refunds.done", "refund-8", "id=8", 4};
    cr_assert_eq(idem_store_run_txn(st, put, &first), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_run_txn(st, put, &second), IDEM_OK, "%s", idem_errmsg());

    cr_assert_eq(run_ctl(&b, out, sizeof(out), (const char *[]){"outbox", NULL}), 0, "%s", out);
    cr_assert(strstr(out, "pending      2\n") != NULL, "%s", out);
    cr_assert(strstr(out, "msg_id refund-\"7\"  7 bytes\n  id=7\\x0a\\x01\"\n") != NULL, "%s", out);
    cr_assert(strstr(out, "refund-8") == NULL, "only the oldest without --limit: %s", out);

    cr_assert_eq(
        run_ctl(&b, out, sizeof(out), (const char *[]){"--json", "outbox", "--limit", "5", NULL}),
        0, "%s", out);
    cr_assert(strstr(out, "{\"pending\":2,\"oldest\":[{\"seq\":") != NULL, "%s", out);
    cr_assert(strstr(out, "\"msg_id\":\"refund-\\\"7\\\"\",\"data_bytes\":7,"
                          "\"data\":\"id=7\\\\x0a\\\\x01\\\"\"}") != NULL,
              "%s", out);
    cr_assert(strstr(out, "\"msg_id\":\"refund-8\",\"data_bytes\":4,\"data\":\"id=8\"}]}\n") !=
                  NULL,
              "%s", out);
    tu_backend_close(&b);
}

static idem_code consumed(idem_txn *t, void *arg)
{
    (void)t, (void)arg;
    return IDEM_OK;
}

Test(idemctl_queues, markers_count_one_groups_markers_and_name_the_oldest)
{
    tu_backend b;
    idem_store *st = tu_backend_open(&b, "ctl-markers");
    /* "ledge" and "ledger-2" share bytes with "ledger": neither is counted in it. */
    const char *msgs[][2] = {{"ledger", "m1"}, {"ledger", "m2"},   {"ledger", "m3"},
                             {"ledge", "m4"},  {"ledger-2", "m5"}, {"ledger-2", "m6"}};
    for (size_t i = 0; i < sizeof(msgs) / sizeof(msgs[0]); i++) {
        cr_assert_eq(idem_consume(st, msgs[i][0], msgs[i][1], consumed, NULL), IDEM_CONSUME_ACK);
    }
    uint64_t first;
    cr_assert_eq(idem_consume_lookup(st, "ledger", "m1", &first), IDEM_OK);
    char out[4096], want[256];
    cr_assert_eq(run_ctl(&b, out, sizeof(out), (const char *[]){"markers", "ledger", NULL}), 0,
                 "%s", out);
    cr_assert(strstr(out, "group        ledger\nmarkers      3\noldest       ") != NULL, "%s", out);
    snprintf(want, sizeof(want),
             "{\"group\":\"ledger\",\"markers\":3,\"more\":false,"
             "\"oldest_ms\":%" PRIu64 "}\n",
             first);
    cr_assert_eq(
        run_ctl(&b, out, sizeof(out), (const char *[]){"--json", "markers", "ledger", NULL}), 0,
        "%s", out);
    cr_assert_str_eq(out, want);
    cr_assert_eq(
        run_ctl(&b, out, sizeof(out), (const char *[]){"markers", "ledger", "--limit", "2", NULL}),
        0, "%s", out);
    cr_assert(strstr(out, "markers      more than 2\n") != NULL, "%s", out);
    cr_assert_eq(run_ctl(&b, out, sizeof(out), (const char *[]){"markers", "nobody", NULL}), 0,
                 "%s", out);
    cr_assert_str_eq(out, "group        nobody\nmarkers      0\n");
    cr_assert_eq(run_ctl(&b, out, sizeof(out), (const char *[]){"markers", NULL}), 2);
    tu_backend_close(&b);
}

/* Puts one message with subject and msg_id and runs idemctl's outbox view (argv) on it. */
static void outbox_view(const char *tag, const char *subject, const char *msg_id,
                        const char *const *argv, char *out, size_t cap)
{
    tu_backend b;
    idem_store *st = tu_backend_open(&b, tag);
    put_arg m = {subject, msg_id, "x", 1};
    cr_assert_eq(idem_store_run_txn(st, put, &m), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(run_ctl(&b, out, cap, argv), 0, "%s", out);
    tu_backend_close(&b);
}

/* A review found that the header of idemctl_queues.c promises "neither a terminal nor a
 * JSON reader meets the store's raw bytes", but only data was escaped: subject and msg_id
 * (any bytes idem_outbox_put took) went out raw in the text view, and bytes >= 0x80 raw
 * in --json. */
Test(idemctl_queues, outbox_escapes_subject_and_msg_id_as_it_does_data)
{
    char out[8192];
    outbox_view("ctl-outbox-esc", "orders\x1b]0;owned\x07.done", "id-1\n  seq 99  subject fake",
                (const char *[]){"outbox", NULL}, out, sizeof(out));
    cr_expect(strchr(out, '\x1b') == NULL && strchr(out, '\x07') == NULL,
              "terminal escape bytes printed raw: %s", out);
    cr_expect(strstr(out, "\n  seq 99  subject fake") == NULL, "a forged line: %s", out);
}

Test(idemctl_queues, outbox_json_is_valid_utf8_for_any_msg_id)
{
    char out[8192];
    outbox_view("ctl-outbox-utf8", "orders.done", "id-\xff\xfe",
                (const char *[]){"--json", "outbox", NULL}, out, sizeof(out));
    cr_expect(strchr(out, '\xff') == NULL, "a raw 0xff byte in --json (not UTF-8): %s", out);
}

/* idemctl's queue verbs against a real store ($IDEMRPC_TEST_BACKEND: LMDB, or a schema of
 * its own in real PostgreSQL): what the toolkit put there, as the tool prints it; and the
 * step journals a real server's calls leave for its re-driver (journals, show). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

/* Runs idemctl (the store's --db or --pg, --pooler through tests/pooled.sh, then args,
 * NULL-terminated) and returns its exit status; out gets its stdout and stderr
 * (NUL-terminated, cut at cap). */
static int run_ctl(const tu_backend *b, char *out, size_t cap, const char *const *args)
{
    const char *argv[16] = {getenv("IDEMCTL"), b->dir ? "--db" : "--pg",
                            b->dir ? b->dir : b->conninfo};
    size_t n = 3;
    if (b->dir == NULL && tu_pg_pooler()) {
        argv[n++] = "--pooler";
    }
    for (; *args != NULL && n < 15; args++) {
        argv[n++] = *args;
    }
    cr_assert_not_null(argv[0], "IDEMCTL not set (meson test sets it)");
    return tu_run_captured(argv, out, cap);
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

/* ---- journals: a server with a re-driver, whose calls record steps ---- */

static tu_backend jb;
static tu_server js;
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool gate_open;
static bool undo_fails; /* the undo answers UNAVAILABLE: the compensation stays unfinished */

static idem_code reserve(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call, (void)arg;
    out->data = strdup("R1");
    out->len = out->data != NULL ? 2 : 0;
    return out->data != NULL ? IDEM_OK : IDEM_RESOURCE_EXHAUSTED;
}

/* jrn.T/Book: records its step, then waits for the test to open the gate (30 s at most,
 * a hang guard). */
static idem_code book(idem_call *call, void *arg)
{
    idem_step_result r;
    (void)arg;
    idem_code code = idem_call_step(call, "reserve", reserve, NULL, &r);
    if (code != IDEM_OK) {
        return code;
    }
    idem_step_result_clear(&r);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 30;
    pthread_mutex_lock(&gate_mu);
    while (!gate_open && pthread_cond_timedwait(&gate_cv, &gate_mu, &until) == 0) {
    }
    pthread_mutex_unlock(&gate_mu);
    return idem_call_reply(call, IDEM_OK, "booked", 6);
}

static idem_code unreserve(idem_call *call, const char *step, const idem_step_result *done,
                           void *arg)
{
    (void)step, (void)done, (void)arg;
    return __atomic_load_n(&undo_fails, __ATOMIC_SEQ_CST)
               ? idem_call_fail(call, IDEM_UNAVAILABLE, "inventory away")
               : IDEM_OK;
}

/* jrn.T/Refund: a step with an undo, then a final failure whose message a terminal must
 * not take raw. */
static idem_code refund(idem_call *call, void *arg)
{
    idem_step_result r;
    idem_step_opts o = {.undo = unreserve};
    (void)arg;
    idem_code code = idem_call_step_with(call, "reserve", reserve, NULL, &o, &r);
    if (code != IDEM_OK) {
        return code;
    }
    idem_step_result_clear(&r);
    return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "card \"declined\"\x1b[2J");
}

static void journals_setup(void)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = tu_backend_open(&jb, "ctl-journals");
    o.redrive_interval_ms = 3600000; /* lists the calls; no pass during a test */
    tu_server_create(&js, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_STEPS | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(js.srv, "jrn.T/Book", book, NULL, &m), IDEM_OK);
    cr_assert_eq(idem_server_register(js.srv, "jrn.T/Refund", refund, NULL, &m), IDEM_OK);
    tu_server_listen(&js);
}

static void journals_teardown(void)
{
    tu_server_destroy(&js, false);
    tu_backend_close(&jb);
}

TestSuite(idemctl_journals, .init = journals_setup, .fini = journals_teardown);

static idem_code call_once(const char *method, const char *key, idem_result *r)
{
    idem_client *c = tu_client_attempts(js.url, 10000, 1);
    idem_request req = {.method = method, .idempotency_key = key, .payload = "x", .payload_len = 1};
    idem_code code = idem_client_call(c, &req, r);
    idem_client_close(c);
    return code;
}

static void *book_thread(void *arg)
{
    idem_result r;
    (void)arg;
    cr_assert_eq(call_once("jrn.T/Book", "book-1", &r), IDEM_OK, "%s", r.message);
    idem_result_clear(&r);
    return NULL;
}

/* Awaits a listed journal with a recorded step (bounded: 5 s). */
static void await_journal_step(void)
{
    for (int i = 0; i < 500; i++) {
        uint8_t cursor[IDEM_JOURNAL_CURSOR] = {0};
        idem_journal_info j;
        if (idem_journal_next(jb.st, cursor, &j) == IDEM_OK && j.steps == 1) {
            return;
        }
        nanosleep(&(struct timespec){0, 10000000L}, NULL); /* polling the store, bounded */
    }
    cr_assert_fail("no journal with a step appeared");
}

Test(idemctl_journals, lists_a_running_call_with_its_step_record_owner_and_live_lease)
{
    pthread_t t;
    char out[8192];
    cr_assert_eq(pthread_create(&t, NULL, book_thread, NULL), 0);
    await_journal_step();
    cr_assert_eq(run_ctl(&jb, out, sizeof(out), (const char *[]){"journals", NULL}), 0, "%s", out);
    cr_expect(strstr(out, "jrn.T/Book") != NULL && strstr(out, " book-1 ") != NULL, "%s", out);
    cr_expect(strstr(out, " steps        1     0      0    in_progress ") != NULL, "%s", out);
    cr_expect(strstr(out, " live ") != NULL, "%s", out);
    cr_assert_eq(run_ctl(&jb, out, sizeof(out), (const char *[]){"--json", "journals", NULL}), 0,
                 "%s", out);
    cr_expect(strstr(out, "\"key\":\"book-1\",\"journal\":{\"state\":\"steps\",\"steps\":1,"
                          "\"undone\":0,\"fence\":") != NULL,
              "%s", out);
    cr_expect(strstr(out, ",\"listed\":true,\"runs\":0,\"failure\":null,\"failure_message\":null},"
                          "\"record\":\"in_progress\",\"owner\":") != NULL,
              "%s", out);
    cr_expect(strstr(out, ",\"lease\":\"live\",\"age_ms\":") != NULL, "%s", out);
    cr_assert_eq(
        run_ctl(&jb, out, sizeof(out), (const char *[]){"show", "jrn.T/Book", "book-1", NULL}), 0,
        "%s", out);
    cr_expect(strstr(out, "\njournal      steps, 1 step recorded (last by owner ") != NULL, "%s",
              out);
    cr_expect(strstr(out, "held by the re-driver, 0 re-runs\n") != NULL, "%s", out);

    pthread_mutex_lock(&gate_mu);
    gate_open = true;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
    cr_assert_eq(pthread_join(t, NULL), 0);
    cr_assert_eq(run_ctl(&jb, out, sizeof(out), (const char *[]){"journals", NULL}), 0, "%s", out);
    cr_expect_str_eq(out, "no journals\n", "the outcome removed the journal");
    cr_assert_eq(run_ctl(&jb, out, sizeof(out),
                         (const char *[]){"--json", "show", "jrn.T/Book", "book-1", NULL}),
                 0, "%s", out);
    cr_expect(strstr(out, ",\"journal\":null}\n") != NULL, "%s", out);
}

Test(idemctl_journals, show_and_journals_follow_a_compensation_left_unfinished)
{
    idem_result r;
    char out[8192];
    __atomic_store_n(&undo_fails, true, __ATOMIC_SEQ_CST);
    cr_assert_eq(call_once("jrn.T/Refund", "refund-1", &r), IDEM_UNAVAILABLE, "%s", r.message);
    idem_result_clear(&r);
    /* Released with its journal: no record, so show finds the journal the re-driver holds. */
    cr_assert_eq(
        run_ctl(&jb, out, sizeof(out), (const char *[]){"show", "jrn.T/Refund", "refund-1", NULL}),
        0, "%s", out);
    cr_expect(strstr(out, "state        no record (released") != NULL, "%s", out);
    cr_expect(strstr(out, "journal      compensating, 1 step recorded") != NULL, "%s", out);
    cr_expect(strstr(out, "compensation 0 of 1 undone, answering FAILED_PRECONDITION: card "
                          "\"declined\"\\x1b[2J\n") != NULL,
              "%s", out);
    cr_assert_eq(run_ctl(&jb, out, sizeof(out), (const char *[]){"--json", "journals", NULL}), 0,
                 "%s", out);
    cr_expect(strstr(out, "{\"state\":\"compensating\",\"steps\":1,\"undone\":0,") != NULL, "%s",
              out);
    cr_expect(strstr(out, "\"failure\":\"FAILED_PRECONDITION\",\"failure_message\":\"card "
                          "\\\"declined\\\"\\\\x1b[2J\"},\"record\":\"none\",\"owner\":0,"
                          "\"lease\":\"-\",\"age_ms\":null}") != NULL,
              "%s", out);

    __atomic_store_n(&undo_fails, false, __ATOMIC_SEQ_CST);
    cr_assert_eq(call_once("jrn.T/Refund", "refund-1", &r), IDEM_FAILED_PRECONDITION, "%s",
                 r.message);
    idem_result_clear(&r);
    cr_assert_eq(run_ctl(&jb, out, sizeof(out), (const char *[]){"journals", NULL}), 0, "%s", out);
    cr_expect_str_eq(out, "no journals\n", "the finished compensation removed the journal");
    cr_expect_eq(
        run_ctl(&jb, out, sizeof(out), (const char *[]){"show", "jrn.T/Refund", "refund-1", NULL}),
        1, "released for good, no journal: %s", out);
}

/* Dead letters a person can act on, against a real nats-server -js: the handler's own
 * reason in the dead letter (escaped, bounded), a message's headers as the library's
 * consumer shows them, and the dead letters listed, replayed and purged through the
 * library (idem_nats_dead_*) and through idemctl dead. Needs $IDEMRPC_TEST_NATS; skipped
 * without it. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <pty.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nats_util.h"

#define POLLS 100 /* a hang guard, not a timing assertion */

/* The key: the payload's bytes before '|' (any byte, a line break too). */
static idem_code bar_key(const void *data, size_t len, char *key, size_t cap, void *arg)
{
    (void)arg;
    const char *end = memchr(data, '|', len);
    size_t n = end != NULL ? (size_t)(end - (const char *)data) : len;
    if (n == 0 || n >= cap) {
        return IDEM_NOT_FOUND;
    }
    memcpy(key, data, n);
    key[n] = '\0';
    return IDEM_OK;
}

static idem_code refuse(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    (void)t, (void)m, (void)arg;
    return IDEM_INVALID_ARGUMENT;
}

/* Polls c until it dead-lettered want messages (or POLLS polls). */
static void poll_dead(idem_nats_consumer *c, uint64_t want)
{
    idem_nats_stats s = {0};
    for (int i = 0; i < POLLS && s.dead_lettered < want; i++) {
        idem_nats_consumer_poll(c, NULL);
        idem_nats_consumer_stats(c, &s);
    }
    cr_assert_eq(s.dead_lettered, want, "dead-lettered %llu of %llu (dead failures %llu)",
                 (unsigned long long)s.dead_lettered, (unsigned long long)want,
                 (unsigned long long)s.dead_failures);
}

/* The first dead letter of the test's stream, read with libnats itself. */
static natsMsg *first_dead_letter(nt *e)
{
    natsSubscription *sub = NULL;
    natsMsgList list = {0};
    natsMsg *m = NULL;
    cr_assert_eq(js_PullSubscribe(&sub, e->js, e->dead, NULL, NULL, NULL, NULL), NATS_OK);
    cr_assert_eq(natsSubscription_Fetch(&list, sub, 1, 2000, NULL), NATS_OK);
    cr_assert_eq(list.Count, 1);
    m = list.Msgs[0];
    list.Msgs[0] = NULL;
    natsMsgList_Destroy(&list);
    natsSubscription_Unsubscribe(sub);
    natsSubscription_Destroy(sub);
    return m;
}

Test(nats_dead, a_key_with_a_line_break_shows_escaped_in_its_dead_letter)
{
    nt e;
    idem_nats_consumer_opts o;
    const char *v = NULL;
    nt_setup(&e, "forge");
    nt_publish(&e, NULL, NULL, "k\r\nIdem-Forged: yes|amount=1");
    nt_opts(&e, &o, "forge");
    o.key_fn = bar_key;
    o.handler = refuse;
    idem_nats_consumer *c = nt_consumer(&e, &o);
    poll_dead(c, 1);
    idem_nats_consumer_close(c);
    natsMsg *m = first_dead_letter(&e);
    cr_expect_eq(natsMsgHeader_Get(m, "Idem-Forged", &v), NATS_NOT_FOUND, "forged: %s", v);
    cr_assert_eq(natsMsgHeader_Get(m, IDEM_NATS_KEY_HEADER, &v), NATS_OK);
    cr_expect_str_eq(v, "k\\x0d\\x0aIdem-Forged: yes");
    cr_assert_eq(natsMsgHeader_Get(m, IDEM_NATS_DEAD_REASON, &v), NATS_OK);
    cr_expect(strstr(v, "final failure (delivery 1): INVALID_ARGUMENT") == v, "%s", v);
    natsMsg_Destroy(m);
    nt_teardown(&e);
}

/* Fails with a reason: a line break, a quote, a byte past ASCII, and, for "long", more
 * text than the bound. */
static idem_code explain(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    (void)t, (void)arg;
    if (m->len >= 4 && memcmp(m->data, "long", 4) == 0) {
        return idem_nats_fail(m, IDEM_INVALID_ARGUMENT, "%0600d", 7);
    }
    return idem_nats_fail(m, IDEM_INVALID_ARGUMENT,
                          "amount %d below zero\r\nIdem-Forged: \"\xc3\xa9\"", -5);
}

static char reason_seen[512];

static void on_event(idem_nats_event ev, const idem_nats_msg *m, const char *reason, void *arg)
{
    (void)m, (void)arg;
    if (ev == IDEM_NATS_DEAD_LETTERED) {
        snprintf(reason_seen, sizeof(reason_seen), "%s", reason);
    }
}

Test(nats_dead, a_handlers_reason_goes_into_its_dead_letter_escaped_and_bounded)
{
    nt e;
    idem_nats_consumer_opts o;
    char reasons[4][256];
    nt_setup(&e, "why");
    nt_publish(&e, "refund-1", NULL, "amount=-5");
    nt_opts(&e, &o, "why");
    o.handler = explain;
    o.on_event = on_event;
    idem_nats_consumer *c = nt_consumer(&e, &o);
    poll_dead(c, 1);
    const char *want = "final failure (delivery 1): INVALID_ARGUMENT: amount -5 below "
                       "zero\\x0d\\x0aIdem-Forged: \"\\xc3\\xa9\"";
    cr_expect_str_eq(reason_seen, want);
    nt_publish(&e, "refund-2", NULL, "long");
    poll_dead(c, 2);
    idem_nats_consumer_close(c);
    cr_assert_eq(nt_dead_letters(&e, reasons, 4), 2);
    cr_expect_str_eq(reasons[0], want);
    cr_expect(strncmp(reasons[1], reason_seen, sizeof(reasons[1]) - 1) == 0, "%s", reasons[1]);
    const char *cut = strstr(reason_seen, "INVALID_ARGUMENT: 0000");
    cr_assert_not_null(cut, "%s", reason_seen);
    cut += strlen("INVALID_ARGUMENT: ");
    cr_expect_leq(strlen(cut), IDEM_NATS_MAX_REASON, "%zu bytes", strlen(cut));
    cr_expect(strlen(cut) > 3 && strcmp(cut + strlen(cut) - 3, "...") == 0, "%s", cut);
    nt_teardown(&e);
}

/* Keeps what a dead letter's headers say, as the consumer of the dead letters sees them. */
typedef struct seen {
    char reason[256], subject[64], key[64], extra[64];
    size_t n_headers;
} seen;

static idem_code archive(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    seen *s = arg;
    const char *extra = idem_nats_msg_header(m, "X-Extra");
    (void)t;
    snprintf(s->reason, sizeof(s->reason), "%s", idem_nats_msg_header(m, IDEM_NATS_DEAD_REASON));
    snprintf(s->subject, sizeof(s->subject), "%s", idem_nats_msg_header(m, IDEM_NATS_DEAD_SUBJECT));
    snprintf(s->key, sizeof(s->key), "%s", m->key);
    snprintf(s->extra, sizeof(s->extra), "%s", extra != NULL ? extra : "(none)");
    s->n_headers = m->n_headers;
    return IDEM_OK;
}

Test(nats_dead, the_librarys_consumer_reads_a_dead_letters_reason_from_its_headers)
{
    nt e;
    idem_nats_consumer_opts o;
    seen s = {0};
    nt_setup(&e, "arch");
    nt_publish(&e, "refund-3", NULL, "amount=-5");
    nt_opts(&e, &o, "why");
    o.handler = explain;
    idem_nats_consumer *c = nt_consumer(&e, &o);
    poll_dead(c, 1);
    idem_nats_consumer_close(c);
    nt_opts(&e, &o, "archive"); /* a consumer of the dead letters themselves */
    o.filter_subject = e.dead;
    o.dead_letter_subject = "nowhere.dead";
    o.handler = archive;
    o.handler_arg = &s;
    c = nt_consumer(&e, &o);
    nt_drain(&e, c, "archive");
    idem_nats_consumer_close(c);
    cr_expect(strstr(s.reason, "INVALID_ARGUMENT: amount -5 below zero") != NULL, "%s", s.reason);
    cr_expect_str_eq(s.subject, e.in);
    cr_expect_str_eq(s.key, "refund-3");
    cr_expect_str_eq(s.extra, "(none)");
    cr_expect_eq(s.n_headers, 6, "%zu", s.n_headers); /* reason, subject, seq, delivered, id, key */
    nt_teardown(&e);
}

static idem_code count_headers(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    seen *s = arg;
    (void)t;
    s->n_headers = m->n_headers;
    s->key[0] = m->headers_cut ? 'c' : '-';
    return IDEM_OK;
}

Test(nats_dead, a_handler_sees_at_most_max_headers_and_is_told_when_there_were_more)
{
    nt e;
    idem_nats_consumer_opts o;
    seen s = {0};
    natsMsg *m;
    jsPubAck *ack = NULL;
    char name[16];
    nt_setup(&e, "hdrs");
    cr_assert_eq(natsMsg_Create(&m, e.in, NULL, "amount=1", 8), NATS_OK);
    cr_assert_eq(natsMsgHeader_Set(m, IDEM_NATS_KEY_HEADER, "refund-14"), NATS_OK);
    for (int i = 0; i < IDEM_NATS_MAX_HEADERS + 8; i++) {
        snprintf(name, sizeof(name), "X-H-%d", i);
        cr_assert_eq(natsMsgHeader_Add(m, name, "v"), NATS_OK);
    }
    cr_assert_eq(js_PublishMsg(&ack, e.js, m, NULL, NULL), NATS_OK);
    jsPubAck_Destroy(ack);
    natsMsg_Destroy(m);
    nt_opts(&e, &o, "hdrs");
    o.handler = count_headers;
    o.handler_arg = &s;
    idem_nats_consumer *c = nt_consumer(&e, &o);
    nt_drain(&e, c, "hdrs");
    idem_nats_consumer_close(c);
    cr_expect_eq(s.n_headers, IDEM_NATS_MAX_HEADERS);
    cr_expect_eq(s.key[0], 'c', "headers_cut");
    nt_teardown(&e);
}

static bool ledger_closed;

static idem_code gate(idem_txn *t, const idem_nats_msg *m, void *arg)
{
    if (ledger_closed) {
        return idem_nats_fail(m, IDEM_FAILED_PRECONDITION, "ledger closed");
    }
    return ne_effect(t, m, arg);
}

typedef struct found {
    size_t n;
    uint64_t seq[8];
    char key[8][64];
} found;

static bool collect(const idem_nats_msg *m, void *arg)
{
    found *f = arg;
    if (f->n < 8) {
        f->seq[f->n] = m->stream_seq;
        snprintf(f->key[f->n], sizeof(f->key[0]), "%s", m->key ? m->key : "");
    }
    f->n++;
    return true;
}

static found dead_now(idem_nats_dead_letters *d)
{
    found f = {0};
    uint64_t next;
    cr_assert_eq(idem_nats_dead_list(d, 0, 100, collect, &f, &next), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(next, 0);
    return f;
}

/* A consumer whose handler refuses while the ledger is closed, with one dead letter. */
static idem_nats_consumer *one_dead_letter(nt *e, idem_nats_consumer_opts *o, const char *key,
                                           const char *msg_id)
{
    nt_publish(e, key, msg_id, "amount=1");
    nt_opts(e, o, "ledger");
    o->handler = gate;
    ledger_closed = true;
    idem_nats_consumer *c = nt_consumer(e, o);
    poll_dead(c, 1);
    return c;
}

Test(nats_dead, replay_publishes_the_original_again_under_its_key_and_removes_the_dead_letter)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_dead_letters *d;
    nt_setup(&e, "replay");
    idem_nats_consumer *c = one_dead_letter(&e, &o, "refund-9", NULL);
    cr_assert_eq(idem_nats_dead_open(&d, e.url, e.stream), IDEM_OK, "%s", idem_errmsg());
    found f = dead_now(d); /* message 1 is the original: no dead letter, passed over */
    cr_assert_eq(f.n, 1);
    cr_expect_eq(f.seq[0], 2);
    cr_expect_str_eq(f.key[0], "refund-9");
    cr_expect_eq(idem_nats_dead_replay(d, 1), IDEM_FAILED_PRECONDITION);
    cr_expect_eq(idem_nats_dead_purge(d, 1), IDEM_FAILED_PRECONDITION);
    cr_expect(strstr(idem_errmsg(), "no dead letter") != NULL, "%s", idem_errmsg());

    ledger_closed = false; /* the cause is fixed: the replay takes effect, once */
    cr_assert_eq(idem_nats_dead_replay(d, 2), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(dead_now(d).n, 0);
    cr_expect_eq(idem_nats_dead_replay(d, 2), IDEM_NOT_FOUND);
    nt_drain(&e, c, "ledger");
    cr_expect_eq(nt_effects(&e, "refund-9"), 1);
    nt_publish(&e, "refund-9", NULL, "amount=1"); /* the producer's own retry: a duplicate */
    nt_drain(&e, c, "ledger");
    cr_expect_eq(nt_effects(&e, "refund-9"), 1);
    idem_nats_consumer_close(c);
    idem_nats_dead_close(d);
    nt_teardown(&e);
}

Test(nats_dead, replay_inside_the_duplicate_window_of_its_original_keeps_the_dead_letter)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_dead_letters *d;
    nt_setup(&e, "window");
    idem_nats_consumer *c = one_dead_letter(&e, &o, "refund-10", "refund-10");
    cr_assert_eq(idem_nats_dead_open(&d, e.url, e.stream), IDEM_OK, "%s", idem_errmsg());
    found f = dead_now(d);
    cr_assert_eq(f.n, 1);
    cr_expect_eq(idem_nats_dead_replay(d, f.seq[0]), IDEM_ALREADY_EXISTS, "%s", idem_errmsg());
    cr_expect(strstr(idem_errmsg(), "duplicate window") != NULL, "%s", idem_errmsg());
    cr_expect_eq(dead_now(d).n, 1);
    cr_expect_eq(idem_nats_dead_purge(d, f.seq[0]), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(dead_now(d).n, 0);
    cr_expect_eq(idem_nats_dead_purge(d, f.seq[0]), IDEM_NOT_FOUND);
    idem_nats_consumer_close(c);
    idem_nats_dead_close(d);
    nt_teardown(&e);
}

/* A dead letter as a consumer writes it, with IDEM_NATS_DEAD_TRUNCATED when cut. */
static void put_dead_letter(nt *e, bool cut)
{
    natsMsg *m;
    jsPubAck *ack = NULL;
    cr_assert_eq(natsMsg_Create(&m, e->dead, NULL, "amo", 3), NATS_OK);
    cr_assert_eq(natsMsgHeader_Set(m, IDEM_NATS_DEAD_REASON, "final failure"), NATS_OK);
    cr_assert_eq(natsMsgHeader_Set(m, IDEM_NATS_DEAD_SUBJECT, e->in), NATS_OK);
    cr_assert_eq(natsMsgHeader_Set(m, IDEM_NATS_KEY_HEADER, "refund-11"), NATS_OK);
    if (cut) {
        cr_assert_eq(natsMsgHeader_Set(m, IDEM_NATS_DEAD_TRUNCATED, "8"), NATS_OK);
    }
    cr_assert_eq(js_PublishMsg(&ack, e->js, m, NULL, NULL), NATS_OK);
    jsPubAck_Destroy(ack);
    natsMsg_Destroy(m);
}

Test(nats_dead, replay_refuses_a_cut_payload_and_open_a_missing_stream_or_broker)
{
    nt e;
    idem_nats_dead_letters *d;
    nt_setup(&e, "cut");
    put_dead_letter(&e, true);
    cr_assert_eq(idem_nats_dead_open(&d, e.url, e.stream), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(idem_nats_dead_replay(d, 1), IDEM_FAILED_PRECONDITION);
    cr_expect(strstr(idem_errmsg(), "first bytes") != NULL, "%s", idem_errmsg());
    cr_expect_eq(dead_now(d).n, 1);
    idem_nats_dead_close(d);
    cr_expect_eq(idem_nats_dead_open(&d, e.url, "NoSuchStream"), IDEM_NOT_FOUND);
    cr_expect_null(d);
    cr_expect_eq(idem_nats_dead_open(&d, "nats://127.0.0.1:1", e.stream), IDEM_UNAVAILABLE);
    cr_expect_eq(idem_nats_dead_open(&d, e.url, ""), IDEM_INVALID_ARGUMENT);
    idem_nats_dead_close(NULL);
    nt_teardown(&e);
}

/* Runs idemctl --nats url with args (NULL-terminated), stdin from /dev/null (no terminal),
 * and returns its exit status; out gets its stdout and stderr. */
/* argv: idemctl --nats url, then args (NULL-terminated). */
static void ctl_argv(const char *argv[16], const char *url, const char *const *args)
{
    size_t n = 3;
    argv[0] = getenv("IDEMCTL"), argv[1] = "--nats", argv[2] = url;
    for (; *args != NULL && n < 15; args++) {
        argv[n++] = *args;
    }
    argv[n] = NULL;
    cr_assert_not_null(argv[0], "IDEMCTL not set (meson test sets it)");
}

static int run_ctl(const char *url, char *out, size_t cap, const char *const *args)
{
    const char *argv[16];
    ctl_argv(argv, url, args);
    return tu_run_captured(argv, out, cap);
}

#define CTL(e, out, ...) run_ctl((e)->url, out, sizeof(out), (const char *[]){__VA_ARGS__, NULL})

Test(nats_dead, idemctl_lists_dead_letters_with_their_reasons)
{
    nt e;
    idem_nats_consumer_opts o;
    char out[8192];
    nt_setup(&e, "ctlls");
    idem_nats_consumer *c = one_dead_letter(&e, &o, "refund-\"12\"", NULL);
    idem_nats_consumer_close(c);
    cr_assert_eq(CTL(&e, out, "dead", "list", e.stream), 0, "%s", out);
    cr_expect(strstr(out, "dead letter 2\n  reason     final failure (delivery 1): "
                          "FAILED_PRECONDITION: ledger closed\n") != NULL,
              "%s", out);
    cr_expect(strstr(out, "  key        refund-\"12\"\n  data       8 bytes: amount=1\n") != NULL,
              "%s", out);
    cr_expect(strstr(out, "1 dead letters\n") != NULL, "%s", out);
    cr_assert_eq(CTL(&e, out, "--json", "dead", "list", e.stream), 0, "%s", out);
    cr_expect(strstr(out, "\"dead\":[{\"seq\":2,\"reason\":\"final failure (delivery 1): "
                          "FAILED_PRECONDITION: ledger closed\",\"subject\":") != NULL,
              "%s", out);
    cr_expect(strstr(out, "\"stream_seq\":1,\"delivered\":1,\"key\":\"refund-\\\"12\\\"\","
                          "\"truncated_from\":null,\"data_bytes\":8,\"data\":\"amount=1\"}],"
                          "\"next\":0}\n") != NULL,
              "%s", out);
    cr_expect_eq(CTL(&e, out, "dead", "list", "NoSuchStream"), 1, "%s", out);
    cr_expect(strstr(out, "no stream NoSuchStream") != NULL, "%s", out);
    cr_expect_eq(run_ctl("nats://127.0.0.1:1", out, sizeof(out),
                         (const char *[]){"dead", "list", e.stream, NULL}),
                 1, "%s", out);
    cr_expect_eq(CTL(&e, out, "dead", "replay", e.stream), 2, "%s", out);
    cr_expect(strstr(out, "dead replay takes SEQ or --all") != NULL, "%s", out);
    cr_expect_eq(CTL(&e, out, "dead", "show", e.stream), 2, "%s", out);
    nt_teardown(&e);
}

Test(nats_dead, idemctl_replays_and_purges_only_when_confirmed)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_dead_letters *d;
    char out[8192];
    nt_setup(&e, "ctlrp");
    idem_nats_consumer *c = one_dead_letter(&e, &o, "refund-13", NULL);
    cr_assert_eq(idem_nats_dead_open(&d, e.url, e.stream), IDEM_OK, "%s", idem_errmsg());
    ledger_closed = false;
    cr_expect_eq(CTL(&e, out, "dead", "replay", e.stream, "2"), 3, "no terminal: %s", out);
    cr_expect(strstr(out, "confirm on a terminal, or give --yes") != NULL, "%s", out);
    cr_expect_eq(CTL(&e, out, "dead", "purge", e.stream, "--all"), 3, "%s", out);
    cr_expect_eq(dead_now(d).n, 1);
    cr_expect_eq(CTL(&e, out, "dead", "replay", e.stream, "1", "--yes"), 1, "%s", out);
    cr_expect(strstr(out, "is no dead letter") != NULL, "%s", out);
    cr_assert_eq(CTL(&e, out, "--json", "dead", "replay", e.stream, "--all", "--yes"), 0, "%s",
                 out);
    cr_expect(strstr(out, "\"verb\":\"replay\",\"done\":1,\"failed\":0}") != NULL, "%s", out);
    cr_expect_eq(dead_now(d).n, 0);
    nt_drain(&e, c, "ledger");
    cr_expect_eq(nt_effects(&e, "refund-13"), 1);

    put_dead_letter(&e, true);
    put_dead_letter(&e, false);
    cr_expect_eq(CTL(&e, out, "dead", "replay", e.stream, "--all", "--yes"), 1, "%s", out);
    cr_expect(strstr(out, "FAILED_PRECONDITION") != NULL, "the cut one: %s", out);
    cr_expect_eq(dead_now(d).n, 1);
    cr_assert_eq(CTL(&e, out, "dead", "purge", e.stream, "--all", "--yes"), 0, "%s", out);
    cr_expect(strstr(out, "purged ") != NULL, "%s", out);
    cr_expect_eq(dead_now(d).n, 0);
    cr_expect_eq(nt_stream_msgs(&e), 3, "the original and the two replays stay");
    idem_nats_consumer_close(c);
    idem_nats_dead_close(d);
    nt_teardown(&e);
}

/* Runs idemctl --nats url args on a terminal of its own, answering `answer` to its
 * question; returns its exit status, out its terminal's output. */
static int run_ctl_on_tty(const char *url, const char *answer, char *out, size_t cap,
                          const char *const *args)
{
    const char *argv[16];
    size_t got = 0;
    int master;
    ctl_argv(argv, url, args);
    pid_t pid = forkpty(&master, NULL, NULL, NULL);
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    for (ssize_t r; got + 1 < cap && (r = read(master, out + got, cap - 1 - got)) > 0;) {
        got += (size_t)r;
        out[got] = '\0';
        if (strstr(out, "[y/N] ") != NULL && answer != NULL) {
            cr_assert_eq(write(master, answer, strlen(answer)), (ssize_t)strlen(answer));
            answer = NULL;
        }
    }
    out[got] = '\0';
    close(master);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

Test(nats_dead, idemctl_asks_on_a_terminal_before_it_purges)
{
    nt e;
    idem_nats_dead_letters *d;
    char out[8192];
    nt_setup(&e, "ctltty");
    put_dead_letter(&e, false);
    cr_assert_eq(idem_nats_dead_open(&d, e.url, e.stream), IDEM_OK, "%s", idem_errmsg());
    const char *const purge[] = {"dead", "purge", e.stream, "1", NULL};
    cr_expect_eq(run_ctl_on_tty(e.url, "n\n", out, sizeof(out), purge), 3, "%s", out);
    cr_expect(strstr(out, "purge 1 dead letter of stream ") != NULL, "%s", out);
    cr_expect_eq(dead_now(d).n, 1);
    cr_expect_eq(run_ctl_on_tty(e.url, "y\n", out, sizeof(out), purge), 0, "%s", out);
    cr_expect(strstr(out, "purged 1") != NULL, "%s", out);
    cr_expect_eq(dead_now(d).n, 0);
    idem_nats_dead_close(d);
    nt_teardown(&e);
}

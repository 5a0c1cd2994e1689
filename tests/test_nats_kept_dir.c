/* The edges of the relay's per-stream loss detection (issue 41; a stranger's review found
 * each on 873d00c): a stream past the directory's 64, a kept log of the release before
 * the directory, two relays keeping out of order, a directory record that does not
 * decode. In each, every message kept from the stream that forgot is published again.
 * Needs $IDEMRPC_TEST_NATS; runs on LMDB (nats_kept_dir) and PostgreSQL (nats_kept_dir_pg). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "nats_util.h"
#include "toolkit_internal.h"

#define WAIT_ROUNDS 150          /* relay rounds: a hang guard */
#define EXTRA IDEM__KEPT_STREAMS /* streams acked after A: A is the 65th, acked longest ago */

typedef struct put_args {
    int from, to;
    const char *subject;
    char (*subjects)[64]; /* when set: order from+i to subjects[i] */
} put_args;

static idem_code put_orders(idem_txn *t, void *arg)
{
    put_args *a = arg;
    idem_code code = IDEM_OK;
    if (a->subjects == NULL) {
        return nt_put_orders(t, a->subject, a->from, a->to);
    }
    for (int i = a->from; code == IDEM_OK && i < a->to; i++) {
        code = nt_put_orders(t, a->subjects[i - a->from], i, i + 1);
    }
    return code;
}

/* Runs r until the outbox is empty. */
static void relay_all(nt *e, idem_nats_relay *r)
{
    uint64_t pending = 1;
    for (int i = 0; i < WAIT_ROUNDS && pending > 0; i++) {
        if (idem_nats_relay_run_once(r, NULL) != IDEM_OK) {
            nats_Sleep(20);
        }
        cr_assert_eq(idem_outbox_pending(e->st, &pending), IDEM_OK, "%s", idem_errmsg());
    }
    cr_assert_eq(pending, 0, "the outbox never emptied");
}

static void commit_and_relay(nt *e, idem_nats_relay *r, put_args a)
{
    cr_assert_eq(idem_store_run_txn(e->st, put_orders, &a), IDEM_OK, "%s", idem_errmsg());
    relay_all(e, r);
}

static void add_stream(nt *e, const char *name, const char *subject)
{
    jsStreamConfig sc;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    const char *subjects[] = {subject};
    jsStreamConfig_Init(&sc);
    sc.Name = name;
    sc.Subjects = subjects;
    sc.SubjectsLen = 1;
    cr_assert_eq(js_AddStream(&si, e->js, &sc, NULL, &jerr), NATS_OK, "stream: %d", (int)jerr);
    jsStreamInfo_Destroy(si);
}

/* A's 5 orders, then one order to each of `extra` other streams: with 64, A leaves the
 * directory (it overflows). A forgets; then either its next publish (lands at sequence
 * 1) or a relay that comes back must find the loss: the publish by the relay's own list
 * of each stream's newest, the returning relay by the directory (or, overflowed, by
 * publishing every kept message again). */
static void lose_a_stream_among(int extra, bool restart)
{
    nt a;
    idem_nats_relay_counts s;
    static char names[EXTRA][48], subjects[EXTRA][64];
    nt_setup(&a, "va");
    for (int i = 0; i < extra; i++) {
        snprintf(names[i], sizeof(names[i]), "%sX%d", a.stream, i);
        snprintf(subjects[i], sizeof(subjects[i]), "%.47s.in", names[i]);
        add_stream(&a, names[i], subjects[i]);
    }
    idem_nats_relay *r = nt_relay(&a);
    commit_and_relay(&a, r, (put_args){0, 5, a.in, NULL});
    commit_and_relay(&a, r, (put_args){5, 5 + extra, NULL, subjects});
    cr_assert_eq(nt_stream_msgs(&a), 5);
    nt_forget_stream(&a);
    if (restart) {
        idem_nats_relay_close(r);
        r = nt_relay(&a);
        cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
    } else {
        cr_assert_eq(
            idem_store_run_txn(a.st, put_orders, &(put_args){5 + extra, 6 + extra, a.in, NULL}),
            IDEM_OK);
    }
    relay_all(&a, r);
    relay_all(&a, r);
    idem_nats_relay_stats(r, &s);
    uint64_t want = restart ? 5 : 6;
    cr_expect_eq(nt_stream_msgs(&a), want,
                 "stream A holds %llu of the %llu orders sent to it; losses %llu, restored %llu",
                 (unsigned long long)nt_stream_msgs(&a), (unsigned long long)want,
                 (unsigned long long)s.losses, (unsigned long long)s.restored);
    if (restart && extra == EXTRA) { /* A left the directory: every kept message goes again */
        cr_expect_geq(s.restored, 5 + (uint64_t)extra, "restored %llu",
                      (unsigned long long)s.restored);
    } else {
        cr_expect_eq(s.losses, 1, "losses %llu", (unsigned long long)s.losses);
    }
    idem_nats_relay_close(r);
    for (int i = 0; i < extra; i++) {
        js_DeleteStream(a.js, names[i], NULL, NULL);
    }
    nt_teardown(&a);
}

Test(nats_kept_dir, a_loss_in_the_65th_stream_is_found_by_its_next_publish)
{
    lose_a_stream_among(EXTRA, false);
}

Test(nats_kept_dir, a_loss_in_the_65th_stream_is_found_by_a_relay_that_comes_back)
{
    lose_a_stream_among(EXTRA, true);
}

/* With 64 streams A stays in the directory. */
Test(nats_kept_dir, a_loss_in_the_64th_stream_is_found_by_its_next_publish)
{
    lose_a_stream_among(EXTRA - 1, false);
}

Test(nats_kept_dir, a_loss_in_the_64th_stream_is_found_by_a_relay_that_comes_back)
{
    lose_a_stream_among(EXTRA - 1, true);
}

static idem_code drop_directory(idem_txn *t, void *arg)
{
    (void)arg;
    const uint8_t k = 'N';
    return idem_txn_del(t, IDEM_OUTBOX_DB, &k, 1);
}

/* The previous release kept A's 5 orders (the same kept log, no 'N' record); the upgraded
 * relay keeps one order of B; A forgets; a relay that comes back publishes every kept
 * message again (the directory cannot name what the previous release kept). */
Test(nats_kept_dir, a_loss_of_what_the_previous_release_kept_is_found_after_one_keep_of_the_new)
{
    nt a, b;
    idem_nats_relay_counts s;
    nt_setup(&a, "ua");
    nt_setup(&b, "ub");
    idem_nats_relay *r = nt_relay(&a);
    commit_and_relay(&a, r, (put_args){0, 5, a.in, NULL});
    idem_nats_relay_close(r);
    cr_assert_eq(idem_store_run_txn(a.st, drop_directory, NULL), IDEM_OK, "%s", idem_errmsg());
    r = nt_relay(&a); /* the upgraded relay */
    commit_and_relay(&a, r, (put_args){5, 6, b.in, NULL});
    nt_forget_stream(&a);
    idem_nats_relay_close(r);
    r = nt_relay(&a);
    relay_all(&a, r);
    relay_all(&a, r);
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(nt_stream_msgs(&a), 5,
                 "stream A holds %llu of the 5 orders the previous release kept; restored %llu",
                 (unsigned long long)nt_stream_msgs(&a), (unsigned long long)s.restored);
    cr_expect_geq(s.restored, 6, "restored %llu", (unsigned long long)s.restored);
    idem_nats_relay_close(r);
    nt_teardown(&b);
    nt_teardown(&a);
}

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Two relays on one store (nats.h allows it) both publish orders 0..9 to A: the broker
 * stores them once, at sequences 1..10, and acks each relay (the second's as
 * duplicates). The second relay keeps first (orders 4..9), then the first keeps its ten
 * acks: orders 0..3 are still in the outbox and kept, 4..9 are not (already kept). The
 * directory's entry for A must still name A's newest kept message (order 9 at sequence
 * 10), not order 3 at sequence 4: the broker then loses A's tail (5..10, unsynced) and a
 * relay that comes back must find it and publish orders 4..9 again. */
Test(nats_kept_dir, two_relays_keeping_out_of_order_still_find_a_lost_tail)
{
    nt a;
    idem_nats_relay_counts s;
    idem_outbox_ack acks[10] = {0};
    char id[32];
    idem__kept_dir *d = malloc(sizeof(*d));
    cr_assert_not_null(d);
    nt_setup(&a, "wa");
    cr_assert_eq(idem_store_run_txn(a.st, put_orders, &(put_args){0, 10, a.in, NULL}), IDEM_OK);
    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof(id), "order-%d", i);
        nt_publish(&a, NULL, id, "amount=1");
        acks[i].seq = (uint64_t)i;
        acks[i].stream_seq = (uint64_t)i + 1;
        snprintf(acks[i].stream, sizeof(acks[i].stream), "%s", a.stream);
    }
    uint64_t now = wall_ms();
    cr_assert_eq(idem_outbox_keep(a.st, acks + 4, 6, now), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_outbox_keep(a.st, acks, 10, now), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem__kept_dir_read(a.st, d), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(d->n, 1);
    cr_expect_eq(d->s[0].ack.stream_seq, 10,
                 "the directory names %s at sequence %llu as A's newest", d->s[0].msg_id,
                 (unsigned long long)d->s[0].ack.stream_seq);
    nt_forget_stream(&a); /* the tail 5..10 lost: A holds orders 0..3 at 1..4 */
    for (int i = 0; i < 4; i++) {
        snprintf(id, sizeof(id), "order-%d", i);
        nt_publish(&a, NULL, id, "amount=1");
    }
    idem_nats_relay *r = nt_relay(&a);
    relay_all(&a, r);
    relay_all(&a, r);
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(nt_stream_msgs(&a), 10,
                 "stream A holds %llu of the 10 orders the relays kept; losses %llu",
                 (unsigned long long)nt_stream_msgs(&a), (unsigned long long)s.losses);
    cr_expect_eq(s.losses, 1, "losses %llu", (unsigned long long)s.losses);
    idem_nats_relay_close(r);
    free(d);
    nt_teardown(&a);
}

static idem_code corrupt_directory(idem_txn *t, void *arg)
{
    (void)arg;
    const uint8_t k = 'N', v[3] = {0, 1, 0}; /* one entry announced, none there */
    return idem_txn_put(t, IDEM_OUTBOX_DB, &k, 1, v, sizeof(v));
}

/* The directory is an index of the kept log (each stream's newest): a bad record of it
 * should cost the per-stream check, not every publish. Orders 0..4 relayed and kept, the
 * directory record damaged, orders 5..9 committed: a relay must still publish them. */
Test(nats_kept_dir, a_bad_stream_directory_record_does_not_stop_the_outbox)
{
    nt a;
    uint64_t pending = 1;
    nt_setup(&a, "ca");
    idem_nats_relay *r = nt_relay(&a);
    commit_and_relay(&a, r, (put_args){0, 5, a.in, NULL});
    idem_nats_relay_close(r);
    cr_assert_eq(idem_store_run_txn(a.st, corrupt_directory, NULL), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_store_run_txn(a.st, put_orders, &(put_args){5, 10, a.in, NULL}), IDEM_OK);
    r = nt_relay(&a);
    idem_code code = IDEM_OK;
    for (int i = 0; i < 20 && pending > 0; i++) {
        code = idem_nats_relay_run_once(r, NULL);
        cr_assert_eq(idem_outbox_pending(a.st, &pending), IDEM_OK, "%s", idem_errmsg());
    }
    cr_expect_eq(pending, 0, "%llu orders never published; the relay's last round: %s (%s)",
                 (unsigned long long)pending, idem_code_name(code), idem_errmsg());
    cr_expect_eq(nt_stream_msgs(&a), 10);
    idem_nats_relay_close(r);
    nt_teardown(&a);
}

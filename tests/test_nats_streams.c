/* A relay that publishes to several streams finds a loss in any of them (issue 41): a
 * stream that forgot what it acked while another stream was acked last is found by the
 * next publish to it and by a relay that comes back, and its kept messages are published
 * again. The stream directory behind it keeps the newest kept message of each stream and
 * forgets a stream once all its kept messages expired. Needs $IDEMRPC_TEST_NATS; runs on
 * LMDB (nats_streams) and PostgreSQL (nats_streams_pg). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

#include "nats_util.h"
#include "toolkit_internal.h"

/* Orders 0..4 to stream A, order 5 to stream B (acked last), then A forgets. restart:
 * the relay comes back (a new one on the store) before anything else; else order 6 goes
 * to A on the same relay. Either way A must end up holding every order sent to it. */
static void lose_stream_acked_before_another(bool restart)
{
    nt a, b;
    idem_nats_relay_counts s;
    nt_setup(&a, "sa");
    nt_setup(&b, "sb");
    idem_nats_relay *r = nt_relay(&a);
    nt_commit_and_relay(&a, r, a.in, 0, 5);
    nt_commit_and_relay(&a, r, b.in, 5, 6);
    nt_forget_stream(&a);
    if (restart) {
        idem_nats_relay_close(r);
        r = nt_relay(&a);
        cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
    } else {
        nt_commit_and_relay(&a, r, a.in, 6, 7); /* lands at sequence 1: A went back */
    }
    for (int i = 0; i < 3; i++) { /* the restored ones, published again */
        cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
    }
    idem_nats_relay_stats(r, &s);
    uint64_t want = restart ? 5 : 6;
    cr_expect_eq(nt_stream_msgs(&a), want,
                 "stream A holds %llu of the %llu orders sent to it; losses %llu, restored %llu",
                 (unsigned long long)nt_stream_msgs(&a), (unsigned long long)want,
                 (unsigned long long)s.losses, (unsigned long long)s.restored);
    cr_expect_eq(s.losses, 1);
    cr_expect_eq(nt_stream_msgs(&b), 1, "B's order, restored too, is deduplicated");
    idem_nats_relay_close(r);
    nt_teardown(&b);
    nt_teardown(&a);
}

Test(nats_streams, a_loss_in_a_stream_acked_before_another_is_found_by_its_next_publish)
{
    lose_stream_acked_before_another(false);
}

Test(nats_streams, a_loss_in_a_stream_acked_before_another_is_found_by_a_relay_that_comes_back)
{
    lose_stream_acked_before_another(true);
}

/* ---- the stream directory on its own (no broker) ---- */

static idem_code put_to_streams(idem_txn *t, void *arg)
{
    int *n = arg;
    char subject[32];
    idem_code code = IDEM_OK;
    for (int i = 0; i < *n && code == IDEM_OK; i++) {
        snprintf(subject, sizeof(subject), "s%d.in", i);
        code = nt_put_orders(t, subject, i, i + 1);
    }
    return code;
}

static const idem__kept_stream *entry(const idem__kept_dir *d, const char *stream)
{
    for (size_t j = 0; j < d->n; j++) {
        if (strcmp(d->s[j].ack.stream, stream) == 0) {
            return &d->s[j];
        }
    }
    return NULL;
}

Test(nats_streams, the_directory_keeps_each_streams_newest_until_its_messages_leave)
{
    nt e;
    int n = IDEM__KEPT_STREAMS + 3; /* 65 streams: one more than the directory holds */
    idem_outbox_ack acks[IDEM__KEPT_STREAMS + 3] = {0};
    idem__kept_dir *d = malloc(sizeof(*d));
    size_t dropped;
    cr_assert_not_null(d);
    nt_setup(&e, "sd");
    cr_assert_eq(idem_store_run_txn(e.st, put_to_streams, &n), IDEM_OK, "%s", idem_errmsg());
    for (int i = 0; i < n; i++) {  /* streams S0, S1, S0, S1, then S4, S5, ... S66 */
        acks[i].seq = (uint64_t)i; /* the outbox numbers its messages from 0 */
        acks[i].stream_seq = 100 + (uint64_t)i;
        snprintf(acks[i].stream, sizeof(acks[i].stream), "S%d", i < 4 ? i % 2 : i);
    }
    cr_assert_eq(idem_outbox_keep(e.st, acks, 4, 1000), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem__kept_dir_read(e.st, d), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(d->n, 2);
    cr_expect_eq(entry(d, "S0")->ack.stream_seq, 102, "S0's newest is the later of its two");
    cr_expect_str_eq(entry(d, "S1")->msg_id, "order-3");

    cr_assert_eq(idem_outbox_keep(e.st, acks + 4, 60, 2000), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_outbox_keep(e.st, acks + 64, 3, 2000), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem__kept_dir_read(e.st, d), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(d->n, IDEM__KEPT_STREAMS);
    cr_expect_null(entry(d, "S0"), "the stream acked longest ago gave way");
    cr_expect_not_null(entry(d, "S1"));
    cr_expect_not_null(entry(d, "S66"));

    cr_assert_eq(idem_outbox_kept_expire(e.st, 1500, IDEM_OUTBOX_MAX_BATCH, &dropped), IDEM_OK);
    cr_assert_eq(dropped, 4);
    cr_assert_eq(idem__kept_dir_read(e.st, d), IDEM_OK, "%s", idem_errmsg());
    cr_expect_null(entry(d, "S1"), "every message kept from S1 expired");
    cr_expect_eq(d->n, IDEM__KEPT_STREAMS - 1);
    cr_assert_eq(idem_outbox_kept_restore(e.st, IDEM_OUTBOX_MAX_BATCH, &dropped), IDEM_OK);
    cr_assert_eq(dropped, 63);
    cr_assert_eq(idem__kept_dir_read(e.st, d), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(d->n, 0, "nothing is kept once every message is back in the outbox");
    free(d);
    nt_teardown(&e);
}

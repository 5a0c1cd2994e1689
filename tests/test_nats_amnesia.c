/* A broker that forgets what it acked (issue 41): JetStream acks a publish before its file
 * store synced it, so a crash of its host loses the messages acked since the last sync.
 * The test makes that power cut on a real nats-server (scripts/services.sh: freeze-nats
 * copies its store with the broker stopped; amnesia-nats kills it and starts it on the
 * copy) with the outbox relay and a durable consumer on either side, and every committed
 * message must still take effect once. Then the other side of keeping: a clean restart
 * publishes nothing again, the horizon follows what the broker reports, and the kept log
 * on its own. Needs $IDEMRPC_TEST_NATS and $IDEMRPC_SERVICES; runs on LMDB
 * (nats_amnesia) and PostgreSQL (nats_amnesia_pg). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_util.h"

#define ORDERS 40
#define WAIT_ROUNDS 150 /* relay round + consumer poll each: a hang guard, not timing */

/* Commits orders [from, to) with their outbox messages and relays them until acked (the
 * broker may be starting: rounds that fail meanwhile are paced, not counted). */
static void commit_and_relay(nt *e, idem_nats_relay *r, int from, int to)
{
    nt_commit_and_relay(e, r, e->in, from, to);
    cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
}

static void services(const char *what)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s %s", getenv("IDEMRPC_SERVICES"), what);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

static int applied(nt *e)
{
    char key[32];
    int n = 0;
    for (int i = 0; i < ORDERS; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        n += nt_effects(e, key) > 0;
    }
    return n;
}

Test(nats_amnesia, a_broker_that_loses_acked_messages_still_applies_each_committed_one_once)
{
    nt e;
    idem_nats_relay_opts ro;
    idem_nats_relay *r;
    idem_nats_consumer_opts co;
    idem_nats_relay_counts s;
    char key[32];
    if (getenv("IDEMRPC_SERVICES") == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set: cannot cut the broker's power");
    }
    nt_setup(&e, "amnesia");
    idem_nats_relay_opts_init(&ro);
    ro.url = e.url;
    cr_assert_eq(idem_nats_relay_open(&r, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    nt_opts(&e, &co, "credit");
    co.fetch_wait_ms = 100;
    idem_nats_consumer *c = nt_consumer(&e, &co); /* the durable, before the copy */
    commit_and_relay(&e, r, 0, ORDERS / 2);
    services("freeze-nats");                     /* what the broker's disk holds now */
    commit_and_relay(&e, r, ORDERS / 2, ORDERS); /* acked, not on that disk */
    services("amnesia-nats");
    for (int i = 0; i < WAIT_ROUNDS && (applied(&e) < ORDERS || !nt_settled(&e, "credit")); i++) {
        (void)idem_nats_relay_run_once(r, NULL); /* fails while the broker is away */
        (void)idem_nats_consumer_poll(c, NULL);
    }
    for (int i = 0; i < ORDERS; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        cr_expect_eq(nt_effects(&e, key), 1, "%s: %ld effects", key, nt_effects(&e, key));
    }
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(s.losses, 1, "%llu losses found", (unsigned long long)s.losses);
    cr_expect_geq(s.restored, ORDERS / 2, "%llu restored", (unsigned long long)s.restored);
    idem_nats_consumer_close(c);
    idem_nats_relay_close(r);
    nt_teardown(&e);
}

static idem_nats_relay_counts counts(idem_nats_relay *r)
{
    idem_nats_relay_counts s;
    idem_nats_relay_stats(r, &s);
    return s;
}

/* The other side: what the broker did not lose is not published again (a clean restart
 * syncs the file store), and a kept message leaves the store once keep_ms has passed. */
Test(nats_amnesia, keeps_acked_messages_for_keep_ms_and_a_clean_restart_loses_none)
{
    nt e;
    idem_nats_relay_opts ro;
    idem_nats_relay *r;
    idem_outbox_kept_info k;
    if (getenv("IDEMRPC_SERVICES") == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set: cannot restart the broker");
    }
    nt_setup(&e, "kept");
    idem_nats_relay_opts_init(&ro);
    ro.url = e.url;
    ro.keep_ms = 60000;
    cr_assert_eq(idem_nats_relay_open(&r, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    commit_and_relay(&e, r, 0, 10);
    cr_assert_eq(idem_outbox_kept(e.st, &k), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(k.count, 10);
    cr_expect_str_eq(k.newest_msg_id, "order-9");
    cr_expect_eq(counts(r).kept, 10);
    services("restart-nats");
    commit_and_relay(&e, r, 10, 11); /* acked: the relay reconnected and checked */
    cr_expect_eq(counts(r).losses, 0, "a clean restart taken for a loss");
    cr_expect_eq(counts(r).kept, 11);
    idem_nats_relay_close(r);
    /* The same store, a relay whose horizon is over for all of them once the broker has
     * answered it for that long (1 ms: its second round). */
    ro.keep_ms = 1;
    cr_assert_eq(idem_nats_relay_open(&r, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    for (int i = 0; i < 50 && (i < 2 || counts(r).kept > 0); i++) {
        cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
        nats_Sleep(2);
    }
    cr_expect_eq(counts(r).kept, 0);
    cr_assert_eq(idem_outbox_kept(e.st, &k), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(k.count, 0);
    idem_nats_relay_close(r);
    nt_teardown(&e);
}

/* Acks for outbox messages 0..n-1 as if the broker stored them at 100 + seq. */
static void fake_acks(idem_outbox_ack *a, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        a[i] = (idem_outbox_ack){.seq = i, .stream_seq = 100 + i};
        snprintf(a[i].stream, sizeof(a[i].stream), "S");
    }
}

static void expect_peek(idem_store *st, const char *const *ids, size_t n)
{
    idem_outbox_msg m[4];
    size_t got;
    cr_assert_eq(idem_outbox_peek(st, m, 4, &got), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(got, n);
    for (size_t i = 0; i < got && i < n; i++) {
        cr_expect_str_eq(m[i].msg_id, ids[i]);
    }
    idem_outbox_msgs_free(m, got);
}

/* The store's side alone: a relay that crashes half way through a restore leaves the
 * oldest kept, the newest back in the outbox; the rest come back before it, in order. */
Test(nats_amnesia, kept_messages_come_back_newest_first_and_leave_in_put_order)
{
    tu_backend b;
    idem_outbox_ack acks[3];
    idem_outbox_kept_info k;
    size_t n;
    idem_store *st = tu_backend_open(&b, "kept");
    nt_commit_orders(st, "S.in", 0, 3);
    fake_acks(acks, 3);
    cr_assert_eq(idem_outbox_keep(st, acks, 3, 1000), IDEM_OK, "%s", idem_errmsg());
    expect_peek(st, NULL, 0);
    cr_assert_eq(idem_outbox_kept_restore(st, 1, &n), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(n, 1);
    expect_peek(st, (const char *const[]){"order-2"}, 1);
    cr_assert_eq(idem_outbox_kept(st, &k), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(k.count, 2);
    cr_expect_str_eq(k.newest_msg_id, "order-1");
    cr_expect_eq(k.newest.stream_seq, 101);
    cr_assert_eq(idem_outbox_kept_restore(st, 8, &n), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(n, 2);
    expect_peek(st, (const char *const[]){"order-0", "order-1", "order-2"}, 3);
    fake_acks(acks, 3); /* published again: kept again, then past their horizon */
    cr_assert_eq(idem_outbox_keep(st, acks, 3, 2000), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(idem_outbox_kept_expire(st, 2000, 8, &n), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(n, 0, "acked at 2000: not before 2000");
    cr_assert_eq(idem_outbox_kept_expire(st, 2001, 8, &n), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(n, 3);
    cr_assert_eq(idem_outbox_kept(st, &k), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(k.count, 0);
    tu_backend_close(&b);
}

/* Answers the relay's varz request as a server with that JetStream config would. */
static void varz_answer(natsConnection *nc, natsSubscription *sub, natsMsg *m, void *config)
{
    char body[256];
    (void)sub;
    snprintf(body, sizeof(body), "{\"data\":{\"jetstream\":{\"config\":{%s}}}}",
             (const char *)config);
    natsConnection_PublishString(nc, natsMsg_GetReply(m), body);
    natsMsg_Destroy(m);
}

/* Relays orders [from, to) with a relay that asks a broker reporting config; its count. */
static uint64_t kept_under(nt *e, const char *config, unsigned keep_ms, int from, int to)
{
    idem_nats_relay_opts ro;
    idem_nats_relay *r;
    natsSubscription *sub = NULL;
    cr_assert_eq(natsConnection_Subscribe(&sub, e->nc, "$SYS.REQ.SERVER.PING.VARZ", varz_answer,
                                          (void *)config),
                 NATS_OK);
    cr_assert_eq(natsConnection_Flush(e->nc), NATS_OK);
    idem_nats_relay_opts_init(&ro);
    ro.url = e->url;
    ro.keep_ms = keep_ms;
    cr_assert_eq(idem_nats_relay_open(&r, e->st, &ro), IDEM_OK, "%s", idem_errmsg());
    commit_and_relay(e, r, from, to);
    nats_Sleep(20); /* time past a keep_ms of 1 ms, far inside a sync_interval of minutes */
    cr_assert_eq(idem_nats_relay_run_once(r, NULL), IDEM_OK, "%s", idem_errmsg());
    uint64_t kept = counts(r).kept;
    idem_nats_relay_close(r);
    natsSubscription_Destroy(sub);
    return kept;
}

/* Detected, not assumed: what the broker reports in its varz sets the horizon. */
Test(nats_amnesia, the_horizon_follows_the_sync_setting_the_broker_reports)
{
    nt e;
    nt_setup(&e, "sync");
    cr_expect_eq(kept_under(&e, "\"sync_always\":true", 0, 0, 5), 0, "synced at the ack: kept");
    cr_expect_eq(kept_under(&e, "\"sync_interval\":600000000000", 1, 5, 10), 5,
                 "a 10-minute sync_interval under a 1 ms keep_ms: dropped");
    cr_expect_eq(kept_under(&e, "\"max_memory\":1", 1, 10, 15), 0, "no sync setting: keep_ms");
    nt_teardown(&e);
}

/* A review's finding: kept messages expired by the relay's clock since their ack, in every
 * round, also while the broker was away. A broker host that crashes right after acking
 * (nothing synced) and stays down longer than keep_ms came back without them, and the
 * kept log, emptied meanwhile, had nothing to restore. keep_ms counts only while the
 * broker answers. */
static void broker_down_for(int rounds)
{
    nt e;
    idem_nats_relay_opts ro;
    idem_nats_relay *r;
    idem_nats_relay_counts s;
    if (getenv("IDEMRPC_SERVICES") == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set: cannot cut the broker's power");
    }
    nt_setup(&e, "down");
    idem_nats_relay_opts_init(&ro);
    ro.url = e.url;
    ro.keep_ms = 1500; /* the broker's sync interval, as an operator set it */
    ro.publish_wait_ms = 500;
    cr_assert_eq(idem_nats_relay_open(&r, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    commit_and_relay(&e, r, 0, 2);
    services("freeze-nats");           /* what the broker's disk holds */
    commit_and_relay(&e, r, 2, 5);     /* acked, not synced */
    services("hang-nats");             /* its host crashes now */
    for (int i = 0; i < rounds; i++) { /* 100 ms each, the broker away */
        (void)idem_nats_relay_run_once(r, NULL);
        nats_Sleep(100);
    }
    services("amnesia-nats"); /* it comes back with what its disk had */
    for (int i = 0; i < WAIT_ROUNDS && nt_stream_msgs(&e) < 5; i++) {
        (void)idem_nats_relay_run_once(r, NULL);
        nats_Sleep(20);
    }
    idem_nats_relay_stats(r, &s);
    cr_expect_eq(nt_stream_msgs(&e), 5,
                 "the stream holds %llu of orders 0..4; losses found %llu, restored %llu",
                 (unsigned long long)nt_stream_msgs(&e), (unsigned long long)s.losses,
                 (unsigned long long)s.restored);
    idem_nats_relay_close(r);
    nt_teardown(&e);
}

Test(nats_amnesia, a_broker_down_shorter_than_keep_ms_loses_no_acked_message)
{
    broker_down_for(3);
}

Test(nats_amnesia, a_broker_down_longer_than_keep_ms_loses_no_acked_message)
{
    broker_down_for(30);
}

/* Seed 39490 (nats chaos, committed_never_published): two relays on one store. Relay A
 * publishes order-3 and, before A's round settles, relay B publishes it too (a duplicate
 * answer), keeps it, finds that the broker forgot it and restores the kept log into the
 * outbox, then publishes the older restored messages again (higher stream sequences on the
 * broker that forgot). A's round then settled order-3 with its ack from before the loss:
 * the restored row went back into the kept log under a sequence the broker now gives to
 * another message, behind B's newer kept ones, so no check ever looked at it. */
typedef struct two_relays {
    nt *e;
    idem_nats_relay *b;
    bool fired;
} two_relays;

static void b_finds_the_loss_meanwhile(const idem_outbox_msg *m, bool duplicate, void *arg)
{
    two_relays *t = arg;
    idem_nats_relay_counts s;
    (void)duplicate;
    if (t->fired || strcmp(m->msg_id, "order-3") != 0) {
        return;
    }
    t->fired = true;
    cr_assert_eq(idem_nats_relay_run_once(t->b, NULL), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(counts(t->b).duplicates, 1, "B's publish of order-3: a duplicate");
    nt_forget_stream(t->e);                     /* the broker loses what it acked */
    nt_publish(t->e, NULL, NULL, "other");      /* the broker's sequence goes on: */
    nt_publish(t->e, NULL, NULL, "other");      /* others published meanwhile */
    nt_commit_orders(t->e->st, t->e->in, 4, 5); /* B's next publish finds the loss */
    cr_assert_eq(idem_nats_relay_run_once(t->b, NULL), IDEM_OK, "%s", idem_errmsg());
    idem_nats_relay_stats(t->b, &s);
    cr_assert_eq(s.losses, 1, "B found the loss");
    for (int i = 0; i < 3; i++) { /* orders 0..2 again, one a round; order-3 still waits */
        cr_assert_eq(idem_nats_relay_run_once(t->b, NULL), IDEM_OK, "%s", idem_errmsg());
    }
}

static bool on_stream(nt *e, const char *msg_id)
{
    jsStreamInfo *si = NULL;
    bool found = false;
    cr_assert_eq(js_GetStreamInfo(&si, e->js, e->stream, NULL, NULL), NATS_OK);
    for (uint64_t q = si->State.FirstSeq; !found && q <= si->State.LastSeq; q++) {
        natsMsg *m = NULL;
        const char *id = NULL;
        if (js_GetMsg(&m, e->js, e->stream, q, NULL, NULL) == NATS_OK) {
            found = natsMsgHeader_Get(m, "Nats-Msg-Id", &id) == NATS_OK && strcmp(id, msg_id) == 0;
            natsMsg_Destroy(m);
        }
    }
    jsStreamInfo_Destroy(si);
    return found;
}

/* Runs relays a and b in turn (pause_ms between rounds) until the outbox is empty, at
 * most rounds times; expects orders 0..orders-1 on the stream; closes both and e. */
static void settle_both(nt *e, idem_nats_relay *a, idem_nats_relay *b, int rounds,
                        unsigned pause_ms, int orders)
{
    uint64_t pending = 1;
    for (int i = 0; i < rounds && pending > 0; i++) {
        (void)idem_nats_relay_run_once(b, NULL);
        (void)idem_nats_relay_run_once(a, NULL);
        cr_assert_eq(idem_outbox_pending(e->st, &pending), IDEM_OK, "%s", idem_errmsg());
        if (pause_ms > 0) {
            nats_Sleep(pause_ms);
        }
    }
    cr_expect_eq(pending, 0);
    for (int i = 0; i < orders; i++) {
        char id[16];
        snprintf(id, sizeof(id), "order-%d", i);
        cr_expect(on_stream(e, id), "%s committed, acked, kept, never on the stream", id);
    }
    idem_nats_relay_close(a);
    idem_nats_relay_close(b);
    nt_teardown(e);
}

Test(nats_amnesia, a_message_acked_before_another_relay_restored_it_is_published_again)
{
    nt e;
    idem_nats_relay_opts ro;
    idem_nats_relay *a;
    two_relays t = {&e, NULL, false};
    nt_setup(&e, "tworel");
    idem_nats_relay_opts_init(&ro);
    ro.url = e.url;
    ro.batch = 1;
    cr_assert_eq(idem_nats_relay_open(&t.b, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    ro.on_published = b_finds_the_loss_meanwhile;
    ro.event_arg = &t;
    cr_assert_eq(idem_nats_relay_open(&a, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    nt_commit_and_relay(&e, t.b, e.in, 0, 3); /* orders 0..2 kept by B */
    nt_commit_orders(e.st, e.in, 3, 4);
    cr_assert_eq(idem_nats_relay_run_once(a, NULL), IDEM_OK, "%s", idem_errmsg());
    cr_assert(t.fired);
    settle_both(&e, a, t.b, 50, 0, 5);
}

/* The same two relays without a restore: A's publish of order-3 is acked, then the
 * broker's host loses it (restarted from its disk) before A's round settles; B reconnects,
 * checks (its newest kept message is on the stream: nothing lost) and keeps orders 4 and 5
 * under the sequences the broker hands out again, then A keeps order-3 under a sequence
 * that now holds order-4. A's keep is the newest in ack order, so the next check finds
 * it lost and every kept message goes again. (Not covered here: A's keep landing between
 * B's check and B's keep of its next publish, behind it; see the closing note.) */
static void b_reconnects_to_a_broker_that_forgot(const idem_outbox_msg *m, bool duplicate,
                                                 void *arg)
{
    two_relays *t = arg;
    (void)duplicate;
    if (t->fired || strcmp(m->msg_id, "order-3") != 0) {
        return;
    }
    t->fired = true;
    services("amnesia-nats"); /* back with what its disk had: orders 0..2 */
    nt_commit_orders(t->e->st, t->e->in, 4, 6);
    uint64_t before = counts(t->b).published;
    for (int i = 0; i < WAIT_ROUNDS && counts(t->b).published < before + 2; i++) {
        (void)idem_nats_relay_run_once(t->b, NULL); /* UNAVAILABLE until it reconnected */
        nats_Sleep(20);
    }
    cr_assert_eq(counts(t->b).published, before + 2, "B relayed orders 4 and 5");
}

Test(nats_amnesia, a_message_acked_before_a_broker_restart_another_relay_checked_goes_again)
{
    nt e;
    idem_nats_relay_opts ro;
    idem_nats_relay *a;
    two_relays t = {&e, NULL, false};
    if (getenv("IDEMRPC_SERVICES") == NULL) {
        cr_skip_test("IDEMRPC_SERVICES not set");
    }
    nt_setup(&e, "tworel2");
    idem_nats_relay_opts_init(&ro);
    ro.url = e.url;
    ro.batch = 1;
    ro.keep_ms = 60000;
    cr_assert_eq(idem_nats_relay_open(&t.b, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    nt_commit_and_relay(&e, t.b, e.in, 0, 3); /* orders 0..2 kept by B */
    services("freeze-nats");                  /* what the broker's disk holds */
    ro.on_published = b_reconnects_to_a_broker_that_forgot;
    ro.event_arg = &t;
    cr_assert_eq(idem_nats_relay_open(&a, e.st, &ro), IDEM_OK, "%s", idem_errmsg());
    nt_commit_orders(e.st, e.in, 3, 4);
    (void)idem_nats_relay_run_once(a, NULL);
    cr_assert(t.fired);
    settle_both(&e, a, t.b, WAIT_ROUNDS, 20, 6);
}

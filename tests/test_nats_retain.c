/* Names, retention and growth of the JetStream binding against a real nats-server: the
 * consume group apart from the durable's name, a stream's retention and duplicate window,
 * and consumed markers purged once the stream can no longer deliver their messages, so
 * that a steady stream keeps the store flat. Needs $IDEMRPC_TEST_NATS (skipped unset);
 * runs on the store $IDEMRPC_TEST_BACKEND names (nats_retain: LMDB, _pg: PostgreSQL). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nats_util.h"

#define PURGE_ROUNDS 600 /* a hang guard, not a timing assertion */

static void publish_orders(nt *e, int from, int to)
{
    char key[32];
    for (int i = from; i < to; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        nt_publish(e, key, NULL, "amount=1");
    }
}

static uint64_t markers(nt *e, const char *group)
{
    idem_consume_markers m;
    cr_assert_eq(idem_consume_group_markers(e->st, group, 100000, &m), IDEM_OK, "%s",
                 idem_errmsg());
    return m.count;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* the markers' clock */
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static idem_code no_effect(idem_txn *t, void *arg)
{
    (void)t, (void)arg;
    return IDEM_OK;
}

static void pause_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The test's stream brought to max_age_ms. */
static void stream_max_age(nt *e, uint64_t max_age_ms)
{
    idem_nats_stream_opts so;
    const char *subjects[] = {e->in, e->dead};
    idem_nats_stream_opts_init(&so);
    so.max_age_ms = max_age_ms; /* the window is cut to it */
    cr_assert_eq(idem_nats_ensure_stream_ex(e->url, e->stream, subjects, 2, &so), IDEM_OK, "%s",
                 idem_errmsg());
}

Test(nats_retain, a_renamed_durable_keeping_its_group_reapplies_nothing)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s;
    char key[32];
    nt_setup(&e, "ren");
    publish_orders(&e, 0, 20);
    nt_opts(&e, &o, "ledger"); /* no group: the durable's name, as before the option */
    idem_nats_consumer *c = nt_consumer(&e, &o);
    nt_drain(&e, c, "ledger");
    idem_nats_consumer_close(c);
    nt_opts(&e, &o, "ledger-v2");
    o.group = "ledger";
    c = nt_consumer(&e, &o);
    nt_drain(&e, c, "ledger-v2"); /* a new durable: every message is delivered again */
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.committed, 0);
    cr_expect_eq(s.duplicates, 20);
    cr_expect_eq(s.acked, 20);
    idem_nats_consumer_close(c);
    for (int i = 0; i < 20; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        cr_expect_eq(nt_effects(&e, key), 1, "%s", key);
    }
    cr_expect_eq(markers(&e, "ledger"), 20);
    cr_expect_eq(markers(&e, "ledger-v2"), 0);
    nt_teardown(&e);
}

Test(nats_retain, refuses_a_group_out_of_bounds)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_consumer *c = NULL;
    char big[IDEM_MAX_CONSUMER_GROUP + 2];
    nt_setup(&e, "grp");
    memset(big, 'g', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    nt_opts(&e, &o, "ledger");
    o.group = big;
    cr_expect_eq(idem_nats_consumer_open(&c, e.st, &o), IDEM_INVALID_ARGUMENT);
    cr_expect(strstr(idem_errmsg(), "group") != NULL, "%s", idem_errmsg());
    o.group = "";
    cr_expect_eq(idem_nats_consumer_open(&c, e.st, &o), IDEM_INVALID_ARGUMENT);
    cr_expect_null(c);
    nt_teardown(&e);
}

static jsStreamConfig *stream_config(nt *e, const char *name, jsStreamInfo **si)
{
    jsErrCode jerr = 0;
    cr_assert_eq(js_GetStreamInfo(si, e->js, name, NULL, &jerr), NATS_OK, "%d", (int)jerr);
    return (*si)->Config;
}

Test(nats_retain, ensure_stream_ex_sets_and_updates_retention_and_window)
{
    nt e;
    idem_nats_stream_opts so;
    jsStreamInfo *si = NULL;
    char name[48], subject[64];
    nt_setup(&e, "ret");
    snprintf(name, sizeof(name), "%sq", e.stream);
    snprintf(subject, sizeof(subject), "%s.q", e.stream);
    const char *subjects[] = {subject};
    idem_nats_stream_opts_init(&so);
    so.retention = IDEM_NATS_RETAIN_WORK_QUEUE;
    so.max_age_ms = 3600000;
    so.max_msgs = 1000;
    so.max_bytes = 1 << 20;
    so.duplicate_window_ms = 30000;
    cr_assert_eq(idem_nats_ensure_stream_ex(e.url, name, subjects, 1, &so), IDEM_OK, "%s",
                 idem_errmsg());
    jsStreamConfig *sc = stream_config(&e, name, &si);
    cr_expect_eq(sc->Retention, js_WorkQueuePolicy);
    cr_expect_eq(sc->MaxAge, 3600000ll * 1000000);
    cr_expect_eq(sc->MaxMsgs, 1000);
    cr_expect_eq(sc->MaxBytes, 1 << 20);
    cr_expect_eq(sc->Duplicates, 30000ll * 1000000);
    jsStreamInfo_Destroy(si);
    /* An existing stream: brought to the new limits; the old call keeps it as it is. */
    so.max_age_ms = 60000;
    so.max_msgs = 0;
    cr_assert_eq(idem_nats_ensure_stream_ex(e.url, name, subjects, 1, &so), IDEM_OK, "%s",
                 idem_errmsg());
    cr_assert_eq(idem_nats_ensure_stream(e.url, name, subjects, 1), IDEM_OK);
    sc = stream_config(&e, name, &si);
    cr_expect_eq(sc->MaxAge, 60000ll * 1000000);
    cr_expect_eq(sc->MaxMsgs, -1);
    cr_expect_eq(sc->Duplicates, 30000ll * 1000000);
    jsStreamInfo_Destroy(si);
    so.retention = IDEM_NATS_RETAIN_LIMITS; /* JetStream cannot change it */
    cr_expect_eq(idem_nats_ensure_stream_ex(e.url, name, subjects, 1, &so),
                 IDEM_FAILED_PRECONDITION);
    cr_expect(strstr(idem_errmsg(), "retention") != NULL, "%s", idem_errmsg());
    so.duplicate_window_ms = so.max_age_ms + 1;
    cr_expect_eq(idem_nats_ensure_stream_ex(e.url, name, subjects, 1, &so), IDEM_INVALID_ARGUMENT);
    so.duplicate_window_ms = 0;
    so.retention = (idem_nats_retention)7;
    cr_expect_eq(idem_nats_ensure_stream_ex(e.url, name, subjects, 1, &so), IDEM_INVALID_ARGUMENT);
    js_DeleteStream(e.js, name, NULL, NULL);
    nt_teardown(&e);
}

Test(nats_retain, ensure_stream_ex_cuts_the_window_to_a_shorter_max_age)
{
    nt e;
    idem_nats_stream_opts so;
    jsStreamInfo *si = NULL;
    jsStreamConfig *sc;
    char name[48], subject[64];
    nt_setup(&e, "win");
    snprintf(name, sizeof(name), "%sq", e.stream);
    snprintf(subject, sizeof(subject), "%s.q", e.stream);
    const char *subjects[] = {subject};
    /* Created with a max_age under the broker's window, and no window: the window too. */
    idem_nats_stream_opts_init(&so);
    so.max_age_ms = 5000;
    cr_assert_eq(idem_nats_ensure_stream_ex(e.url, name, subjects, 1, &so), IDEM_OK, "%s",
                 idem_errmsg());
    sc = stream_config(&e, name, &si);
    cr_expect_eq(sc->Retention, js_LimitsPolicy);
    cr_expect_eq(sc->Duplicates, 5000ll * 1000000);
    jsStreamInfo_Destroy(si);
    /* A max_age under the window the stream had (the broker's 2 min): the window too. */
    const char *own[] = {e.in, e.dead};
    idem_nats_stream_opts_init(&so);
    so.max_age_ms = 10000;
    cr_assert_eq(idem_nats_ensure_stream_ex(e.url, e.stream, own, 2, &so), IDEM_OK, "%s",
                 idem_errmsg());
    sc = stream_config(&e, e.stream, &si);
    cr_expect_eq(sc->MaxAge, 10000ll * 1000000);
    cr_expect_eq(sc->Duplicates, 10000ll * 1000000);
    jsStreamInfo_Destroy(si);
    js_DeleteStream(e.js, name, NULL, NULL);
    nt_teardown(&e);
}

/* Purges the consumer's markers until none is left (a hang guard), each round checking
 * that no marker younger than max_age + horizon went: a purge that returned before
 * started + keep_ms may have taken none of those consumed after started. */
static void purge_until_empty(nt *e, idem_nats_consumer *c, const char *group, uint64_t horizon_ms,
                              uint64_t keep_ms, uint64_t started, uint64_t n)
{
    size_t purged, total = 0;
    for (int i = 0; i < PURGE_ROUNDS && total < n; i++) {
        idem_code code = idem_nats_consumer_purge_markers(c, horizon_ms, 1000, &purged);
        cr_assert_eq(code, IDEM_OK, "%s", idem_errmsg());
        if (now_ms() < started + keep_ms) {
            cr_assert_eq(purged, 0, "purged before max_age + horizon");
        }
        total += purged;
        if (purged == 0) {
            pause_ms(100); /* the time to pass is the condition */
        }
    }
    cr_assert_eq(total, n);
    cr_assert_eq(markers(e, group), 0);
}

Test(nats_retain, purges_markers_once_the_stream_cannot_deliver_them)
{
    nt e;
    idem_nats_consumer_opts o;
    size_t purged;
    nt_setup(&e, "pur");
    nt_opts(&e, &o, "ledger");
    o.ack_wait_ms = 1000;
    idem_nats_consumer *c = nt_consumer(&e, &o);
    /* Without max_age the stream may deliver any message again: nothing can go. */
    cr_expect_eq(idem_nats_consumer_purge_markers(c, 0, 1000, &purged), IDEM_FAILED_PRECONDITION);
    cr_expect(strstr(idem_errmsg(), "max_age") != NULL, "%s", idem_errmsg());
    cr_expect_eq(idem_nats_consumer_purge_markers(c, 999, 1000, &purged), IDEM_INVALID_ARGUMENT);
    stream_max_age(&e, 2000);
    uint64_t started = now_ms();
    publish_orders(&e, 0, 10);
    nt_drain(&e, c, "ledger");
    /* A horizon beyond the clock does not wrap around into a purge of everything. */
    cr_expect_eq(idem_nats_consumer_purge_markers(c, UINT64_MAX - 1000, 1000, &purged), IDEM_OK);
    cr_expect_eq(purged, 0);
    /* Another group's markers in the same store stay: the purge is the group's. */
    cr_assert_eq(idem_consume(e.st, "bystander", "order-0", no_effect, NULL), IDEM_CONSUME_ACK);
    cr_assert_eq(markers(&e, "ledger"), 10);
    purge_until_empty(&e, c, "ledger", 1000, 3000, started, 10);
    cr_expect_eq(markers(&e, "bystander"), 1);
    idem_nats_consumer_close(c);
    nt_teardown(&e);
}

/* A group consumed from two streams would lose the markers the longer retention needs
 * to the shorter one's purge: the second stream's purge is refused. */
Test(nats_retain, a_group_purged_by_two_streams_retentions_is_refused)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stream_opts so;
    size_t purged;
    char name[48], subject[64];
    nt_setup(&e, "two");
    stream_max_age(&e, 60000);
    snprintf(name, sizeof(name), "%sb", e.stream);
    snprintf(subject, sizeof(subject), "%s.b", e.stream);
    const char *subjects[] = {subject};
    idem_nats_stream_opts_init(&so);
    so.max_age_ms = 3600000;
    cr_assert_eq(idem_nats_ensure_stream_ex(e.url, name, subjects, 1, &so), IDEM_OK, "%s",
                 idem_errmsg());
    nt_opts(&e, &o, "ledger");
    idem_nats_consumer *a = nt_consumer(&e, &o);
    o.stream = name;
    o.filter_subject = subject;
    o.group = "ledger";
    idem_nats_consumer *b = nt_consumer(&e, &o);
    cr_expect_eq(idem_nats_consumer_purge_markers(a, 0, 100, &purged), IDEM_OK, "%s",
                 idem_errmsg());
    cr_expect_eq(idem_nats_consumer_purge_markers(b, 0, 100, &purged), IDEM_FAILED_PRECONDITION);
    cr_expect(strstr(idem_errmsg(), e.stream) != NULL, "%s", idem_errmsg());
    cr_expect_eq(idem_nats_consumer_purge_markers(a, 0, 100, &purged), IDEM_OK, "%s",
                 idem_errmsg());
    /* The group moved to the other stream: a purge with the operator's own cutoff first. */
    cr_expect_eq(idem_consume_purge_group(e.st, "ledger", 0, 100, &purged), IDEM_OK);
    cr_expect_eq(idem_nats_consumer_purge_markers(b, 0, 100, &purged), IDEM_OK, "%s",
                 idem_errmsg());
    cr_expect_eq(idem_nats_consumer_purge_markers(a, 0, 100, &purged), IDEM_FAILED_PRECONDITION);
    idem_nats_consumer_close(b);
    idem_nats_consumer_close(a);
    js_DeleteStream(e.js, name, NULL, NULL);
    nt_teardown(&e);
}

/* The soak: a steady stream for many times max_age + horizon, purged as it goes. The
 * markers stay near what that window holds, far below what went through. */
Test(nats_retain, a_steady_stream_keeps_the_store_flat, .timeout = 240)
{
    nt e;
    idem_nats_consumer_opts o;
    size_t purged;
    uint64_t most = 0;
    const int per_round = 20, rounds = 60;
    nt_setup(&e, "soak");
    nt_opts(&e, &o, "ledger");
    o.ack_wait_ms = 500;
    idem_nats_consumer *c = nt_consumer(&e, &o);
    stream_max_age(&e, 1000);
    uint64_t started = now_ms();
    for (int r = 0; r < rounds; r++) {
        uint64_t round_at = now_ms();
        publish_orders(&e, r * per_round, (r + 1) * per_round);
        nt_drain(&e, c, "ledger");
        cr_assert_eq(idem_nats_consumer_purge_markers(c, 500, 1000, &purged), IDEM_OK, "%s",
                     idem_errmsg());
        uint64_t now = markers(&e, "ledger");
        most = now > most ? now : most;
        if (now_ms() - round_at < 100) {
            pause_ms(100 - (long)(now_ms() - round_at)); /* pacing: time must pass */
        }
    }
    uint64_t elapsed = now_ms() - started, total = (uint64_t)per_round * rounds;
    cr_log_info("soak: %llu messages in %llu ms, markers at most %llu", (unsigned long long)total,
                (unsigned long long)elapsed, (unsigned long long)most);
    /* A marker stays max_age + horizon = 1500 ms; a round takes at least 100 ms: at most
     * 1500 / 100 + 2 rounds' markers are kept at a time, whatever went through. */
    cr_expect_leq(most, (uint64_t)per_round * (1500 / 100 + 2));
    cr_expect_lt(most, total / 2, "the markers grew with the traffic: %llu of %llu",
                 (unsigned long long)most, (unsigned long long)total);
    cr_expect_eq(nt_effects(&e, "order-0"), 1);
    cr_expect_eq(nt_effects(&e, "order-1199"), 1);
    idem_nats_consumer_close(c);
    nt_teardown(&e);
}

static void consume_each(idem_store *st, const char *group, int from, int to)
{
    char key[32];
    for (int i = from; i < to; i++) {
        snprintf(key, sizeof(key), "k%d", i);
        cr_assert_eq(idem_consume(st, group, key, no_effect, NULL), IDEM_CONSUME_ACK, "%s",
                     idem_errmsg());
    }
}

static uint64_t count_of(idem_store *st, const char *group)
{
    idem_consume_markers m;
    cr_assert_eq(idem_consume_group_markers(st, group, 100000, &m), IDEM_OK, "%s", idem_errmsg());
    return m.count;
}

Test(consume_purge_group, purges_one_group_and_passes_over_the_others)
{
    tu_backend b;
    size_t purged, total = 0;
    idem_store *st = tu_backend_open(&b, "cpg");
    for (int i = 0; i < 10; i++) { /* interleaved in the consumption log */
        consume_each(st, "a", i, i + 1);
        consume_each(st, "b", i, i + 1);
    }
    uint64_t cutoff = now_ms() + 1;
    cr_expect_eq(idem_consume_purge_group(st, "a", 0, 5, &purged), IDEM_OK);
    cr_expect_eq(purged, 0, "nothing consumed before the cutoff");
    for (int i = 0; i < 20 && total < 10; i++) { /* 3 slots a call: bounded batches */
        cr_assert_eq(idem_consume_purge_group(st, "a", cutoff, 3, &purged), IDEM_OK, "%s",
                     idem_errmsg());
        cr_assert_leq(purged, 2);
        total += purged;
    }
    cr_expect_eq(total, 10);
    cr_expect_eq(count_of(st, "a"), 0);
    cr_expect_eq(count_of(st, "b"), 10);
    cr_expect_eq(idem_consume_lookup(st, "b", "k3", NULL), IDEM_OK);
    /* The log's own purge takes the rest, past the holes the group's left. */
    cr_expect_eq(idem_consume_purge(st, cutoff, 100, &purged), IDEM_OK);
    cr_expect_eq(purged, 10);
    cr_expect_eq(count_of(st, "b"), 0);
    cr_expect_eq(idem_consume_purge_group(st, "", cutoff, 3, &purged), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_consume_purge_group(st, "a", cutoff, 0, &purged), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_consume_purge_group(st, "a", cutoff, IDEM_CONSUME_MAX_PURGE + 1, &purged),
                 IDEM_INVALID_ARGUMENT);
    tu_backend_close(&b);
}

/* A consumer whose fetches time out before the broker's answers arrive (fetch_wait_ms 1):
 * the late messages queue in the subscription and the next fetches take them. Debian's
 * libnats 3.4.1 overflows its fetch array when more than half (not all) of a batch is
 * queued (nats-io/nats.c#749; the campaign's consumer died of a corrupted heap after
 * broker restarts), so the consumer fetches one at a time while anything is queued
 * (idem__nats_fetch). This test holds the path to every message taking effect once; it
 * does not make the overflow itself (late answers here come a whole batch at a time, and
 * libnats is not instrumented by the ASan build). Needs $IDEMRPC_TEST_NATS; nats_fetch
 * (LMDB), nats_fetch_pg. */
#include <criterion/criterion.h>
#include <stdio.h>

#include "nats_util.h"

#define MESSAGES 400
#define POLLS 4000 /* a hang guard: each poll handles at least one message as a rule */

Test(nats_fetch, late_answers_queued_in_the_subscription_are_taken_without_overflow)
{
    nt e;
    idem_nats_consumer_opts o;
    idem_nats_stats s;
    char key[32];
    unsigned handled = 0, n;
    nt_setup(&e, "fetch");
    for (int i = 0; i < MESSAGES; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        nt_publish(&e, key, NULL, "amount=1");
    }
    nt_opts(&e, &o, "credit");
    o.batch = 16;
    o.fetch_wait_ms = 1; /* shorter than the broker's answer: late messages queue */
    idem_nats_consumer *c = nt_consumer(&e, &o);
    for (int i = 0; i < POLLS && handled < MESSAGES; i++) {
        cr_assert_eq(idem_nats_consumer_poll(c, &n), IDEM_OK, "%s", idem_errmsg());
        handled += n;
    }
    nt_drain(&e, c, "credit");
    for (int i = 0; i < MESSAGES; i++) {
        snprintf(key, sizeof(key), "order-%d", i);
        cr_expect_eq(nt_effects(&e, key), 1, "%s", key);
    }
    idem_nats_consumer_stats(c, &s);
    cr_expect_eq(s.committed, MESSAGES);
    idem_nats_consumer_close(c);
    nt_teardown(&e);
}

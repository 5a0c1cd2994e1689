/* idem_outbox_kept_restore moves the outbox's head back to the oldest kept seq,
 * across every slot removed since (parked messages here). peek looks at no more than
 * 2*max slots from head and the next keep/remove advances head by at most
 * IDEM_OUTBOX_MAX_BATCH: once the restored messages are relayed again, head sits in a run
 * of empty slots longer than both, peek finds nothing, and unless the relay moves head
 * past them (idem__outbox_skip_removed) the messages behind are never relayed (the
 * relay's batch: 64). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "testutil.h"
#include "toolkit_internal.h"

#define N 3000

typedef struct put_arg {
    uint64_t i;
} put_arg;

static idem_code put(idem_txn *t, void *arg)
{
    put_arg *p = arg;
    char id[32];
    snprintf(id, sizeof(id), "m-%llu", (unsigned long long)p->i);
    return idem_outbox_put(t, "orders.done", id, "x", 1);
}

/* What a relay does each round: peek a batch, "publish" it, keep it. */
static size_t relay_round(idem_store *st, uint64_t *stream_seq, uint64_t now)
{
    idem_outbox_msg msgs[64];
    idem_outbox_ack acks[64];
    size_t n = 0;
    bool moved = true;
    cr_assert_eq(idem_outbox_peek(st, msgs, 64, &n), IDEM_OK, "%s", idem_errmsg());
    /* as the relay does (nats_relay.c peek_batch): nothing in the window, head moves on */
    for (int i = 0; n == 0 && moved && i < 64; i++) {
        cr_assert_eq(idem__outbox_skip_removed(st, &moved), IDEM_OK, "%s", idem_errmsg());
        cr_assert_eq(idem_outbox_peek(st, msgs, 64, &n), IDEM_OK, "%s", idem_errmsg());
    }
    for (size_t i = 0; i < n; i++) {
        acks[i] = (idem_outbox_ack){.seq = msgs[i].seq, .stream_seq = ++*stream_seq};
        strcpy(acks[i].stream, "ORDERS");
    }
    cr_assert_eq(idem_outbox_keep(st, acks, n, now), IDEM_OK, "%s", idem_errmsg());
    idem_outbox_msgs_free(msgs, n);
    return n;
}

Test(outbox_restore, restore_across_parked_slots_still_relays_the_messages_behind)
{
    tu_backend b;
    idem_store *st = tu_backend_open(&b, "r3-restore");
    uint64_t sseq = 0, parked[IDEM_OUTBOX_MAX_BATCH], pending;
    for (uint64_t i = 0; i < N; i++) {
        put_arg p = {i};
        cr_assert_eq(idem_store_run_txn(st, put, &p), IDEM_OK, "%s", idem_errmsg());
    }
    /* seq 0 acked and kept; seqs 1..N-2 refused for good (parked); seq N-1 pending. */
    idem_outbox_ack a0 = {.seq = 0, .stream_seq = ++sseq, .stream = "ORDERS"};
    cr_assert_eq(idem_outbox_keep(st, &a0, 1, 1000), IDEM_OK, "%s", idem_errmsg());
    for (uint64_t s = 1; s < N - 1;) {
        size_t n = 0;
        for (; n < IDEM_OUTBOX_MAX_BATCH && s < N - 1; n++, s++) {
            parked[n] = s;
        }
        cr_assert_eq(idem_outbox_park(st, parked, n), IDEM_OK, "%s", idem_errmsg());
    }
    /* The broker lost seq 0: the relay puts the kept ones back. */
    size_t restored = 0;
    cr_assert_eq(idem_outbox_kept_restore(st, IDEM_OUTBOX_MAX_BATCH, &restored), IDEM_OK);
    cr_assert_eq(restored, 1);
    /* The relay goes on: seq 0 again, then it must reach seq N-1. */
    size_t relayed = 0;
    for (int round = 0; round < 50; round++) {
        relayed += relay_round(st, &sseq, 2000);
    }
    cr_assert_eq(idem_outbox_pending(st, &pending), IDEM_OK);
    cr_expect_eq(relayed, 2, "relayed %zu of 2 (seq 0 again and seq %d); pending says %llu",
                 relayed, N - 1, (unsigned long long)pending);
    tu_backend_close(&b);
}

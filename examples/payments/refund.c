/* pay.Order/Refund "order_id=X": PAID → REFUNDED and the merchant gives the amount back.
 *
 * Optimistic: the decision (is the order PAID, does the merchant have the money) is made
 * on a snapshot read, outside LMDB's single writer; only the short write txn holds it.
 * That write is a double compare-and-set: the order's PAID → REFUNDED (pay_order_move)
 * and the balance's "still at the version I read". A payment credited to the same merchant in
 * between makes it ABORTED, the whole txn rolls back and idem_retry_on_conflict re-runs
 * the attempt on a fresh snapshot, a bounded number of times.
 *
 * The method runs in claim mode (IDEM_METHOD_CACHED): its writes are not in the record's
 * txn. If the process dies between them, the retry after the lease finds REFUNDED and
 * answers "already refunded" without debiting: the state machine keeps it to one debit.
 * A refund with another idempotency key for the same order does the same. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "payments.h"

typedef struct refund {
    pay_service *svc;
    char order_id[PAY_MAX_FIELD];
    char account[PAY_MAX_FIELD + 16];
    long long amount, balance; /* balance: the snapshot's, then the new one */
    uint64_t seen;             /* the balance's version in the snapshot */
    bool already;              /* the order was REFUNDED before this call */
    uint32_t attempts;
} refund;

static idem_code refund_write(idem_txn *t, void *arg)
{
    refund *r = arg;
    idem_sm_outcome out;
    idem_code code = pay_order_move(t, r->order_id, "PAID", "REFUNDED", &out);
    if (code != IDEM_OK || out == IDEM_SM_DUPLICATE) {
        r->already = code == IDEM_OK; /* a concurrent refund won: write nothing */
        return code;
    }
    r->balance -= r->amount;
    return pay_ledger_cas(t, r->account, r->seen, r->balance); /* ABORTED: retry */
}

/* Reads the order and the balance on a snapshot. */
static idem_code refund_snapshot(refund *r, char *state, size_t cap)
{
    char merchant[PAY_MAX_FIELD];
    void *v;
    size_t n;
    idem_store *st = r->svc->store;
    idem_code code =
        idem_store_app_get(st, PAY_DB_ORDERS, r->order_id, strlen(r->order_id), &v, &n);
    if (code != IDEM_OK) {
        return code;
    }
    bool ok = pay_form_get(v, n, "merchant", merchant, sizeof(merchant)) &&
              pay_form_amount(v, n, "amount", &r->amount);
    free(v);
    if (!ok) {
        return IDEM_DATA_LOSS;
    }
    snprintf(r->account, sizeof(r->account), "merchant:%s", merchant);
    if ((code = pay_order_status_read(r->svc, r->order_id, state, cap)) != IDEM_OK) {
        return code;
    }
    return pay_ledger_read(st, r->account, &r->balance, &r->seen);
}

static idem_code refund_attempt(void *arg, uint32_t attempt)
{
    refund *r = arg;
    char state[IDEM_SM_MAX_STATE + 1];
    r->attempts = attempt;
    r->already = false;
    idem_code code = refund_snapshot(r, state, sizeof(state));
    if (code != IDEM_OK) {
        return code;
    }
    if (strcmp(state, "REFUNDED") == 0) {
        r->already = true;
        return IDEM_OK;
    }
    if (strcmp(state, "PAID") != 0) {
        return IDEM_FAILED_PRECONDITION;
    }
    if (r->balance < r->amount) {
        return IDEM_OUT_OF_RANGE; /* the money was settled already: never below zero */
    }
    return idem_store_run_txn(r->svc->store, refund_write, r);
}

/* Every attempt lost a race: a real service would page someone here. */
static void refund_exhausted(void *fn_arg, uint32_t attempts, void *hook_arg)
{
    (void)hook_arg;
    refund *r = fn_arg;
    fprintf(stderr, "idemrpc-payments: ALERT refund of %s gave up after %u conflicts\n",
            r->order_id, attempts);
}

idem_code pay_order_refund(idem_call *call, void *arg)
{
    refund r = {.svc = arg};
    size_t n;
    const void *p = idem_call_payload(call, &n);
    const idem_conflict_policy policy = {.max_attempts = 8, .on_exhausted = refund_exhausted};
    if (!pay_form_get(p, n, "order_id", r.order_id, sizeof(r.order_id))) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload: order_id=ID");
    }
    idem_code code = idem_retry_on_conflict(&policy, refund_attempt, &r);
    switch (code) {
    case IDEM_OK:
        break;
    case IDEM_FAILED_PRECONDITION:
        return idem_call_fail(call, code, "order %s is not paid", r.order_id);
    case IDEM_OUT_OF_RANGE:
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION,
                              "insufficient merchant balance (%lld) to refund %lld", r.balance,
                              r.amount);
    default: /* ABORTED after the last conflict is transient: the claim is released */
        return idem_call_fail(call, code, "refund %s: %s", r.order_id, pay_errmsg());
    }
    if (r.already) {
        return pay_reply(call, "order_id=%s&state=REFUNDED&already=1", r.order_id);
    }
    return pay_reply(call, "order_id=%s&state=REFUNDED&refunded=%lld&balance=%lld&attempts=%u",
                     r.order_id, r.amount, r.balance, r.attempts);
}

/* pay.Callback/Notify: the payment channel's asynchronous "paid" callback.
 *
 * Channels resend a callback until they get "success", so the same notification arrives
 * many times, on any instance. Three layers make it one effect:
 *   1. the key extractor turns (channel, out_trade_no) into the idempotency key, so every
 *      resend is a duplicate of the first call and replays its stored answer;
 *   2. the handler is transactional: PAID, the merchant's credit, the commission messages
 *      and the idempotency record commit in one store txn, or none of them;
 *   3. a call that got past the cache (its record expired, another caller scope) is
 *      stopped by the business data itself. On LMDB the state machine's CREATED → PAID
 *      is a compare-and-set that finds PAID. On PostgreSQL the notification goes into the
 *      table pay_callback, whose unique key (out_trade_no, channel) finds it recorded,
 *      and the order moves with UPDATE pay_order ... WHERE status = 'CREATED', which
 *      changes one row once (pg_tables.c).
 * Payload: "out_trade_no=ORD-..&channel=alipay&amount=CENTS&trade_status=SUCCESS". */
#include <stdio.h>
#include <string.h>

#include "payments.h"

bool pay_notify_key(const idem_call *call, char *buf, size_t cap, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    char trade_no[PAY_MAX_FIELD], channel[PAY_MAX_FIELD];
    if (!pay_form_get(p, n, "out_trade_no", trade_no, sizeof(trade_no)) ||
        !pay_form_get(p, n, "channel", channel, sizeof(channel))) {
        return false; /* no key: the method requires one, the call gets INVALID_ARGUMENT */
    }
    int len = snprintf(buf, cap, "notify:%s:%s", channel, trade_no);
    return len > 0 && (size_t)len < cap;
}

typedef struct notify {
    char trade_no[PAY_MAX_FIELD], channel[PAY_MAX_FIELD], status[PAY_MAX_FIELD];
    long long amount;
} notify;

static bool notify_parse(idem_call *call, notify *nt)
{
    size_t n;
    const void *p = idem_call_payload(call, &n);
    return pay_form_get(p, n, "out_trade_no", nt->trade_no, sizeof(nt->trade_no)) &&
           pay_form_get(p, n, "channel", nt->channel, sizeof(nt->channel)) &&
           pay_form_get(p, n, "trade_status", nt->status, sizeof(nt->status)) &&
           pay_form_amount(p, n, "amount", &nt->amount);
}

/* The order is not CREATED: a refunded order was paid before (the channel is late);
 * anything else (CANCELLED) is a real conflict that needs a person. The final error
 * rolls back what this call wrote (the pay_callback row) and is recorded. */
static idem_code notify_conflict(idem_call *call, idem_txn *t, const notify *nt)
{
    char state[IDEM_SM_MAX_STATE + 1], why[256];
    snprintf(why, sizeof(why), "%s", pay_errmsg());
    if (pay_order_status(t, nt->trade_no, state, sizeof(state)) == IDEM_OK &&
        strcmp(state, "REFUNDED") == 0) {
        return idem_call_reply(call, IDEM_OK, "success", 7); /* paid, then refunded */
    }
    return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "order %s cannot be paid: %s",
                          nt->trade_no, why);
}

/* PostgreSQL: records the notification in pay_callback; *first is false when it was
 * recorded (and so applied) before. LMDB has no such table: *first stays true. */
static idem_code record_callback(idem_txn *t, const notify *nt, bool *first)
{
    *first = true;
    if (idem_txn_pg_conn(t) == NULL) {
        return IDEM_OK;
    }
    return pay_sql_callback_insert(t, nt->trade_no, nt->channel, nt->amount, first);
}

/* Checks first, then writes. Any answer but OK rolls the writes back (a final one is
 * recorded and replayed, a transient one frees the key for the retry). */
idem_code pay_callback_notify(idem_call *call, void *arg)
{
    pay_service *svc = arg;
    idem_txn *t = idem_call_txn(call);
    notify nt;
    char merchant[PAY_MAX_FIELD], account[PAY_MAX_FIELD + 16];
    long long amount;
    idem_sm_outcome out;
    bool first;
    if (!notify_parse(call, &nt) || strcmp(nt.status, "SUCCESS") != 0) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT,
                              "payload: out_trade_no=..&channel=..&amount=..&trade_status=SUCCESS");
    }
    idem_code code = pay_order_load(t, nt.trade_no, merchant, &amount);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "order %s: %s", nt.trade_no, idem_code_name(code));
    }
    if (amount != nt.amount) {
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION,
                              "amount %lld does not match order %s (%lld)", nt.amount, nt.trade_no,
                              amount);
    }
    if ((code = record_callback(t, &nt, &first)) != IDEM_OK) {
        return pay_rollback(call, code, "pay_callback");
    }
    if (!first) { /* this call got past the cache: the notification was applied before */
        return idem_call_reply(call, IDEM_OK, "success", 7);
    }
    code = pay_order_move(t, nt.trade_no, "CREATED", "PAID", &out);
    if (code == IDEM_FAILED_PRECONDITION) {
        return notify_conflict(call, t, &nt);
    }
    if (code != IDEM_OK) {
        return pay_rollback(call, code, "order state");
    }
    if (out == IDEM_SM_ADVANCED) { /* the one time this order is paid */
        snprintf(account, sizeof(account), "merchant:%s", merchant);
        if ((code = pay_ledger_add(t, account, amount, NULL)) != IDEM_OK ||
            (code = pay_commission_enqueue(svc, t, nt.trade_no, merchant, amount)) != IDEM_OK) {
            return pay_rollback(call, code, "credit");
        }
    }
    return idem_call_reply(call, IDEM_OK, "success", 7); /* what channels wait for */
}

/* Orders: created by a token-protected submit, then moved only along the state machine.
 *
 *   CREATED ──Notify──▶ PAID ──Refund──▶ REFUNDED
 *      └──Cancel──▶ CANCELLED
 * Create and Cancel are transactional handlers: the order, its status and the
 * idempotency record commit in one store txn, so a retried submit replays the first
 * order id. The status is the toolkit's state machine on LMDB and the service's own
 * table pay_order on PostgreSQL (pg_tables.c); every move goes through pay_order_move,
 * a compare-and-set on either. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "payments.h"

static const char *const order_states[] = {"CREATED", "PAID", "REFUNDED", "CANCELLED"};
static const idem_sm_transition order_moves[] = {
    {"CREATED", "PAID"},
    {"PAID", "REFUNDED"},
    {"CREATED", "CANCELLED"},
};
const idem_state_machine pay_order_machine = {"order_state", order_states, 4, order_moves, 3};

static const char SEQ_KEY[] = "order";

/* Parses a stored order record "merchant=..&amount=..". */
static idem_code order_parse(const void *v, size_t n, char *merchant, long long *amount)
{
    if (!pay_form_get(v, n, "merchant", merchant, PAY_MAX_FIELD) ||
        !pay_form_amount(v, n, "amount", amount)) {
        return IDEM_DATA_LOSS;
    }
    return IDEM_OK;
}

idem_code pay_order_load(idem_txn *t, const char *order_id, char *merchant, long long *amount)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, PAY_DB_ORDERS, order_id, strlen(order_id), &v, &n);
    return code != IDEM_OK ? code : order_parse(v, n, merchant, amount);
}

/* A PostgreSQL txn has a connection: the status is in pay_order. */
static bool in_pg(idem_txn *t)
{
    return idem_txn_pg_conn(t) != NULL;
}

idem_code pay_order_move(idem_txn *t, const char *order_id, const char *from, const char *to,
                         idem_sm_outcome *out)
{
    if (!in_pg(t)) {
        return idem_sm_advance(t, &pay_order_machine, order_id, from, to, out);
    }
    if (!idem_sm_allowed(&pay_order_machine, from, to)) { /* the machine still declares moves */
        pay_set_errmsg("illegal transition %s -> %s", from, to);
        return IDEM_FAILED_PRECONDITION;
    }
    return pay_sql_order_move(t, order_id, from, to, out);
}

idem_code pay_order_status(idem_txn *t, const char *order_id, char *buf, size_t cap)
{
    return in_pg(t) ? pay_sql_order_status(t, order_id, buf, cap)
                    : idem_sm_get(t, &pay_order_machine, order_id, buf, cap);
}

typedef struct status_read {
    const char *order_id;
    char *buf;
    size_t cap;
} status_read;

static idem_code status_read_txn(idem_txn *t, void *arg)
{
    status_read *s = arg;
    return pay_sql_order_status(t, s->order_id, s->buf, s->cap);
}

idem_code pay_order_status_read(pay_service *svc, const char *order_id, char *buf, size_t cap)
{
    status_read s = {order_id, buf, cap};
    if (!svc->pg) {
        return idem_store_sm_get(svc->store, &pay_order_machine, order_id, buf, cap);
    }
    return idem_store_run_txn(svc->store, status_read_txn, &s); /* a txn that only reads */
}

static idem_code next_order_number(idem_txn *t, uint64_t *seq)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, PAY_DB_SEQ, SEQ_KEY, strlen(SEQ_KEY), &v, &n);
    *seq = 1;
    if (code == IDEM_OK && n == sizeof(*seq)) {
        memcpy(seq, v, sizeof(*seq));
    } else if (code != IDEM_NOT_FOUND) {
        return code == IDEM_OK ? IDEM_DATA_LOSS : code;
    }
    return IDEM_OK;
}

static void slow_down(unsigned ms)
{
    struct timespec ts = {ms / 1000u, (long)(ms % 1000u) * 1000000L};
    while (ms > 0 && nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* pay.Order/Create "merchant=M&amount=CENTS" → "order_id=ORD-00000001&state=CREATED&..". */
idem_code pay_order_create(idem_call *call, void *arg)
{
    pay_service *svc = arg;
    idem_txn *t = idem_call_txn(call);
    size_t n;
    const void *p = idem_call_payload(call, &n);
    char merchant[PAY_MAX_FIELD], id[32], rec[160];
    long long amount;
    uint64_t seq;
    idem_code code;
    if (!pay_form_get(p, n, "merchant", merchant, sizeof(merchant)) ||
        !pay_form_amount(p, n, "amount", &amount)) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload: merchant=ID&amount=CENTS");
    }
    slow_down(svc->faults.create_delay_ms); /* the tests' slow first attempt */
    if ((code = next_order_number(t, &seq)) != IDEM_OK) {
        return pay_rollback(call, code, "order number");
    }
    snprintf(id, sizeof(id), "ORD-%08llu", (unsigned long long)seq);
    int len = snprintf(rec, sizeof(rec), "merchant=%s&amount=%lld", merchant, amount);
    seq++;
    if ((code = idem_txn_put(t, PAY_DB_ORDERS, id, strlen(id), rec, (size_t)len)) != IDEM_OK ||
        (code = in_pg(t) ? pay_sql_order_insert(t, id)
                         : idem_sm_create(t, &pay_order_machine, id, "CREATED")) != IDEM_OK ||
        (code = idem_txn_put(t, PAY_DB_SEQ, SEQ_KEY, strlen(SEQ_KEY), &seq, sizeof(seq))) !=
            IDEM_OK) {
        return pay_rollback(call, code, "create order");
    }
    return pay_reply(call, "order_id=%s&state=CREATED&merchant=%s&amount=%lld", id, merchant,
                     amount);
}

/* pay.Order/Cancel "order_id=X": CREATED → CANCELLED; a paid order cannot be cancelled. */
idem_code pay_order_cancel(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    char id[PAY_MAX_FIELD];
    idem_sm_outcome out;
    if (!pay_form_get(p, n, "order_id", id, sizeof(id))) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload: order_id=ID");
    }
    idem_code code = pay_order_move(idem_call_txn(call), id, "CREATED", "CANCELLED", &out);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", pay_errmsg()); /* nothing was written */
    }
    return pay_reply(call, "order_id=%s&state=CANCELLED%s", id,
                     out == IDEM_SM_DUPLICATE ? "&already=1" : "");
}

/* pay.Order/Get "order_id=X" → "order_id=X&state=S&merchant=M&amount=N" (read-only). */
idem_code pay_order_get(idem_call *call, void *arg)
{
    pay_service *svc = arg;
    size_t n, vlen;
    const void *p = idem_call_payload(call, &n);
    char id[PAY_MAX_FIELD], merchant[PAY_MAX_FIELD], state[IDEM_SM_MAX_STATE + 1];
    long long amount;
    void *v;
    if (!pay_form_get(p, n, "order_id", id, sizeof(id))) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload: order_id=ID");
    }
    idem_code code = idem_store_app_get(svc->store, PAY_DB_ORDERS, id, strlen(id), &v, &vlen);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "order %s: %s", id, idem_errmsg());
    }
    code = order_parse(v, vlen, merchant, &amount);
    free(v);
    if (code == IDEM_OK) {
        code = pay_order_status_read(svc, id, state, sizeof(state));
    }
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "order %s unreadable: %s", id, pay_errmsg());
    }
    return pay_reply(call, "order_id=%s&state=%s&merchant=%s&amount=%lld", id, state, merchant,
                     amount);
}

/* pay.Order/Count → "orders=N": how many orders were ever created. */
idem_code pay_order_count(idem_call *call, void *arg)
{
    pay_service *svc = arg;
    void *v;
    size_t n;
    uint64_t next = 1;
    idem_code code = idem_store_app_get(svc->store, PAY_DB_SEQ, SEQ_KEY, strlen(SEQ_KEY), &v, &n);
    if (code == IDEM_OK) {
        if (n == sizeof(next)) {
            memcpy(&next, v, sizeof(next));
        }
        free(v);
    } else if (code != IDEM_NOT_FOUND) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    return pay_reply(call, "orders=%llu", (unsigned long long)(next - 1));
}

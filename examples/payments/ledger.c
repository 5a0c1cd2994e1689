/* Balances: one versioned record per account ("merchant:<id>", "commission:<rule>"),
 * int64 cents. Every write states the version it read (toolkit.h, versioned records):
 * inside one txn that always holds, across a snapshot read and a later write txn it is
 * what turns a lost update into an ABORTED that the caller retries. A balance never goes
 * below zero: such a write is refused before anything is written. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "payments.h"

static idem_code decode_balance(const void *v, size_t n, long long *balance)
{
    if (n != sizeof(*balance)) {
        return IDEM_DATA_LOSS;
    }
    memcpy(balance, v, sizeof(*balance));
    return IDEM_OK;
}

idem_code pay_ledger_cas(idem_txn *t, const char *account, uint64_t seen, long long balance)
{
    if (balance < 0) {
        return IDEM_FAILED_PRECONDITION;
    }
    return idem_versioned_put(t, PAY_DB_BALANCES, account, strlen(account), seen, &balance,
                              sizeof(balance), NULL);
}

idem_code pay_ledger_add(idem_txn *t, const char *account, long long delta, long long *new_balance)
{
    const void *v;
    size_t n;
    uint64_t version;
    long long balance = 0;
    idem_code code =
        idem_versioned_get(t, PAY_DB_BALANCES, account, strlen(account), &v, &n, &version);
    if (code == IDEM_OK) {
        code = decode_balance(v, n, &balance);
    } else if (code == IDEM_NOT_FOUND) {
        code = IDEM_OK;
    }
    if (code != IDEM_OK) {
        return code;
    }
    if (balance + delta < 0) {
        return IDEM_FAILED_PRECONDITION; /* insufficient balance: nothing written */
    }
    if ((code = pay_ledger_cas(t, account, version, balance + delta)) == IDEM_OK &&
        new_balance != NULL) {
        *new_balance = balance + delta;
    }
    return code;
}

idem_code pay_ledger_read(idem_store *st, const char *account, long long *balance,
                          uint64_t *version)
{
    void *v;
    size_t n;
    *balance = 0;
    idem_code code =
        idem_store_versioned_get(st, PAY_DB_BALANCES, account, strlen(account), &v, &n, version);
    if (code == IDEM_NOT_FOUND) {
        return IDEM_OK; /* never written: 0 at version 0 */
    }
    if (code == IDEM_OK) {
        code = decode_balance(v, n, balance);
        free(v);
    }
    return code;
}

/* pay.Merchant/Settle "merchant=M&amount=CENTS": pays out to the merchant's bank, i.e.
 * debits the balance; refused (nothing written) when the balance is short. */
idem_code pay_merchant_settle(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    char merchant[PAY_MAX_FIELD], account[PAY_MAX_FIELD + 16];
    long long amount, balance;
    if (!pay_form_get(p, n, "merchant", merchant, sizeof(merchant)) ||
        !pay_form_amount(p, n, "amount", &amount)) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload: merchant=ID&amount=CENTS");
    }
    snprintf(account, sizeof(account), "merchant:%s", merchant);
    idem_code code = pay_ledger_add(idem_call_txn(call), account, -amount, &balance);
    if (code == IDEM_FAILED_PRECONDITION) {
        return idem_call_fail(call, code, "insufficient balance to settle %lld", amount);
    }
    if (code != IDEM_OK) {
        return pay_rollback(call, code, "settle");
    }
    return pay_reply(call, "settled=%lld&balance=%lld", amount, balance);
}

/* ---- the daily settlement, once per merchant and day across all instances ---- */

#define PAY_DB_SETTLEMENTS "settlements" /* "M:DAY" → "payout=N" */

typedef struct settle_day {
    char account[PAY_MAX_FIELD + 16], key[2 * PAY_MAX_FIELD + 2];
    long long payout;
} settle_day;

/* 二判: settled before? (in the lock's fenced txn: a newer holder's work is visible) */
static idem_code settled_before(idem_txn *t, void *arg)
{
    settle_day *s = arg;
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, PAY_DB_SETTLEMENTS, s->key, strlen(s->key), &v, &n);
    if (code == IDEM_OK) {
        s->payout = pay_form_amount(v, n, "payout", &s->payout) ? s->payout : 0;
        return IDEM_ALREADY_EXISTS;
    }
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

/* 三更新: pay the whole balance out and record the day as settled, in one txn. */
static idem_code settle_now(idem_txn *t, void *arg)
{
    settle_day *s = arg;
    const void *v;
    size_t len;
    uint64_t version = 0;
    char rec[48];
    s->payout = 0;
    idem_code code =
        idem_versioned_get(t, PAY_DB_BALANCES, s->account, strlen(s->account), &v, &len, &version);
    if (code == IDEM_OK) {
        code = decode_balance(v, len, &s->payout);
    } else if (code == IDEM_NOT_FOUND) {
        code = IDEM_OK;
    }
    if (code == IDEM_OK && s->payout > 0) {
        code = pay_ledger_cas(t, s->account, version, 0);
    }
    int n = snprintf(rec, sizeof(rec), "payout=%lld", s->payout);
    return code != IDEM_OK
               ? code
               : idem_txn_put(t, PAY_DB_SETTLEMENTS, s->key, strlen(s->key), rec, (size_t)n);
}

/* pay.Merchant/SettleDay "merchant=M&day=YYYY-MM-DD": the end-of-day payout of the
 * merchant's whole balance. Each instance's scheduler sends it with a key of its own,
 * so the result cache cannot make it once; 一锁二判三更新 (idem_locked_update) does: the
 * lock settle:M:DAY, the check "settled before?", the payout, in one fenced txn. The
 * answer is "settled=N" or "already_settled=N". */
idem_code pay_merchant_settle_day(idem_call *call, void *arg)
{
    pay_service *svc = arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    char merchant[PAY_MAX_FIELD], day[16], lock[2 * PAY_MAX_FIELD + 16];
    settle_day s = {0};
    if (!pay_form_get(p, n, "merchant", merchant, sizeof(merchant)) ||
        !pay_form_get(p, n, "day", day, sizeof(day))) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload: merchant=ID&day=YYYY-MM-DD");
    }
    snprintf(s.account, sizeof(s.account), "merchant:%s", merchant);
    snprintf(s.key, sizeof(s.key), "%s:%s", merchant, day);
    snprintf(lock, sizeof(lock), "settle:%s", s.key);
    idem_lock_opts lo = {.wait_ms = 10000};
    idem_locked_outcome out;
    idem_code code =
        idem_locked_update(svc->store, "payments", lock, &lo, settled_before, settle_now, &s, &out);
    if (code != IDEM_OK) {
        return pay_rollback(call, code, "settle day");
    }
    return pay_reply(call, "%s=%lld", out == IDEM_LOCKED_UPDATED ? "settled" : "already_settled",
                     s.payout);
}

/* pay.Account/Balance "account=merchant:M" → "balance=N&version=V" (read-only). */
idem_code pay_account_balance(idem_call *call, void *arg)
{
    pay_service *svc = arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    char account[PAY_MAX_FIELD + 16];
    long long balance;
    uint64_t version;
    if (!pay_form_get(p, n, "account", account, sizeof(account))) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload: account=NAME");
    }
    idem_code code = pay_ledger_read(svc->store, account, &balance, &version);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "balance of %s unreadable", account);
    }
    return pay_reply(call, "balance=%lld&version=%llu", balance, (unsigned long long)version);
}

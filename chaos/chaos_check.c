/* The checker: reads the history, the effect log, the store agent's log (lmdb) and the
 * final store (LMDB opened read-only, or the PostgreSQL table), and reports
 *   answers   two definitive answers for one (caller, method, key) that differ; a
 *             refusal of a well-formed call (INVALID_ARGUMENT, PERMISSION_DENIED, a
 *             FAILED_PRECONDITION other than "insufficient funds"); a
 *             RESOURCE_EXHAUSTED that names neither a full store nor a busy server
 *   effects   an acknowledged call whose effect is missing; a refused transfer that
 *             took effect; a key whose effect shows more than once (claim mode: unless
 *             the older execution's owner could not renew, which README documents as
 *             at-least-once: its process was killed or stopped around it, or the store
 *             took no write for 2/3 of a lease while it ran); money not conserved, or
 *             balances that are not the sum of the transfers that took effect; on
 *             lmdb, a transactional key whose effect and COMPLETED record disagree (an
 *             effect without a record, an OK record without its effect, a recorded
 *             refusal with one)
 *   callers   an answer that names another caller or key (someone else's result);
 *             a token that ran twice
 *   records   a record of this run still IN_PROGRESS after the settle pass (every
 *             operation was retried until decided, past the lease); an operation that
 *             stayed undecided
 *   steps     (chaos.Trip/Book, chaos_check_book.c) a step's effect ("hold", "pay")
 *             that shows more than once for a (caller, key) without evidence that the
 *             owner could not record it; OK answers or the COMPLETED record naming step
 *             outputs that differ, or that no effect line matches; a journaled call left
 *             IN_PROGRESS after settling (the re-driver did not finish it); a journal
 *             that outlived its call's outcome
 *   memory    a server whose anonymous RSS (RssAnon: LMDB's map is file-backed and
 *             grows with the data) more than doubles + 16 MiB between a quarter of its
 *             life and its end, over a life of at least 20 s
 *   crashes   a server that died without being killed, or did not stop on SIGTERM
 *   http      (slow_http) a slow client's connection still open when the fault ended
 *             (5-8 s), or an ordinary request not answered while slow clients trickled;
 *             (slow_grpc) a trickling or silent gRPC stream still open when the fault
 *             ended, or the health check not answered meanwhile
 * The files of the checker: chaos_check.h. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chaos_check.h"

chaos_ck ck;

static const char *const x_names[X_N_KINDS] = {
    "their process was killed",
    "their process was stopped",
    "the store took no write for 2/3 of a lease",
    "the store refused the step's record for 10 s",
    "a run stopped before the step lost its claim, then ran it (record refused: ABORTED)",
    "their lease ran out by their owner's own count (it logged the lapse)"};
const char *const f_names[F_N_KINDS] = {"kill",       "stop",      "fill",      "pg_restart",
                                        "redis_stop", "partition", "slow_db",   "hung_host",
                                        "undo_crash", "slow_http", "slow_grpc", "other"};
static const char *const v_names[] = {"answers", "effects", "callers", "records",
                                      "memory",  "crashes", "http"};

void ck_violation(int kind, const char *fmt, ...)
{
    ck.violations++;
    if (ck.shown[kind]++ >= MAX_SHOWN) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    printf("violation: %s: ", v_names[kind]);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

entry *ck_lookup(const char *method, const char *caller, const char *key, bool create)
{
    uint64_t h = chaos_digest(method, strlen(method)) ^ chaos_digest(caller, strlen(caller)) * 31 ^
                 chaos_digest(key, strlen(key)) * 131;
    entry **b = &ck.buckets[h % BUCKETS];
    for (entry *e = *b; e != NULL; e = e->next) {
        if (strcmp(e->key, key) == 0 && strcmp(e->caller, caller) == 0 &&
            strcmp(e->method, method) == 0) {
            return e;
        }
    }
    entry *e = create ? calloc(1, sizeof(*e)) : NULL;
    if (e != NULL) {
        snprintf(e->method, sizeof(e->method), "%s", method);
        snprintf(e->caller, sizeof(e->caller), "%s", caller);
        snprintf(e->key, sizeof(e->key), "%s", key);
        if (strcmp(method, CHAOS_METHOD_BOOK) == 0 && (e->book = calloc(1, sizeof(book))) == NULL) {
            free(e);
            return NULL;
        }
        e->next = *b;
        *b = e;
    }
    return e;
}

static void each_entry(void (*fn)(entry *, const chaos_cfg *), const chaos_cfg *cfg)
{
    for (size_t i = 0; i < BUCKETS; i++) {
        for (entry *e = ck.buckets[i]; e != NULL; e = e->next) {
            fn(e, cfg);
        }
    }
}

/* Documented at-least-once (README: claim mode runs again when its owner cannot renew
 * for a lease): the older claim's process was killed or stopped while (or shortly
 * before) its execution, or the store took no write at all while it ran, for at least
 * 2/3 of a lease, the most a lease renewed every lease/3 has left when that begins (a
 * process stopped holding LMDB's writer lock, a slow fsync, a full map: the agent's
 * no_commit). Returns the excuse (X_*) or -1. A stop of the other process that left
 * the store writable excuses nothing. */
static int duplicate_excuse(const entry *e, const chaos_cfg *cfg)
{
    const execution *low = &e->exec[0];
    uint64_t last = 0;
    for (size_t i = 0; i < e->n_exec; i++) {
        low = e->exec[i].fence < low->fence ? &e->exec[i] : low;
        last = e->exec[i].t > last ? e->exec[i].t : last;
    }
    uint64_t window = 3 * cfg->lease_ms + 1000; /* a stop lasts at most 3 leases */
    for (size_t i = 0; i < ck.n_faults; i++) {
        if (ck.faults[i].pid == low->pid && ck.faults[i].t + window >= low->t &&
            ck.faults[i].t <= last) {
            return ck.faults[i].stop ? X_STOPPED : X_KILLED;
        }
    }
    for (size_t i = 0; i < ck.n_stalls; i++) {
        const stall *s = &ck.stalls[i];
        if (3 * (s->to - s->from) >= 2 * cfg->lease_ms && s->to >= low->t && s->from <= last) {
            return X_NO_WRITE;
        }
    }
    /* The owner's own word: its lease ran out (no renewal landed in time) between its
     * claim and the later run. */
    return ck_lapsed(e->key, low->t > window ? low->t - window : 0, last) ? X_LAPSED : -1;
}

static long long ledger_expected[CHAOS_ACCOUNTS];

/* A transactional key (lmdb): its effect and its COMPLETED record commit together, so
 * they must agree; a refusal ("insufficient funds") is recorded without an effect. */
static void check_record(const entry *e)
{
    idem_key_ref ref = {e->caller, e->method, e->key};
    idem_record rec;
    idem_code code = idem_store_get(ck.store, &ref, &rec);
    bool completed = code == IDEM_OK && rec.state == IDEM_REC_COMPLETED;
    bool refusal = completed && rec.response != NULL &&
                   memmem(rec.response, rec.response_len, "insufficient funds", 18) != NULL;
    if (e->effects > 0 && !completed) {
        ck_violation(V_EFFECTS, "%s caller=%s key=%s took effect without a completed record",
                     e->method, e->caller, e->key);
    } else if (completed && !refusal && e->effects == 0) {
        ck_violation(V_EFFECTS, "%s caller=%s key=%s has an OK record but no effect", e->method,
                     e->caller, e->key);
    } else if (refusal && e->effects > 0) {
        ck_violation(V_EFFECTS, "%s caller=%s key=%s recorded a refusal but took effect", e->method,
                     e->caller, e->key);
    }
    idem_record_clear(&rec);
}

static void check_effects(entry *e, const chaos_cfg *cfg)
{
    if (e->book != NULL) {
        ck_check_book(e, cfg);
        return;
    }
    bool txn = strcmp(e->method, CHAOS_METHOD_ADD) != 0; /* transactional on both stores */
    if (e->payload[0] == '\0' && e->n_definitive == 0 && e->effects == 0) {
        return; /* only a token issue, never sent */
    }
    int excuse = e->effects > 1 && !txn ? duplicate_excuse(e, cfg) : -1;
    if (e->effects > 1 && excuse < 0) {
        ck_violation(strcmp(e->method, CHAOS_METHOD_ORDER) == 0 ? V_CALLERS : V_EFFECTS,
                     "%s caller=%s key=%s took effect %lld times", e->method, e->caller, e->key,
                     e->effects);
    } else if (e->effects > 1) {
        ck.excused[excuse]++;
    }
    if (txn) {
        check_record(e);
    }
    if (e->acked_ok && e->effects == 0) {
        ck_violation(V_EFFECTS, "%s caller=%s key=%s acknowledged '%s' but no effect", e->method,
                     e->caller, e->key, e->body);
    }
    if (strcmp(e->method, CHAOS_METHOD_TRANSFER) == 0) {
        int a, b;
        long long amount;
        if (e->n_definitive > 0 && !e->acked_ok && e->effects > 0) {
            ck_violation(V_EFFECTS, "transfer %s refused ('%s') but took effect", e->key, e->body);
        }
        if (sscanf(e->payload, "%d %d %lld", &a, &b, &amount) == 3 && a >= 0 && b >= 0 &&
            a < CHAOS_ACCOUNTS && b < CHAOS_ACCOUNTS) {
            ledger_expected[a] -= amount * e->effects;
            ledger_expected[b] += amount * e->effects;
        }
    }
    if (e->n_definitive == 0 && !e->refused) {
        ck_violation(V_RECORDS, "%s caller=%s key=%s never decided, even by the settle pass",
                     e->method, e->caller, e->key);
    }
}

static long long app_count(idem_store *st, const char *db, const char *key)
{
    void *v;
    size_t n;
    long long x = 0;
    if (idem_store_app_get(st, db, key, strlen(key), &v, &n) == IDEM_OK) {
        if (n == sizeof(x)) {
            memcpy(&x, v, sizeof(x));
        }
        free(v);
    }
    return x;
}

static void read_app_counts(entry *e, const chaos_cfg *cfg)
{
    (void)cfg;
    if (strcmp(e->method, CHAOS_METHOD_TRANSFER) == 0) {
        e->effects = app_count(ck.store, "applied", e->key);
    } else if (strcmp(e->method, CHAOS_METHOD_ORDER) == 0) {
        e->effects = app_count(ck.store, "orders", e->key);
    }
}

static void check_ledger(idem_store *st)
{
    long long sum = 0;
    for (int i = 0; i < CHAOS_ACCOUNTS; i++) {
        char acct[16];
        void *v;
        size_t n;
        long long bal = CHAOS_INITIAL_BALANCE;
        snprintf(acct, sizeof(acct), "acct-%02d", i);
        if (idem_store_app_get(st, "ledger", acct, strlen(acct), &v, &n) == IDEM_OK) {
            if (n == sizeof(bal)) {
                memcpy(&bal, v, sizeof(bal));
            }
            free(v);
        }
        sum += bal;
        if (bal != CHAOS_INITIAL_BALANCE + ledger_expected[i] || bal < 0) {
            ck_violation(V_EFFECTS, "%s holds %lld, the transfers that took effect say %lld", acct,
                         bal, CHAOS_INITIAL_BALANCE + ledger_expected[i]);
        }
    }
    if (sum != (long long)CHAOS_ACCOUNTS * CHAOS_INITIAL_BALANCE) {
        ck_violation(V_EFFECTS, "money not conserved: %lld in the ledger, %lld expected", sum,
                     (long long)CHAOS_ACCOUNTS * CHAOS_INITIAL_BALANCE);
    }
}

static bool visit_record(void *arg, const idem_key_ref *key, const idem_record *rec)
{
    const chaos_cfg *cfg = arg;
    if (strncmp(key->caller, cfg->run, strlen(cfg->run)) == 0 &&
        rec->state == IDEM_REC_IN_PROGRESS && strcmp(key->method, CHAOS_METHOD_BOOK) != 0) {
        ck_violation(V_RECORDS, "%s caller=%s key=%s still IN_PROGRESS after the run settled",
                     key->method, key->caller, key->key);
    }
    return true;
}

/* The campaign's store, read-only: the checker must not change what it checks. */
static idem_code open_store(const chaos_cfg *cfg, idem_store **st)
{
    char dir[600];
    if (cfg->topology == CHAOS_PG) {
        return idem_store_open_postgres(st, cfg->pg, 1);
    }
    snprintf(dir, sizeof(dir), "%s/store", cfg->dir);
    return idem_store_open_lmdb(st, dir, 0, IDEM_STORE_READONLY);
}

static bool check_store(const chaos_cfg *cfg)
{
    idem_store *st;
    if (open_store(cfg, &st) != IDEM_OK) {
        fprintf(stderr, "idemrpc-chaos: cannot open the store: %s\n", idem_errmsg());
        return false;
    }
    ck.store = st;
    each_entry(read_app_counts, cfg);
    each_entry(check_effects, cfg);
    check_ledger(st);
    if (idem_store_foreach(st, visit_record, (void *)cfg) != IDEM_OK) {
        fprintf(stderr, "idemrpc-chaos: reading the records: %s\n", idem_errmsg());
    }
    idem_store_close(st);
    return true;
}

static void check_memory(void)
{
    for (size_t i = 0; i < ck.n_lives; i++) {
        const rss_life *l = &ck.lives[i];
        if (l->n < 8 || l->last_t - l->first_t < 20000) {
            continue;
        }
        long early = l->kib[l->n / 4], late = l->kib[l->n - 1];
        if (late > 2 * early + 16384) {
            ck_violation(V_MEMORY,
                         "server pid %ld: RssAnon %ld KiB at a quarter of its life, %ld "
                         "KiB at the end",
                         l->pid, early, late);
        }
    }
}

/* The note lines: excused duplicates, the Books, the re-driver, the refusals. */
static void print_notes(const chaos_cfg *cfg)
{
    uint64_t excused = ck.excused[X_KILLED] + ck.excused[X_STOPPED] + ck.excused[X_NO_WRITE] +
                       ck.excused[X_LAPSED];
    if (excused > 0) {
        printf("note: %" PRIu64 " claim-mode keys ran twice where their owner could not renew "
               "(at-least-once, as documented): %" PRIu64 " %s, %" PRIu64 " %s, %" PRIu64
               " %s, %" PRIu64 " %s\n",
               excused, ck.excused[X_KILLED], x_names[X_KILLED], ck.excused[X_STOPPED],
               x_names[X_STOPPED], ck.excused[X_NO_WRITE], x_names[X_NO_WRITE],
               ck.excused[X_LAPSED], x_names[X_LAPSED]);
    }
    uint64_t bx = 0;
    for (int x = 0; x < X_N_KINDS; x++) {
        bx += ck.bk.excused[x];
    }
    printf("chaos: steps: %" PRIu64 " Book calls, %" PRIu64 " keys (%" PRIu64
           " abandoned by their client): %" PRIu64 " completed OK, %" PRIu64
           " completed with an error, %" PRIu64 " without a record (released or never "
           "arrived; %" PRIu64 " of them released after a step was recorded), %" PRIu64
           " abandoned before a step was recorded\n",
           ck.bk.calls, ck.bk.keys, ck.bk.abandoned, ck.bk.completed_ok, ck.bk.completed_other,
           ck.bk.no_record, ck.bk.held_released, ck.bk.unstarted);
    printf("chaos: compensations: %" PRIu64 " declined Book keys, %" PRIu64 " undos (%" PRIu64
           " beyond their holds, each with evidence; %" PRIu64 " of holds of Books not declined, "
           "which the re-driver gave up), %" PRIu64 " undos failed transiently\n",
           ck.bk.declined, ck.bk.undos, ck.bk.undos_again, ck.bk.given_back, ck.bk.undo_transient);
    printf("chaos: re-driver (%s): %" PRIu64 " re-runs in the servers' logs (%" PRIu64
           " OK, %" PRIu64 " OK replayed, %" PRIu64 " other)\n",
           cfg->redrive_ms > 0 ? "on" : "OFF",
           ck.bk.redrives[0] + ck.bk.redrives[1] + ck.bk.redrives[2], ck.bk.redrives[0],
           ck.bk.redrives[1], ck.bk.redrives[2]);
    if (bx > 0) {
        printf("note: %" PRIu64 " step effects shown again where their owner could not record "
               "them (at-least-once, downstream.h): %" PRIu64 " %s, %" PRIu64 " %s, %" PRIu64
               " %s, %" PRIu64 " %s, %" PRIu64 " %s, %" PRIu64 " %s\n",
               bx, ck.bk.excused[X_KILLED], x_names[X_KILLED], ck.bk.excused[X_STOPPED],
               x_names[X_STOPPED], ck.bk.excused[X_NO_WRITE], x_names[X_NO_WRITE],
               ck.bk.excused[X_STORE_REFUSED], x_names[X_STORE_REFUSED], ck.bk.excused[X_STALE],
               x_names[X_STALE], ck.bk.excused[X_LAPSED], x_names[X_LAPSED]);
    }
    if (ck.exhausted > 0) {
        printf("note: %" PRIu64 " calls answered RESOURCE_EXHAUSTED, %" PRIu64
               " of them while the store was full\n",
               ck.exhausted, ck.when_full);
    }
}

uint64_t chaos_check(const chaos_cfg *cfg)
{
    if (!ck_read_history(cfg)) {
        ck.violations++;
    } else {
        ck_read_effects(cfg);
        ck_read_stalls(cfg);
        ck_read_redrives(cfg);
        ck_read_lapses(cfg);
        if (!check_store(cfg)) {
            ck.violations++;
        }
        check_memory();
    }
    print_notes(cfg);
    printf("chaos: faults:");
    for (size_t k = 0; k + 1 < F_N_KINDS; k++) { /* "other" is never drawn */
        printf("%s %" PRIu64 " %s", k == 0 ? "" : ",", ck.kinds[k], f_names[k]);
    }
    printf("\n");
    if (ck.violations > 0) {
        printf("chaos: violations by kind:");
        for (size_t k = 0; k < sizeof(v_names) / sizeof(v_names[0]); k++) {
            printf(" %" PRIu64 " %s", ck.shown[k], v_names[k]);
        }
        printf("\n");
    }
    printf("chaos: fronts: %" PRIu64 " of the calls through gRPC, the others through nng\n",
           ck.grpc_calls);
    printf("chaos: %" PRIu64 " calls, %" PRIu64 " faults, %" PRIu64 " violations\n", ck.calls,
           ck.fault_count, ck.violations);
    return ck.violations;
}

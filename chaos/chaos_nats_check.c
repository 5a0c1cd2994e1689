/* The broker topology's checker: counts the effects per message id.
 *
 * It reads the history (the payments sent and their answers, the faults, the settled
 * look), the producers' store (app db "payments": every payment that committed, hence
 * every message id the outbox took), the consumers' store (app db "effects": effects per
 * message id; "credit"/"total": the credited sum) and the stream's dump (stream.tsv:
 * every copy on chaos.commission and every dead letter, with its reason). Per message id:
 *
 *   committed, kind ok or flaky   exactly one effect, no dead letter
 *   committed, kind final/poison  no effect, a dead letter with a reason
 *   committed                     on the stream (the relay published it)
 *   not committed                 no copy on the stream, no effect, no dead letter
 *   answered OK to its client     committed
 *
 *   a big message (its commission at the broker's size limit: a "big_message" fault)
 *                                 refused at put (INVALID_ARGUMENT or FAILED_PRECONDITION,
 *                                 nothing committed), or committed and then as above; or
 *                                 committed, refused by the broker for good and
 *                                 dead-lettered by the relay (never on the stream)
 * and for the run: the credited total is the sum of the credited payments' amounts;
 * after settling the outbox is empty and the durable has nothing pending or unacked
 * (every message acked or dead-lettered); every payment was decided; no process crashed.
 * More than one copy of a message on the stream (a relay republished it after the
 * broker's duplicate window, or ...) is counted, not a violation: the consumer's marker
 * must make the second copy an ack without effect, which the effect count checks. */
#include <inttypes.h>
#include <lmdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chaos.h"
#include "chaos_nats.h"

#define SHOW_MAX 20 /* violations printed per kind */

typedef struct entry {
    char *key;
    char kind[8];
    long long amount;
    bool sent, answered_ok, produced, big, refused;
    long long effects;
    unsigned copies, dead, dead_no_reason;
} entry;

enum {
    V_CREDIT,
    V_DEAD_GOOD,
    V_LOST,
    V_UNPUBLISHED,
    V_PHANTOM,
    V_ACKED_LOST,
    V_NO_REASON,
    V_TOTAL,
    V_UNSETTLED,
    V_UNDECIDED,
    V_CRASH,
    V_COUNT
};
static const char *const v_names[V_COUNT] = {"credited_not_once",
                                             "good_message_dead_lettered",
                                             "neither_credited_nor_dead_lettered",
                                             "committed_never_published",
                                             "message_never_committed",
                                             "acknowledged_payment_missing",
                                             "dead_letter_without_reason",
                                             "credited_total_wrong",
                                             "not_settled",
                                             "payment_undecided",
                                             "process_crash"};
enum {
    F_CONSUMER_KILL,
    F_CONSUMER_STOP,
    F_RELAY_KILL,
    F_BROKER_KILL,
    F_BROKER_TERM,
    F_BROKER_AMNESIA,
    F_BIG_MESSAGE,
    F_COUNT
};
static const char *const f_names[F_COUNT] = {"consumer_kill", "consumer_stop", "relay_kill",
                                             "broker_kill",   "broker_term",   "broker_amnesia",
                                             "big_message"};

static struct {
    entry *tab;
    size_t cap, n;
    uint64_t violations, shown[V_COUNT], faults[F_COUNT], payments, undecided;
    bool settled_seen;
} nc;

static void violation(int kind, const char *fmt, ...)
{
    nc.violations++;
    if (nc.shown[kind]++ < SHOW_MAX) {
        va_list ap;
        va_start(ap, fmt);
        printf("VIOLATION %s: ", v_names[kind]);
        vprintf(fmt, ap);
        printf("\n");
        va_end(ap);
    }
}

static uint64_t hash(const char *s, size_t n)
{
    return chaos_digest(s, n);
}

static entry *slot(entry *tab, size_t cap, const char *key, size_t n)
{
    for (size_t i = hash(key, n) & (cap - 1);; i = (i + 1) & (cap - 1)) {
        if (tab[i].key == NULL || (strlen(tab[i].key) == n && memcmp(tab[i].key, key, n) == 0)) {
            return &tab[i];
        }
    }
}

static bool grow(void)
{
    size_t cap = nc.cap == 0 ? 1024 : nc.cap * 2;
    entry *tab = calloc(cap, sizeof(*tab));
    if (tab == NULL) {
        return false;
    }
    for (size_t i = 0; i < nc.cap; i++) {
        if (nc.tab[i].key != NULL) {
            *slot(tab, cap, nc.tab[i].key, strlen(nc.tab[i].key)) = nc.tab[i];
        }
    }
    free(nc.tab);
    nc.tab = tab;
    nc.cap = cap;
    return true;
}

/* The entry of key (n bytes), created when absent; NULL only without memory. */
static entry *get(const char *key, size_t n)
{
    if ((nc.n + 1) * 2 > nc.cap && !grow()) {
        return NULL;
    }
    entry *e = slot(nc.tab, nc.cap, key, n);
    if (e->key == NULL) {
        if ((e->key = strndup(key, n)) == NULL) {
            return NULL;
        }
        nc.n++;
    }
    return e;
}

/* The consumers' duplicates are attributed to the fault at most ATTRIBUTE_MS before them
 * (chaos_nats_faultlog.c; else "none"). */
#define ATTRIBUTE_MS 10000

static void read_fault(const char *line)
{
    char kind[32] = "", proc[32] = "";
    chaos_history_field(line, "kind", kind, sizeof(kind));
    if (strcmp(kind, "crash") == 0) {
        chaos_history_field(line, "proc", proc, sizeof(proc));
        violation(V_CRASH, "%s exited without being killed (see its log)", proc);
    }
    for (int f = 0; f < F_COUNT; f++) {
        if (strcmp(kind, f_names[f]) == 0) {
            nc.faults[f]++;
            char t[24] = "0";
            chaos_history_field(line, "t", t, sizeof(t));
            if (f != F_BIG_MESSAGE) { /* a payment's size, not a process's fault */
                chaos_nats_log_fault(strtoull(t, NULL, 10), f);
            }
        }
    }
}

static void read_settled(const char *line)
{
    char v[3][24] = {"", "", ""};
    chaos_history_field(line, "outbox", v[0], sizeof(v[0]));
    chaos_history_field(line, "pending", v[1], sizeof(v[1]));
    chaos_history_field(line, "unacked", v[2], sizeof(v[2]));
    nc.settled_seen = true;
    if (strcmp(v[0], "0") != 0 || strcmp(v[1], "0") != 0 || strcmp(v[2], "0") != 0) {
        violation(V_UNSETTLED,
                  "after settling: outbox %s, durable %s pending and %s unacked (not every "
                  "message was acked or dead-lettered)",
                  v[0], v[1], v[2]);
    }
}

static void read_line(const char *line)
{
    char ev[16] = "", key[128] = "", val[32] = "";
    chaos_history_field(line, "ev", ev, sizeof(ev));
    bool send = strcmp(ev, "send") == 0, recv = strcmp(ev, "recv") == 0;
    entry *e = NULL;
    if ((send || recv) && chaos_history_field(line, "key", key, sizeof(key)) &&
        (e = get(key, strlen(key))) == NULL) {
        return;
    }
    if (send) {
        e->sent = true;
        nc.payments++;
    } else if (recv && chaos_history_field(line, "code", val, sizeof(val))) {
        e->answered_ok = strcmp(val, "OK") == 0;
        e->refused = e->big && (strcmp(val, "INVALID_ARGUMENT") == 0 ||
                                strcmp(val, "FAILED_PRECONDITION") == 0);
        if (!e->answered_ok && !e->refused) {
            nc.undecided++;
            violation(V_UNDECIDED, "payment %s: no OK within 30 s, last answer %s", key, val);
        }
    } else if (strcmp(ev, "fault") == 0) {
        read_fault(line);
        if (chaos_history_field(line, "key", key, sizeof(key)) && (e = get(key, strlen(key)))) {
            e->big = true; /* a big_message fault names its payment */
        }
    } else if (strcmp(ev, "settled") == 0) {
        read_settled(line);
    }
}

static bool read_history(const chaos_cfg *cfg)
{
    char line[2048];
    FILE *f = fopen(cfg->history, "r");
    if (f == NULL) {
        perror(cfg->history);
        return false;
    }
    while (fgets(line, sizeof(line), f) != NULL) {
        read_line(line);
    }
    fclose(f);
    if (!nc.settled_seen) {
        violation(V_UNSETTLED, "the run never looked at the end state (no settled event)");
    }
    return true;
}

typedef void (*row_fn)(const char *key, size_t klen, const void *val, size_t vlen);

/* Calls fn for every row of business db `db` ("app.<db>") of the LMDB store in dir. */
static bool each_row(const char *dir, const char *db, row_fn fn)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    MDB_cursor *cur = NULL;
    MDB_val k, v;
    char name[96];
    snprintf(name, sizeof(name), "app.%s", db);
    int rc = mdb_env_create(&env);
    if (rc == 0 && (rc = mdb_env_set_maxdbs(env, 64)) == 0 &&
        (rc = mdb_env_open(env, dir, MDB_RDONLY | MDB_NOTLS, 0600)) == 0 &&
        (rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn)) == 0) {
        rc = mdb_dbi_open(txn, name, 0, &dbi);
        if (rc == 0 && (rc = mdb_cursor_open(txn, dbi, &cur)) == 0) {
            while (mdb_cursor_get(cur, &k, &v, MDB_NEXT) == 0) {
                fn(k.mv_data, k.mv_size, v.mv_data, v.mv_size);
            }
            mdb_cursor_close(cur);
        }
        rc = rc == MDB_NOTFOUND ? 0 : rc; /* no such db yet: no rows */
        mdb_txn_abort(txn);
    }
    if (rc != 0) {
        fprintf(stderr, "idemrpc-chaos: %s %s: %s\n", dir, name, mdb_strerror(rc));
    }
    mdb_env_close(env);
    return rc == 0;
}

static void payment_row(const char *key, size_t klen, const void *val, size_t vlen)
{
    char buf[72] = {0};
    entry *e = get(key, klen);
    if (e == NULL) {
        return;
    }
    memcpy(buf, val, vlen < sizeof(buf) - 1 ? vlen : sizeof(buf) - 1);
    e->produced = true;
    if (sscanf(buf, "%7s %lld", e->kind, &e->amount) != 2) {
        e->kind[0] = '\0';
    }
}

static void effect_row(const char *key, size_t klen, const void *val, size_t vlen)
{
    entry *e = get(key, klen);
    if (e != NULL && vlen == sizeof(long long)) {
        memcpy(&e->effects, val, sizeof(e->effects));
    }
}

static long long credited_total;

static void credit_row(const char *key, size_t klen, const void *val, size_t vlen)
{
    if (klen == 5 && memcmp(key, "total", 5) == 0 && vlen == sizeof(credited_total)) {
        memcpy(&credited_total, val, sizeof(credited_total));
    }
}

/* events.log (chaos_nats_proc.c): "WHAT KEY PID" lines, counted by what. */
static uint64_t relay_dups, consumer_dups, dups_after[F_COUNT + 1];

static void read_events(const chaos_cfg *cfg)
{
    char path[700], line[512], what[32], key[300];
    snprintf(path, sizeof(path), "%s/events.log", cfg->dir);
    FILE *f = fopen(path, "r");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        int pid;
        unsigned long long t = 0;
        if (sscanf(line, "%31s %299s %d %llu", what, key, &pid, &t) < 2) {
            continue;
        }
        relay_dups += strcmp(what, "relay_dup") == 0;
        if (strcmp(what, "consumer_dup") == 0) {
            consumer_dups++;
            int at = chaos_nats_fault_before(t, ATTRIBUTE_MS);
            dups_after[at < 0 ? F_COUNT : at]++;
        }
    }
    if (f != NULL) {
        fclose(f);
    }
}

/* stream.tsv: SEQ SUBJECT KEY REASON PAYLOAD. */
static bool read_stream(const chaos_cfg *cfg)
{
    char path[700], line[1024], subject[128], key[300], reason[512];
    snprintf(path, sizeof(path), "%s/stream.tsv", cfg->dir);
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        perror(path);
        return false;
    }
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned long long seq;
        if (sscanf(line, "%llu\t%127[^\t]\t%299[^\t]\t%511[^\t]", &seq, subject, key, reason) !=
            4) {
            continue;
        }
        entry *e = get(key, strlen(key));
        if (e == NULL) {
            continue;
        }
        if (strcmp(subject, CHAOS_NATS_DEAD) == 0) {
            e->dead++;
            e->dead_no_reason += strcmp(reason, "-") == 0 || reason[0] == '\0';
        } else {
            e->copies++;
        }
    }
    fclose(f);
    return true;
}

typedef struct tally {
    uint64_t produced, credited, dead_lettered, dead_twice, extra_copies, by_kind[4];
    uint64_t big_refused, big_committed, big_parked; /* refused at put; dead-lettered unsent */
    long long expected_total;
} tally;

static const char *const kinds[4] = {"ok", "flaky", "final", "poison"};

/* The checks of one message id (see the top of the file). */
static void check_entry(const entry *e, tally *t)
{
    bool to_credit = strcmp(e->kind, "ok") == 0 || strcmp(e->kind, "flaky") == 0;
    t->big_refused += e->refused;
    if (e->answered_ok && !e->produced) {
        violation(V_ACKED_LOST, "%s answered OK but no payment committed", e->key);
    }
    if (!e->produced) {
        if (e->copies > 0 || e->effects != 0 || e->dead > 0) {
            violation(V_PHANTOM, "%s never committed: %u copies, %lld effects, %u dead letters",
                      e->key, e->copies, e->effects, e->dead);
        }
        return;
    }
    t->produced++;
    for (int k = 0; k < 4; k++) {
        t->by_kind[k] += strcmp(e->kind, kinds[k]) == 0;
    }
    t->credited += e->effects == 1;
    t->dead_lettered += e->dead > 0;
    t->dead_twice += e->dead > 1;
    t->extra_copies += e->copies > 1 ? e->copies - 1 : 0;
    t->big_committed += e->big;
    if (e->big && e->copies == 0 && e->dead > 0) {
        t->big_parked++; /* refused by the broker for good: dead-lettered, never blocking */
        return;
    }
    if (e->copies == 0) {
        violation(V_UNPUBLISHED, "%s (%s) committed, never on the stream", e->key, e->kind);
    }
    if (e->dead_no_reason > 0) {
        violation(V_NO_REASON, "%s: %u dead letters without a reason", e->key, e->dead_no_reason);
    }
    if (to_credit) {
        t->expected_total += e->amount;
        if (e->effects != 1) {
            violation(V_CREDIT, "%s (%s): credited %lld times", e->key, e->kind, e->effects);
        }
        if (e->dead > 0) {
            violation(V_DEAD_GOOD, "%s (%s): dead-lettered %u times", e->key, e->kind, e->dead);
        }
    } else if (e->effects != 0) {
        violation(V_CREDIT, "%s (%s): a message that cannot succeed credited %lld times", e->key,
                  e->kind, e->effects);
    } else if (e->dead == 0) {
        violation(V_LOST, "%s (%s): neither credited nor dead-lettered", e->key, e->kind);
    }
}

static void summary(const tally *t)
{
    uint64_t faults = 0;
    printf("chaos: nats: %" PRIu64 " payments committed (%" PRIu64 " ok, %" PRIu64
           " flaky, %" PRIu64 " final, %" PRIu64 " poison); %" PRIu64 " credited once, %" PRIu64
           " dead-lettered; %" PRIu64 " extra copies on the stream, %" PRIu64
           " dead-lettered twice; credited total %lld (expected %lld)\n",
           t->produced, t->by_kind[0], t->by_kind[1], t->by_kind[2], t->by_kind[3], t->credited,
           t->dead_lettered, t->extra_copies, t->dead_twice, credited_total, t->expected_total);
    printf("chaos: nats: big messages: %" PRIu64 " refused at put, %" PRIu64 " committed (%" PRIu64
           " dead-lettered by the relay, never on the stream)\n",
           t->big_refused, t->big_committed, t->big_parked);
    printf("chaos: nats: evidence: %" PRIu64 " copies a relay published again were dropped by "
           "the broker's dedupe, %" PRIu64 " reached the stream; the consumers acked %" PRIu64
           " deliveries as duplicates (marker found, no effect)\n",
           relay_dups, t->extra_copies, consumer_dups);
    printf("chaos: nats: the consumers' duplicates by the fault in the %d s before them:",
           ATTRIBUTE_MS / 1000);
    for (int f = 0; f <= F_COUNT; f++) {
        printf(" %" PRIu64 " %s%s", dups_after[f], f < F_COUNT ? f_names[f] : "none",
               f < F_COUNT ? "," : "\n");
    }
    printf("chaos: faults:");
    for (int f = 0; f < F_COUNT; f++) {
        printf(" %" PRIu64 " %s%s", nc.faults[f], f_names[f], f + 1 < F_COUNT ? "," : "\n");
        faults += nc.faults[f];
    }
    if (nc.violations > 0) {
        printf("chaos: violations by kind:");
        for (int k = 0; k < V_COUNT; k++) {
            printf(" %" PRIu64 " %s", nc.shown[k], v_names[k]);
        }
        printf("\n");
    }
    printf("chaos: %" PRIu64 " payments, %" PRIu64 " faults, %" PRIu64 " violations\n", nc.payments,
           faults, nc.violations);
}

uint64_t chaos_nats_check(const chaos_cfg *cfg)
{
    char prod[600], cons[600];
    tally t = {0};
    snprintf(prod, sizeof(prod), "%s/producer", cfg->dir);
    snprintf(cons, sizeof(cons), "%s/consumer", cfg->dir);
    bool ok = read_history(cfg) && each_row(prod, "payments", payment_row) &&
              each_row(cons, "effects", effect_row) && each_row(cons, "credit", credit_row) &&
              read_stream(cfg);
    read_events(cfg);
    if (!ok) {
        nc.violations++;
        printf("chaos: the checker could not read the run (above)\n");
    }
    for (size_t i = 0; ok && i < nc.cap; i++) {
        if (nc.tab[i].key != NULL) {
            check_entry(&nc.tab[i], &t);
        }
    }
    if (ok && credited_total != t.expected_total) {
        violation(V_TOTAL, "credited total %lld, the credited payments sum to %lld", credited_total,
                  t.expected_total);
    }
    summary(&t);
    for (size_t i = 0; i < nc.cap; i++) {
        free(nc.tab[i].key);
    }
    free(nc.tab);
    chaos_nats_forget_faults();
    return nc.violations;
}

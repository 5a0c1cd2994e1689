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
 *   steps     (chaos.Trip/Book) a step's effect ("hold", "pay") that shows more than
 *             once for a (caller, key) without evidence that the owner could not record
 *             it (killed, stopped or partitioned around it, a store that took no write
 *             for 2/3 of a lease: the agent's no_commit, a PostgreSQL restart, or the server's own
 * note that the store refused the record for 10 s; a note "claim lost" needs the kill/stop/stall
 * evidence too, and a step the server noted as recorded has no excuse); OK answers or the COMPLETED
 * record naming step outputs that differ, or that no effect line matches; a journaled call left
 * IN_PROGRESS after settling (the re-driver did not finish it); a journal that outlived its call's
 * outcome memory    a server whose anonymous RSS (RssAnon: LMDB's map is file-backed and grows with
 * the data) more than doubles + 16 MiB between a quarter of its life and its end, over a life of at
 * least 20 s crashes   a server that died without being killed, or did not stop on SIGTERM */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idemrpc/idemrpc.h>

#include "journal.h" /* idem__steps_next_call: the journals the re-driver would see */
#include "chaos.h"

#define BUCKETS 65536
#define MAX_EFFECTS 12
#define MAX_FAULTS 4096
#define MAX_STALLS 8192
#define FULL_GRACE_MS 1000 /* a refusal may arrive this long after a fill ended */
#define MAX_SHOWN 10

typedef struct execution {
    long pid;
    uint64_t fence, t;
} execution;

/* chaos.Trip/Book: per step, its effect lines and the server's notes of a step that ran
 * but was not recorded. */
enum { S_HOLD, S_PAY, N_STEPS };
static const char *const step_names[N_STEPS] = {"hold", "pay"};

typedef struct step_note {
    long pid;
    uint64_t fence, t;
    bool recorded; /* "recorded" (else "unrecorded:CODE") */
    char code[48];
} step_note;

typedef struct step_log {
    size_t n, n_notes; /* n: effect lines (exec holds the first MAX_EFFECTS) */
    execution exec[MAX_EFFECTS];
    step_note notes[MAX_EFFECTS];
} step_log;

typedef struct book {
    step_log steps[N_STEPS];
    bool abandoned;           /* its client gave up after one attempt; the settle pass left it */
    bool journaled;           /* its step journal is still in the store after the run */
    char ok_out[N_STEPS][96]; /* the step outputs the first OK answer named */
} book;

typedef struct entry {
    struct entry *next;
    book *book; /* chaos.Trip/Book only */
    char method[48], caller[80], key[160], payload[64];
    int n_definitive;
    char code[32], digest[24], body[512];
    bool acked_ok, refused, undecided_checked;
    long long effects;
    size_t n_exec;
    execution exec[MAX_EFFECTS];
} entry;

typedef struct fault {
    uint64_t t;
    long pid;
    bool stop; /* SIGSTOP (else SIGKILL) */
} fault;

/* An interval in which the store committed nothing (the agent's no_commit). */
typedef struct stall {
    uint64_t from, to;
} stall;

typedef struct rss_life {
    long pid;
    uint64_t first_t, last_t;
    size_t n;
    long *kib;
} rss_life;

static struct {
    entry *buckets[BUCKETS];
    fault faults[MAX_FAULTS];
    size_t n_faults;
    stall stalls[MAX_STALLS];
    size_t n_stalls;
    uint64_t restart_from; /* the PostgreSQL restart under way (pg) */
    rss_life *lives;
    size_t n_lives;
    uint64_t calls, fault_count, violations;
    uint64_t shown[8], excused[3];
    uint64_t kinds[8];             /* faults by kind: f_names */
    uint64_t full_from, full_to;   /* the fill in effect (history order), or the last one */
    uint64_t exhausted, when_full; /* RESOURCE_EXHAUSTED answers, and during a fill */
    uint64_t load_end;             /* the clients stopped: the store idles until settling */
    struct {
        uint64_t calls, keys, abandoned, completed_ok, completed_other, no_record;
        uint64_t unstarted;     /* IN_PROGRESS, no step recorded, client gone */
        uint64_t held_released; /* no record, a journaled step: released, never finished */
        uint64_t excused[5], redrives[3]; /* X_*; re-runs in the logs: OK, replayed, other */
    } bk;
} ck;

enum { X_KILLED, X_STOPPED, X_NO_WRITE, X_STORE_REFUSED, X_STALE };
static const char *const x_names[] = {
    "their process was killed", "their process was stopped",
    "the store took no write for 2/3 of a lease", "the store refused the step's record for 10 s",
    "a run stopped before the step lost its claim, then ran it (record refused: ABORTED)"};
static const char *const f_names[] = {"kill",       "stop",      "fill",    "pg_restart",
                                      "redis_stop", "partition", "slow_db", "other"};

enum { V_ANSWERS, V_EFFECTS, V_CALLERS, V_RECORDS, V_MEMORY, V_CRASHES };
static const char *const v_names[] = {"answers", "effects", "callers",
                                      "records", "memory",  "crashes"};

static void violation(int kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#include <stdarg.h>
static void violation(int kind, const char *fmt, ...)
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

static entry *lookup(const char *method, const char *caller, const char *key, bool create)
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

/* An answer must name the caller and the key it was asked for. */
static bool answer_is_mine(const entry *e, const char *body)
{
    char want[300];
    snprintf(want, sizeof(want), " caller=%s key=%s", e->caller, e->key);
    const char *p = strstr(body, want);
    return p != NULL && (p[strlen(want)] == '\0' || p[strlen(want)] == ' ');
}

/* While the store is full, a refusal must say so (or say "server busy"). */
static void check_exhausted(const entry *e, uint64_t t, const char *body)
{
    ck.exhausted++;
    if (ck.full_from != 0 && t >= ck.full_from &&
        (ck.full_to == 0 || t <= ck.full_to + FULL_GRACE_MS)) {
        ck.when_full++;
    }
    if (strstr(body, "store full") == NULL && strstr(body, "server busy") == NULL) {
        violation(V_ANSWERS, "%s caller=%s key=%s: RESOURCE_EXHAUSTED without a cause '%s'",
                  e->method, e->caller, e->key, body);
    }
}

/* The output of step `name` that a Book answer or record names (" name=OUTPUT"), into
 * out ("" when absent). */
static void step_output(const char *text, size_t len, const char *name, char *out, size_t cap)
{
    char pat[32];
    int n = snprintf(pat, sizeof(pat), " %s=", name);
    const char *p = memmem(text, len, pat, (size_t)n);
    size_t o = 0, at = p != NULL ? (size_t)(p - text) + (size_t)n : len;
    while (at < len && (unsigned char)text[at] > ' ' && o + 1 < cap) {
        out[o++] = text[at++];
    }
    out[o] = '\0';
}

/* One outcome per key: every OK answer of a Book names the same step outputs. */
static void check_book_answer(entry *e, const char *body)
{
    for (int i = 0; i < N_STEPS; i++) {
        char out[96];
        step_output(body, strlen(body), step_names[i], out, sizeof(out));
        if (out[0] == '\0') {
            violation(V_ANSWERS, "%s caller=%s key=%s: an OK answer without its %s output '%s'",
                      e->method, e->caller, e->key, step_names[i], body);
        } else if (e->book->ok_out[i][0] == '\0') {
            snprintf(e->book->ok_out[i], sizeof(e->book->ok_out[i]), "%s", out);
        } else if (strcmp(e->book->ok_out[i], out) != 0) {
            violation(V_ANSWERS, "%s caller=%s key=%s: OK answers name %s %s and %s", e->method,
                      e->caller, e->key, step_names[i], e->book->ok_out[i], out);
        }
    }
}

static void check_answer(entry *e, const char *code, const char *digest, const char *body)
{
    bool ok = strcmp(code, "OK") == 0, fp = strcmp(code, "FAILED_PRECONDITION") == 0;
    if (!ok && !fp && strcmp(code, "INVALID_ARGUMENT") != 0 &&
        strcmp(code, "PERMISSION_DENIED") != 0) {
        return; /* not definitive: retryable or a debounced double click */
    }
    if (!ok && !(fp && strcmp(e->method, CHAOS_METHOD_TRANSFER) == 0 &&
                 strstr(body, "insufficient funds") != NULL)) {
        violation(V_ANSWERS, "%s caller=%s key=%s: refused with %s '%s'", e->method, e->caller,
                  e->key, code, body);
        e->refused = true;
        return;
    }
    if (!answer_is_mine(e, body)) {
        violation(V_CALLERS, "%s caller=%s key=%s got someone else's answer '%s'", e->method,
                  e->caller, e->key, body);
    }
    if (e->n_definitive++ == 0) {
        snprintf(e->code, sizeof(e->code), "%s", code);
        snprintf(e->digest, sizeof(e->digest), "%s", digest);
        snprintf(e->body, sizeof(e->body), "%s", body);
    } else if (strcmp(e->code, code) != 0 || strcmp(e->digest, digest) != 0) {
        violation(V_ANSWERS, "%s caller=%s key=%s: '%s %s' then '%s %s'", e->method, e->caller,
                  e->key, e->code, e->body, code, body);
    }
    e->acked_ok = e->acked_ok || ok;
    if (ok && e->book != NULL) {
        check_book_answer(e, body);
    }
}

static void read_rss(const char *line)
{
    char pid[24], kib[24], t[24];
    if (!chaos_history_field(line, "pid", pid, sizeof(pid)) ||
        !chaos_history_field(line, "anon", kib, sizeof(kib)) ||
        !chaos_history_field(line, "t", t, sizeof(t))) {
        return;
    }
    rss_life *l = NULL;
    for (size_t i = 0; i < ck.n_lives; i++) {
        if (ck.lives[i].pid == atol(pid)) {
            l = &ck.lives[i];
        }
    }
    if (l == NULL) {
        rss_life *grown = realloc(ck.lives, (ck.n_lives + 1) * sizeof(*grown));
        if (grown == NULL) {
            return;
        }
        ck.lives = grown;
        l = &ck.lives[ck.n_lives++];
        *l = (rss_life){.pid = atol(pid), .first_t = strtoull(t, NULL, 10)};
    }
    long *k = realloc(l->kib, (l->n + 1) * sizeof(*k));
    if (k != NULL) {
        l->kib = k;
        l->kib[l->n++] = atol(kib);
        l->last_t = strtoull(t, NULL, 10);
    }
}

static void read_fault(const char *line, bool end)
{
    char kind[32] = "", pid[24] = "0", t[24] = "0", server[8] = "";
    chaos_history_field(line, "kind", kind, sizeof(kind));
    chaos_history_field(line, "pid", pid, sizeof(pid));
    chaos_history_field(line, "t", t, sizeof(t));
    chaos_history_field(line, "server", server, sizeof(server));
    if (strcmp(kind, "fill") == 0) { /* the window of a full store */
        ck.full_from = end ? ck.full_from : strtoull(t, NULL, 10);
        ck.full_to = end ? strtoull(t, NULL, 10) : 0;
    }
    /* A PostgreSQL restart is a window in which the store takes no write (pg's stall:
     * no lease can be renewed, as in the agent's no_commit on lmdb). */
    if (strcmp(kind, "pg_restart") == 0 && !end) {
        ck.restart_from = strtoull(t, NULL, 10);
    } else if (strcmp(kind, "pg_restart") == 0 && ck.n_stalls < MAX_STALLS) {
        ck.stalls[ck.n_stalls++] = (stall){ck.restart_from, strtoull(t, NULL, 10)};
    }
    if (end) {
        return;
    }
    if (strcmp(kind, "crash") == 0) {
        violation(V_CRASHES, "server %s (pid %s) died or hung without being killed", server, pid);
        return;
    }
    ck.fault_count++;
    size_t k = 0;
    while (k < 7 && strcmp(f_names[k], kind) != 0) {
        k++;
    }
    ck.kinds[k]++;
    /* A partition is a stop of the process's store, not of the process: the same excuse
     * (it cannot renew; another claimer may run the call again). */
    bool stop = strcmp(kind, "stop") == 0 || strcmp(kind, "partition") == 0;
    if ((stop || strcmp(kind, "kill") == 0) && ck.n_faults < MAX_FAULTS) {
        ck.faults[ck.n_faults++] = (fault){strtoull(t, NULL, 10), atol(pid), stop};
    }
}

static void read_line(const char *line)
{
    char ev[16], method[48], caller[80], key[160];
    if (!chaos_history_field(line, "ev", ev, sizeof(ev))) {
        return;
    }
    if (strcmp(ev, "fault") == 0 || strcmp(ev, "fault_end") == 0) {
        read_fault(line, strcmp(ev, "fault_end") == 0);
        return;
    }
    if (strcmp(ev, "rss") == 0) {
        read_rss(line);
        return;
    }
    if (strcmp(ev, "load") == 0) {
        char t[24] = "0";
        chaos_history_field(line, "t", t, sizeof(t));
        ck.load_end = strtoull(t, NULL, 10);
        return;
    }
    if (!chaos_history_field(line, "method", method, sizeof(method)) ||
        !chaos_history_field(line, "caller", caller, sizeof(caller)) ||
        !chaos_history_field(line, "key", key, sizeof(key))) {
        return;
    }
    entry *e = lookup(method, caller, key, true);
    if (e == NULL) {
        return;
    }
    if (strcmp(ev, "send") == 0) {
        char mode[24] = "";
        chaos_history_field(line, "payload", e->payload, sizeof(e->payload));
        chaos_history_field(line, "mode", mode, sizeof(mode));
        if (e->book != NULL && strcmp(mode, "abandoned") == 0) {
            e->book->abandoned = true;
        }
    } else if (strcmp(ev, "recv") == 0) {
        char code[32] = "", digest[24] = "", body[512] = "", t[24] = "0";
        chaos_history_field(line, "code", code, sizeof(code));
        chaos_history_field(line, "digest", digest, sizeof(digest));
        chaos_history_field(line, "body", body, sizeof(body));
        chaos_history_field(line, "t", t, sizeof(t));
        ck.calls++;
        ck.bk.calls += e->book != NULL;
        if (strcmp(code, "RESOURCE_EXHAUSTED") == 0) {
            check_exhausted(e, strtoull(t, NULL, 10), body);
        }
        check_answer(e, code, digest, body);
    }
}

static bool read_history(const chaos_cfg *cfg)
{
    FILE *f = fopen(cfg->history, "r");
    if (f == NULL) {
        perror(cfg->history);
        return false;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        read_line(line);
    }
    free(line);
    fclose(f);
    return true;
}

/* METHOD CALLER KEY PID FENCE MONOTONIC_MS per execution of a claim-mode method; a
 * Book step adds STEP, and a step that ran has a note line of how its record ended,
 * STEP recorded or STEP unrecorded:CODE (not an effect). */
static void read_effect_line(const char *line)
{
    char method[48], caller[80], key[160], step[16] = "", note[48] = "";
    long pid;
    uint64_t fence, t;
    int n = sscanf(line, "%47s %79s %159s %ld %" SCNu64 " %" SCNu64 " %15s %47s", method, caller,
                   key, &pid, &fence, &t, step, note);
    entry *e = n >= 6 ? lookup(method, caller, key, true) : NULL;
    if (e == NULL) {
        return;
    }
    if (e->book == NULL) {
        if (e->n_exec < MAX_EFFECTS) {
            e->exec[e->n_exec++] = (execution){pid, fence, t};
        }
        e->effects++;
        return;
    }
    int s = 0;
    while (s < N_STEPS && strcmp(step_names[s], step) != 0) {
        s++;
    }
    if (s == N_STEPS) {
        violation(V_EFFECTS, "%s caller=%s key=%s: an effect line of no known step '%s'", method,
                  caller, key, step);
        return;
    }
    step_log *l = &e->book->steps[s];
    bool recorded = strcmp(note, "recorded") == 0;
    if ((recorded || strncmp(note, "unrecorded:", 11) == 0) && l->n_notes < MAX_EFFECTS) {
        step_note *sn = &l->notes[l->n_notes++];
        *sn = (step_note){.pid = pid, .fence = fence, .t = t, .recorded = recorded};
        snprintf(sn->code, sizeof(sn->code), "%s", recorded ? "" : note + 11);
    } else if (note[0] == '\0') {
        if (l->n < MAX_EFFECTS) {
            l->exec[l->n] = (execution){pid, fence, t};
        }
        l->n++;
    }
}

static void read_effects(const chaos_cfg *cfg)
{
    FILE *f = fopen(cfg->effects, "r");
    char *line = NULL;
    size_t cap = 0;
    while (f != NULL && getline(&line, &cap, f) > 0) {
        read_effect_line(line);
    }
    free(line);
    if (f != NULL) {
        fclose(f);
    }
}

/* The agent's log (lmdb): the intervals in which the store committed nothing while the
 * clients ran (after that the store is idle: no evidence of anything). */
static void read_stalls(const chaos_cfg *cfg)
{
    FILE *f = cfg->topology == CHAOS_LMDB ? fopen(cfg->agent_log, "r") : NULL;
    char line[256], from[24], t[24];
    while (f != NULL && fgets(line, sizeof(line), f) != NULL && ck.n_stalls < MAX_STALLS) {
        if (chaos_history_field(line, "from", from, sizeof(from)) &&
            chaos_history_field(line, "t", t, sizeof(t)) &&
            (ck.load_end == 0 || strtoull(t, NULL, 10) <= ck.load_end)) {
            ck.stalls[ck.n_stalls++] = (stall){strtoull(from, NULL, 10), strtoull(t, NULL, 10)};
        }
    }
    if (f != NULL) {
        fclose(f);
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
    return -1;
}

/* A step's record rides out a full or unreachable store this long (src/toolkit/steps.c,
 * STEP_RECORD_RETRY_MS, less its last backoff) before the store's refusal is returned. */
#define STEP_RECORD_RETRY_MS 9000

/* The server's note of how the record of step effect x ended (NULL: none). */
static const step_note *note_of(const step_log *l, const execution *x)
{
    for (size_t i = 0; i < l->n_notes; i++) {
        if (l->notes[i].pid == x->pid && l->notes[i].fence == x->fence) {
            return &l->notes[i];
        }
    }
    return NULL;
}

/* Why step effect x of a Book may show twice: the owner of its run could not record it
 * (downstream.h). The server's note says how the record ended: refused by the store
 * (any code but ABORTED) is excused only after the record rode it out for
 * STEP_RECORD_RETRY_MS (note time - effect time); "claim lost" (ABORTED), or no note at
 * all, needs the evidence duplicate_excuse uses, around x itself: its process killed
 * after it or stopped after it (between the effect and its record), or a store that
 * took no write for 2/3 of a lease (no renewal). A stop that began before x excuses it
 * only with the note ABORTED: the run was stopped before the step, lost its claim, and
 * on waking ran the step because it did not find it recorded (another run had recorded
 * it and completed the call, which deletes the journal, or had not reached it yet), as
 * downstream.h allows: its record is refused, fn's effect stays. Returns X_* or -1. */
static int step_excuse(const step_log *l, const execution *x, const chaos_cfg *cfg)
{
    const step_note *n = note_of(l, x);
    if (n != NULL && n->recorded) {
        return -1; /* it was recorded: a later run must have replayed it */
    }
    if (n != NULL && strcmp(n->code, "ABORTED") != 0) {
        return n->t >= x->t + STEP_RECORD_RETRY_MS ? X_STORE_REFUSED : -1;
    }
    uint64_t window = 3 * cfg->lease_ms + 1000;
    for (size_t i = 0; i < ck.n_faults; i++) {
        const fault *f = &ck.faults[i];
        if (f->pid == x->pid && f->t >= x->t && f->t <= x->t + window) {
            return f->stop ? X_STOPPED : X_KILLED;
        }
        if (f->pid == x->pid && f->stop && f->t < x->t && f->t + window >= x->t && n != NULL) {
            return X_STALE; /* n is "unrecorded:ABORTED" here */
        }
    }
    for (size_t i = 0; i < ck.n_stalls; i++) {
        const stall *st = &ck.stalls[i];
        if (3 * (st->to - st->from) >= 2 * cfg->lease_ms && st->to + 2 * cfg->lease_ms >= x->t &&
            st->from <= x->t + window) {
            return X_NO_WRITE;
        }
    }
    return -1;
}

/* Step `s` of a Book: named is the output its COMPLETED OK record names ("" if none).
 * Every effect line but the named one needs an excuse; with none named (no outcome, or
 * not OK) one may stand without, unless no step of the call was recorded at all
 * (unrecorded: no journal and no outcome), where none may. */
static void check_step(entry *e, int s, const char *named, bool unrecorded, const chaos_cfg *cfg)
{
    const step_log *l = &e->book->steps[s];
    size_t n = l->n < MAX_EFFECTS ? l->n : MAX_EFFECTS, found = 0, unexcused = 0;
    long pid = 0;
    uint64_t fence = 0;
    if (named[0] != '\0' &&
        sscanf(named + strlen(step_names[s]), ".%ld.%" SCNu64, &pid, &fence) != 2) {
        violation(V_EFFECTS, "%s caller=%s key=%s: its record names %s output '%s'", e->method,
                  e->caller, e->key, step_names[s], named);
    }
    int first_x = -1;
    for (size_t i = 0; i < n; i++) {
        const execution *x = &l->exec[i];
        if (named[0] != '\0' && x->pid == pid && x->fence == fence && found++ == 0) {
            continue;
        }
        int xc = step_excuse(l, x, cfg);
        if (xc >= 0) {
            ck.bk.excused[xc]++;
        } else if (unexcused++ == 0) {
            first_x = (int)i;
        }
    }
    size_t allowed = named[0] != '\0' || unrecorded ? 0 : 1;
    if (named[0] != '\0' && found == 0) {
        violation(V_EFFECTS, "%s caller=%s key=%s: its outcome names %s %s, which no effect shows",
                  e->method, e->caller, e->key, step_names[s], named);
    }
    if (unexcused > allowed || l->n > MAX_EFFECTS) {
        const execution *x = &l->exec[first_x >= 0 ? first_x : 0];
        const step_note *note = note_of(l, x);
        char why[96] = "no note";
        if (note != NULL && note->recorded) {
            snprintf(why, sizeof(why), "RECORDED, yet a later run did not replay it");
        } else if (note != NULL) {
            snprintf(why, sizeof(why), "noted unrecorded:%s %" PRIu64 " ms after its effect",
                     note->code, note->t - x->t);
        }
        violation(V_EFFECTS,
                  "%s caller=%s key=%s: step %s took effect %zu times (%zu without evidence "
                  "that its owner could not record it, e.g. pid %ld fence %" PRIu64 " at %" PRIu64
                  ", %s; outcome names '%s')",
                  e->method, e->caller, e->key, step_names[s], l->n, unexcused, x->pid, x->fence,
                  x->t, why, named);
    }
}

/* A Book after settling, from its record and its journal: safety (each step's effect
 * once, but for the evidence of an owner that could not record it; the outcome's step
 * outputs are the answers' and match effects) and the re-driver's liveness (a call
 * with a journaled step is finished: left IN_PROGRESS is a violation). */
static idem_store *app_store;

/* Whether the Book's request still has a step journal in the store (listed for the
 * re-driver or not: a released call keeps its journal for a retry). */
static bool journaled(const entry *e)
{
    idem_key_ref ref = {e->caller, e->method, e->key};
    uint8_t fp[IDEM_FINGERPRINT_LEN];
    bool exists = false;
    if (!idem__fingerprint(e->method, e->payload, strlen(e->payload), fp) ||
        idem__steps_journal_exists(app_store, &ref, fp, &exists) != IDEM_OK) {
        violation(V_RECORDS, "%s caller=%s key=%s: reading its step journal: %s", e->method,
                  e->caller, e->key, idem_errmsg());
    }
    return exists;
}

static void check_book(entry *e, const chaos_cfg *cfg)
{
    book *b = e->book;
    idem_key_ref ref = {e->caller, e->method, e->key};
    idem_record rec;
    char named[N_STEPS][96] = {"", ""};
    memset(&rec, 0, sizeof(rec));
    idem_code code = idem_store_get(app_store, &ref, &rec);
    bool in_progress = code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS;
    bool completed = code == IDEM_OK && rec.state == IDEM_REC_COMPLETED;
    bool ok = completed && rec.response != NULL &&
              memmem(rec.response, rec.response_len, " pay=", 5) != NULL;
    ck.bk.keys++;
    ck.bk.abandoned += b->abandoned;
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        violation(V_RECORDS, "%s caller=%s key=%s: reading its record: %s", e->method, e->caller,
                  e->key, idem_errmsg());
        return;
    }
    b->journaled = journaled(e);
    for (int i = 0; ok && i < N_STEPS; i++) {
        step_output(rec.response, rec.response_len, step_names[i], named[i], sizeof(named[i]));
        if (b->ok_out[i][0] != '\0' && strcmp(b->ok_out[i], named[i]) != 0) {
            violation(V_ANSWERS, "%s caller=%s key=%s: answered %s %s, its record names %s",
                      e->method, e->caller, e->key, step_names[i], b->ok_out[i], named[i]);
        }
    }
    if (in_progress && b->journaled) {
        violation(V_RECORDS,
                  "%s caller=%s key=%s left IN_PROGRESS (lease until %" PRIu64 ") with a "
                  "journaled step after settling: the re-driver did not finish it (hold "
                  "effects %zu, pay effects %zu%s)",
                  e->method, e->caller, e->key, rec.lease_until_ms, b->steps[S_HOLD].n,
                  b->steps[S_PAY].n, b->abandoned ? ", its client gave up" : "");
    } else if (in_progress && !b->abandoned) {
        violation(V_RECORDS, "%s caller=%s key=%s still IN_PROGRESS after the run settled",
                  e->method, e->caller, e->key);
    } else if (in_progress) {
        ck.bk.unstarted++; /* nothing recorded to run again from: its client's decision */
    } else if (completed && b->journaled) {
        violation(V_RECORDS, "%s caller=%s key=%s: its step journal outlived its outcome",
                  e->method, e->caller, e->key);
    }
    if (ok) {
        ck.bk.completed_ok++;
    } else if (completed) {
        ck.bk.completed_other++;
    } else if (!in_progress) {
        ck.bk.no_record++; /* released after a transient failure, or never arrived */
        ck.bk.held_released += b->journaled;
    }
    bool unrecorded = !completed && !b->journaled; /* not one step of it is in the store */
    for (int i = 0; i < N_STEPS; i++) {
        check_step(e, i, named[i], unrecorded, cfg);
    }
    if (e->acked_ok && !ok) {
        violation(V_EFFECTS, "%s caller=%s key=%s acknowledged '%s' but has no OK record",
                  e->method, e->caller, e->key, e->body);
    }
    if (e->n_definitive == 0 && !e->refused && !b->abandoned) {
        violation(V_RECORDS, "%s caller=%s key=%s never decided, even by the settle pass",
                  e->method, e->caller, e->key);
    }
    idem_record_clear(&rec);
}

/* The servers' re-runs: "redrive method=... from its stored request: HOW: CODE", HOW
 * "ran it again" (the error level), "another run had finished it: replayed its
 * outcome" or "did not run it" (the info level, only in logs at that level). */
static void read_redrives(const chaos_cfg *cfg)
{
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        char path[700], *line = NULL;
        size_t cap = 0;
        snprintf(path, sizeof(path), "%s/server-%zu.log", cfg->dir, i);
        FILE *f = fopen(path, "r");
        while (f != NULL && getline(&line, &cap, f) > 0) {
            const char *p = strstr(line, "redrive method=");
            const char *r = p != NULL ? strstr(p, "from its stored request: ") : NULL;
            if (r != NULL) {
                r += strlen("from its stored request: ");
                ck.bk.redrives[strncmp(r, "ran it again: OK", 16) == 0              ? 0
                               : strncmp(r, "another run had finished it", 27) == 0 ? 1
                                                                                    : 2]++;
            }
        }
        free(line);
        if (f != NULL) {
            fclose(f);
        }
    }
}

static long long ledger_expected[CHAOS_ACCOUNTS];

/* A transactional key (lmdb): its effect and its COMPLETED record commit together, so
 * they must agree; a refusal ("insufficient funds") is recorded without an effect. */
static void check_record(const entry *e)
{
    idem_key_ref ref = {e->caller, e->method, e->key};
    idem_record rec;
    idem_code code = idem_store_get(app_store, &ref, &rec);
    bool completed = code == IDEM_OK && rec.state == IDEM_REC_COMPLETED;
    bool refusal = completed && rec.response != NULL &&
                   memmem(rec.response, rec.response_len, "insufficient funds", 18) != NULL;
    if (e->effects > 0 && !completed) {
        violation(V_EFFECTS, "%s caller=%s key=%s took effect without a completed record",
                  e->method, e->caller, e->key);
    } else if (completed && !refusal && e->effects == 0) {
        violation(V_EFFECTS, "%s caller=%s key=%s has an OK record but no effect", e->method,
                  e->caller, e->key);
    } else if (refusal && e->effects > 0) {
        violation(V_EFFECTS, "%s caller=%s key=%s recorded a refusal but took effect", e->method,
                  e->caller, e->key);
    }
    idem_record_clear(&rec);
}

static void check_effects(entry *e, const chaos_cfg *cfg)
{
    if (e->book != NULL) {
        check_book(e, cfg);
        return;
    }
    bool txn = strcmp(e->method, CHAOS_METHOD_ADD) != 0; /* transactional on both stores */
    if (e->payload[0] == '\0' && e->n_definitive == 0 && e->effects == 0) {
        return; /* only a token issue, never sent */
    }
    int excuse = e->effects > 1 && !txn ? duplicate_excuse(e, cfg) : -1;
    if (e->effects > 1 && excuse < 0) {
        violation(strcmp(e->method, CHAOS_METHOD_ORDER) == 0 ? V_CALLERS : V_EFFECTS,
                  "%s caller=%s key=%s took effect %lld times", e->method, e->caller, e->key,
                  e->effects);
    } else if (e->effects > 1) {
        ck.excused[excuse]++;
    }
    if (txn) {
        check_record(e);
    }
    if (e->acked_ok && e->effects == 0) {
        violation(V_EFFECTS, "%s caller=%s key=%s acknowledged '%s' but no effect", e->method,
                  e->caller, e->key, e->body);
    }
    if (strcmp(e->method, CHAOS_METHOD_TRANSFER) == 0) {
        int a, b;
        long long amount;
        if (e->n_definitive > 0 && !e->acked_ok && e->effects > 0) {
            violation(V_EFFECTS, "transfer %s refused ('%s') but took effect", e->key, e->body);
        }
        if (sscanf(e->payload, "%d %d %lld", &a, &b, &amount) == 3 && a >= 0 && b >= 0 &&
            a < CHAOS_ACCOUNTS && b < CHAOS_ACCOUNTS) {
            ledger_expected[a] -= amount * e->effects;
            ledger_expected[b] += amount * e->effects;
        }
    }
    if (e->n_definitive == 0 && !e->refused) {
        violation(V_RECORDS, "%s caller=%s key=%s never decided, even by the settle pass",
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
        e->effects = app_count(app_store, "applied", e->key);
    } else if (strcmp(e->method, CHAOS_METHOD_ORDER) == 0) {
        e->effects = app_count(app_store, "orders", e->key);
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
            violation(V_EFFECTS, "%s holds %lld, the transfers that took effect say %lld", acct,
                      bal, CHAOS_INITIAL_BALANCE + ledger_expected[i]);
        }
    }
    if (sum != (long long)CHAOS_ACCOUNTS * CHAOS_INITIAL_BALANCE) {
        violation(V_EFFECTS, "money not conserved: %lld in the ledger, %lld expected", sum,
                  (long long)CHAOS_ACCOUNTS * CHAOS_INITIAL_BALANCE);
    }
}

static bool visit_record(void *arg, const idem_key_ref *key, const idem_record *rec)
{
    const chaos_cfg *cfg = arg;
    if (strncmp(key->caller, cfg->run, strlen(cfg->run)) == 0 &&
        rec->state == IDEM_REC_IN_PROGRESS && strcmp(key->method, CHAOS_METHOD_BOOK) != 0) {
        violation(V_RECORDS, "%s caller=%s key=%s still IN_PROGRESS after the run settled",
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
    app_store = st;
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
            violation(V_MEMORY,
                      "server pid %ld: RssAnon %ld KiB at a quarter of its life, %ld "
                      "KiB at the end",
                      l->pid, early, late);
        }
    }
}

uint64_t chaos_check(const chaos_cfg *cfg)
{
    if (!read_history(cfg)) {
        ck.violations++;
    } else {
        read_effects(cfg);
        read_stalls(cfg);
        read_redrives(cfg);
        if (!check_store(cfg)) {
            ck.violations++;
        }
        check_memory();
    }
    uint64_t excused = ck.excused[X_KILLED] + ck.excused[X_STOPPED] + ck.excused[X_NO_WRITE];
    if (excused > 0) {
        printf("note: %" PRIu64 " claim-mode keys ran twice where their owner could not renew "
               "(at-least-once, as documented): %" PRIu64 " %s, %" PRIu64 " %s, %" PRIu64 " %s\n",
               excused, ck.excused[X_KILLED], x_names[X_KILLED], ck.excused[X_STOPPED],
               x_names[X_STOPPED], ck.excused[X_NO_WRITE], x_names[X_NO_WRITE]);
    }
    uint64_t bx = ck.bk.excused[X_KILLED] + ck.bk.excused[X_STOPPED] + ck.bk.excused[X_NO_WRITE] +
                  ck.bk.excused[X_STORE_REFUSED] + ck.bk.excused[X_STALE];
    printf("chaos: steps: %" PRIu64 " Book calls, %" PRIu64 " keys (%" PRIu64
           " abandoned by their client): %" PRIu64 " completed OK, %" PRIu64
           " completed with an error, %" PRIu64 " without a record (released or never "
           "arrived; %" PRIu64 " of them released after a step was recorded), %" PRIu64
           " abandoned before a step was recorded\n",
           ck.bk.calls, ck.bk.keys, ck.bk.abandoned, ck.bk.completed_ok, ck.bk.completed_other,
           ck.bk.no_record, ck.bk.held_released, ck.bk.unstarted);
    printf("chaos: re-driver (%s): %" PRIu64 " re-runs in the servers' logs (%" PRIu64
           " OK, %" PRIu64 " OK replayed, %" PRIu64 " other)\n",
           cfg->redrive_ms > 0 ? "on" : "OFF",
           ck.bk.redrives[0] + ck.bk.redrives[1] + ck.bk.redrives[2], ck.bk.redrives[0],
           ck.bk.redrives[1], ck.bk.redrives[2]);
    if (bx > 0) {
        printf("note: %" PRIu64 " step effects shown again where their owner could not record "
               "them (at-least-once, downstream.h): %" PRIu64 " %s, %" PRIu64 " %s, %" PRIu64
               " %s, %" PRIu64 " %s, %" PRIu64 " %s\n",
               bx, ck.bk.excused[X_KILLED], x_names[X_KILLED], ck.bk.excused[X_STOPPED],
               x_names[X_STOPPED], ck.bk.excused[X_NO_WRITE], x_names[X_NO_WRITE],
               ck.bk.excused[X_STORE_REFUSED], x_names[X_STORE_REFUSED], ck.bk.excused[X_STALE],
               x_names[X_STALE]);
    }
    if (ck.exhausted > 0) {
        printf("note: %" PRIu64 " calls answered RESOURCE_EXHAUSTED, %" PRIu64
               " of them while the store was full\n",
               ck.exhausted, ck.when_full);
    }
    printf("chaos: faults: %" PRIu64 " kill, %" PRIu64 " stop, %" PRIu64 " fill, %" PRIu64
           " pg_restart, %" PRIu64 " redis_stop, %" PRIu64 " partition, %" PRIu64 " slow_db\n",
           ck.kinds[0], ck.kinds[1], ck.kinds[2], ck.kinds[3], ck.kinds[4], ck.kinds[5],
           ck.kinds[6]);
    if (ck.violations > 0) {
        printf("chaos: violations by kind:");
        for (size_t k = 0; k < sizeof(v_names) / sizeof(v_names[0]); k++) {
            printf(" %" PRIu64 " %s", ck.shown[k], v_names[k]);
        }
        printf("\n");
    }
    printf("chaos: %" PRIu64 " calls, %" PRIu64 " faults, %" PRIu64 " violations\n", ck.calls,
           ck.fault_count, ck.violations);
    return ck.violations;
}

/* The checker's readers (chaos_check.h): the history (each answer checked as it is
 * read), the servers' effect log, the store agent's stalls (lmdb) and the re-runs in the
 * servers' logs. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "call.h"
#include "chaos_check.h"

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
        ck_violation(V_ANSWERS, "%s caller=%s key=%s: RESOURCE_EXHAUSTED without a cause '%s'",
                     e->method, e->caller, e->key, body);
    }
}

static void check_answer(entry *e, const char *code, const char *digest, const char *body)
{
    bool ok = strcmp(code, "OK") == 0, fp = strcmp(code, "FAILED_PRECONDITION") == 0;
    if (!ok && !fp && strcmp(code, "INVALID_ARGUMENT") != 0 &&
        strcmp(code, "PERMISSION_DENIED") != 0) {
        return; /* not definitive: retryable or a debounced double click */
    }
    bool expected = fp && ((strcmp(e->method, CHAOS_METHOD_TRANSFER) == 0 &&
                            strstr(body, "insufficient funds") != NULL) ||
                           (e->book != NULL && strstr(body, "card declined") != NULL));
    if (!ok && !expected) {
        ck_violation(V_ANSWERS, "%s caller=%s key=%s: refused with %s '%s'", e->method, e->caller,
                     e->key, code, body);
        e->refused = true;
        return;
    }
    if (!answer_is_mine(e, body)) {
        ck_violation(V_CALLERS, "%s caller=%s key=%s got someone else's answer '%s'", e->method,
                     e->caller, e->key, body);
    }
    if (e->n_definitive++ == 0) {
        snprintf(e->code, sizeof(e->code), "%s", code);
        snprintf(e->digest, sizeof(e->digest), "%s", digest);
        snprintf(e->body, sizeof(e->body), "%s", body);
    } else if (strcmp(e->code, code) != 0 || strcmp(e->digest, digest) != 0) {
        ck_violation(V_ANSWERS, "%s caller=%s key=%s: '%s %s' then '%s %s'", e->method, e->caller,
                     e->key, e->code, e->body, code, body);
    }
    e->acked_ok = e->acked_ok || ok;
    if (ok && e->book != NULL) {
        ck_book_answer(e, body);
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

/* The end of a slow_http fault (chaos_faults_http.c) or a slow_grpc one
 * (chaos_faults_grpc.c): no slow connection or stream still open when it ended (5-8 s
 * after their first byte, more than twice the request timeout + 1 s: an HTTP client that
 * waited for a free slot gets its own timeout), the ordinary request answered. */
static void check_slow_front(const char *line, const char *const kinds[2], int timeout_ms)
{
    char server[8] = "", field[24], held[24], open[8], probe[16] = "";
    chaos_history_field(line, "server", server, sizeof(server));
    chaos_history_field(line, "probe", probe, sizeof(probe));
    for (int k = 0; k < 2; k++) {
        held[0] = open[0] = '\0';
        snprintf(field, sizeof(field), "%s_ms", kinds[k]);
        chaos_history_field(line, field, held, sizeof(held));
        snprintf(field, sizeof(field), "%s_open", kinds[k]);
        chaos_history_field(line, field, open, sizeof(open));
        if (strtoull(open, NULL, 10) > 0) {
            ck_violation(V_HTTP,
                         "server %s still held %s slow client connection(s) or stream(s) (%s) "
                         "when the fault ended, %s ms after their first byte (request timeout "
                         "%d ms)",
                         server, open, kinds[k], held, timeout_ms);
        }
    }
    if (strcmp(probe, "answered") != 0) {
        ck_violation(V_HTTP,
                     "server %s: an ordinary request was not answered while slow "
                     "clients trickled (%s)",
                     server, kinds[0]);
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
    if ((strcmp(kind, "pg_restart") == 0 || strcmp(kind, "hung_host") == 0) && !end) {
        ck.restart_from = strtoull(t, NULL, 10);
    } else if (strcmp(kind, "pg_restart") == 0 && ck.n_stalls < MAX_STALLS) {
        ck.stalls[ck.n_stalls++] = (stall){ck.restart_from, strtoull(t, NULL, 10)};
    }
    static const char *const http_kinds[2] = {"head", "refused"};
    static const char *const grpc_kinds[2] = {"trickle", "nodata"};
    if (end && strcmp(kind, "slow_http") == 0) {
        check_slow_front(line, http_kinds, CHAOS_HTTP_REQUEST_TIMEOUT_MS);
    } else if (end && strcmp(kind, "slow_grpc") == 0) {
        check_slow_front(line, grpc_kinds, CHAOS_GRPC_REQUEST_TIMEOUT_MS);
    }
    if (end) {
        return;
    }
    if (strcmp(kind, "crash") == 0) {
        ck_violation(V_CRASHES, "server %s (pid %s) died or hung without being killed", server,
                     pid);
        return;
    }
    ck.fault_count++;
    size_t k = 0;
    while (k < F_N_KINDS - 1 && strcmp(f_names[k], kind) != 0) {
        k++;
    }
    ck.kinds[k]++;
    /* A partition is a stop of the process's store, not of the process: the same excuse
     * (it cannot renew; another claimer may run the call again). */
    bool stop = strcmp(kind, "stop") == 0 || strcmp(kind, "partition") == 0;
    bool kill = strcmp(kind, "kill") == 0 || strcmp(kind, "undo_crash") == 0;
    if ((stop || kill) && ck.n_faults < MAX_FAULTS) {
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
    if (strcmp(ev, "pg_restarted") == 0 && ck.n_stalls < MAX_STALLS) {
        char t[24] = "0"; /* hung_host: only its restart is a window without writes */
        chaos_history_field(line, "t", t, sizeof(t));
        ck.stalls[ck.n_stalls++] = (stall){ck.restart_from, strtoull(t, NULL, 10)};
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
    entry *e = ck_lookup(method, caller, key, true);
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
        char front[8] = "";
        chaos_history_field(line, "front", front, sizeof(front));
        ck.calls++;
        ck.grpc_calls += strcmp(front, "grpc") == 0;
        ck.bk.calls += e->book != NULL;
        if (strcmp(code, "RESOURCE_EXHAUSTED") == 0) {
            check_exhausted(e, strtoull(t, NULL, 10), body);
        }
        check_answer(e, code, digest, body);
    }
}

bool ck_read_history(const chaos_cfg *cfg)
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
 * STEP recorded or STEP unrecorded:CODE (not an effect). An undo's STEP names the hold it
 * undoes: undo=hold.PID.FENCE. */
static void read_effect_line(const char *line)
{
    char method[48], caller[80], key[160], step[64] = "", note[48] = "";
    long pid;
    uint64_t fence, t;
    execution of = {0};
    int n = sscanf(line, "%47s %79s %159s %ld %" SCNu64 " %" SCNu64 " %63s %47s", method, caller,
                   key, &pid, &fence, &t, step, note);
    if (strncmp(step, "undo=", 5) == 0) {
        if (sscanf(step + 5, "hold.%ld.%" SCNu64, &of.pid, &of.fence) != 2) {
            of.pid = 0;
        }
        step[4] = '\0';
    }
    entry *e = n >= 6 ? ck_lookup(method, caller, key, true) : NULL;
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
        ck_violation(V_EFFECTS, "%s caller=%s key=%s: an effect line of no known step '%s'", method,
                     caller, key, step);
        return;
    }
    step_log *l = &e->book->steps[s];
    if (s == S_UNDO && strcmp(note, "transient") == 0) {
        ck.bk.undo_transient++; /* an undo that failed before its effect */
        return;
    }
    bool recorded = strcmp(note, "recorded") == 0;
    l->n_recorded += recorded;
    if ((recorded || strncmp(note, "unrecorded:", 11) == 0) && l->n_notes < MAX_EFFECTS) {
        step_note *sn = &l->notes[l->n_notes++];
        *sn = (step_note){.pid = pid, .fence = fence, .t = t, .recorded = recorded};
        snprintf(sn->code, sizeof(sn->code), "%s", recorded ? "" : note + 11);
    } else if (note[0] == '\0') {
        if (l->n < MAX_EFFECTS) {
            l->exec[l->n] = (execution){pid, fence, t};
            l->of[l->n] = of;
        }
        l->n++;
    }
}

void ck_read_effects(const chaos_cfg *cfg)
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
void ck_read_stalls(const chaos_cfg *cfg)
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

/* The servers' re-runs: "redrive method=... from its stored request: HOW: CODE", HOW
 * "ran it again" (the error level), "another run had finished it: replayed its
 * outcome" or "did not run it" (the info level, only in logs at that level). */
/* Calls fn with each line of each server's log. */
static void each_server_line(const chaos_cfg *cfg, void (*fn)(const char *line, void *arg),
                             void *arg)
{
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        char path[700], *line = NULL;
        size_t cap = 0;
        snprintf(path, sizeof(path), "%s/server-%zu.log", cfg->dir, i);
        FILE *f = fopen(path, "r");
        while (f != NULL && getline(&line, &cap, f) > 0) {
            fn(line, arg);
        }
        free(line);
        if (f != NULL) {
            fclose(f);
        }
    }
}

static void read_redrive_line(const char *line, void *arg)
{
    (void)arg;
    const char *p = strstr(line, "redrive method=");
    const char *r = p != NULL ? strstr(p, "from its stored request: ") : NULL;
    if (r != NULL) {
        r += strlen("from its stored request: ");
        ck.bk.redrives[strncmp(r, "ran it again: OK", 16) == 0              ? 0
                       : strncmp(r, "another run had finished it", 27) == 0 ? 1
                                                                            : 2]++;
    }
}

void ck_read_redrives(const chaos_cfg *cfg)
{
    each_server_line(cfg, read_redrive_line, NULL);
}

static int lapse_cmp(const void *a, const void *b)
{
    const lapse *x = a, *y = b;
    int c = strcmp(x->hash, y->hash);
    return c != 0 ? c : x->t < y->t ? -1 : x->t > y->t;
}

/* The value of logfmt field " name=" in line (unquoted), or "". */
static void log_field(const char *line, const char *name, char *out, size_t cap)
{
    const char *p = strstr(line, name);
    size_t n = p != NULL ? strcspn(p + strlen(name), " \n") : 0;
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), p != NULL ? p + strlen(name) : "");
}

static void read_lapse_line(const char *line, void *arg)
{
    int64_t wall_minus_mono = *(const int64_t *)arg;
    char hash[sizeof(((lapse *)0)->hash)], at[24];
    if (strstr(line, " lapsed_at_ms=") == NULL) {
        return;
    }
    log_field(line, " lapsed_at_ms=", at, sizeof(at));
    log_field(line, " key=", hash, sizeof(hash));
    uint64_t wall = strtoull(at, NULL, 10);
    if (wall == 0 || hash[0] == '\0' || (int64_t)wall < wall_minus_mono) {
        return; /* "lapsed_at_ms=0": a claim lost while its lease held, no lapse */
    }
    lapse *l = realloc(ck.lapses, (ck.n_lapses + 1) * sizeof(*l));
    if (l != NULL) {
        ck.lapses = l;
        snprintf(l[ck.n_lapses].hash, sizeof(l->hash), "%s", hash);
        l[ck.n_lapses++].t = (uint64_t)((int64_t)wall - wall_minus_mono);
    }
}

/* The servers' lapse lines (the keeper's "lease lapsed", and "claim lost while the
 * handler ran" when the owner's own count had run out), on the campaign's clock: the
 * wall clock less its distance to the monotonic one now. */
void ck_read_lapses(const chaos_cfg *cfg)
{
    struct timespec w, m;
    clock_gettime(CLOCK_REALTIME, &w);
    clock_gettime(CLOCK_MONOTONIC, &m);
    int64_t off = ((int64_t)w.tv_sec - (int64_t)m.tv_sec) * 1000 +
                  ((int64_t)w.tv_nsec - (int64_t)m.tv_nsec) / 1000000;
    each_server_line(cfg, read_lapse_line, &off);
    if (ck.n_lapses > 0) {
        qsort(ck.lapses, ck.n_lapses, sizeof(*ck.lapses), lapse_cmp);
    }
}

bool ck_lapsed(const char *key, uint64_t from, uint64_t to)
{
    lapse want = {.t = from};
    idem__log_key_hash(want.hash, key);
    size_t lo = 0, hi = ck.n_lapses;
    while (lo < hi) { /* the first at or after (hash, from) */
        size_t mid = lo + (hi - lo) / 2;
        if (lapse_cmp(&ck.lapses[mid], &want) < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo < ck.n_lapses && strcmp(ck.lapses[lo].hash, want.hash) == 0 && ck.lapses[lo].t <= to;
}

/* The checker's chaos.Trip/Book part (chaos_check.h): per (caller, key) one outcome,
 * each step's effect once but for the evidence that its owner could not record it, and
 * a journaled call finished by the re-driver (docs/chaos.md, "Journaled steps"). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "journal.h" /* idem__steps_next_call: the journals the re-driver would see */
#include "chaos_check.h"

const char *const step_names[N_STEPS] = {"hold", "pay", "undo"};

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
void ck_book_answer(entry *e, const char *body)
{
    for (int i = 0; i < N_OUT; i++) {
        char out[96];
        step_output(body, strlen(body), step_names[i], out, sizeof(out));
        if (out[0] == '\0') {
            ck_violation(V_ANSWERS, "%s caller=%s key=%s: an OK answer without its %s output '%s'",
                         e->method, e->caller, e->key, step_names[i], body);
        } else if (e->book->ok_out[i][0] == '\0') {
            snprintf(e->book->ok_out[i], sizeof(e->book->ok_out[i]), "%s", out);
        } else if (strcmp(e->book->ok_out[i], out) != 0) {
            ck_violation(V_ANSWERS, "%s caller=%s key=%s: OK answers name %s %s and %s", e->method,
                         e->caller, e->key, step_names[i], e->book->ok_out[i], out);
        }
    }
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
static int step_excuse(const entry *e, const step_log *l, const execution *x, const chaos_cfg *cfg)
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
    /* The owner's own word that its lease ran out around x (the key's lapse line). */
    return ck_lapsed(e->key, x->t > window ? x->t - window : 0, x->t + window) ? X_LAPSED : -1;
}

static bool same_run(const execution *a, const execution *b)
{
    return a->pid == b->pid && a->fence == b->fence;
}

/* The undo lines of b that name hold effect h (its pid and fence). */
static size_t undos_of(const book *b, const execution *h)
{
    const step_log *u = &b->steps[S_UNDO];
    size_t n = 0;
    for (size_t i = 0; i < u->n && i < MAX_EFFECTS; i++) {
        n += same_run(&u->of[i], h);
    }
    return n;
}

/* Step `s` of a Book: named is the output its COMPLETED OK record names ("" if none).
 * Every effect line but the named one needs an excuse; with none named (no outcome, or
 * not OK) one may stand without, unless no step of the call was recorded at all
 * (unrecorded: no journal and no outcome), where none may. A hold that an undo names
 * was given back (the re-driver gave up on the call and compensated it: docs/chaos.md,
 * campaign finding 4): it stands no more, and check_undos checks it was undone once. */
static void check_step(entry *e, int s, const char *named, bool unrecorded, const chaos_cfg *cfg)
{
    const step_log *l = &e->book->steps[s];
    size_t n = l->n < MAX_EFFECTS ? l->n : MAX_EFFECTS, found = 0, unexcused = 0;
    long pid = 0;
    uint64_t fence = 0;
    if (named[0] != '\0' &&
        sscanf(named + strlen(step_names[s]), ".%ld.%" SCNu64, &pid, &fence) != 2) {
        ck_violation(V_EFFECTS, "%s caller=%s key=%s: its record names %s output '%s'", e->method,
                     e->caller, e->key, step_names[s], named);
    }
    int first_x = -1;
    for (size_t i = 0; i < n; i++) {
        const execution *x = &l->exec[i];
        if (named[0] != '\0' && x->pid == pid && x->fence == fence && found++ == 0) {
            continue;
        }
        if (s == S_HOLD && undos_of(e->book, x) > 0) {
            ck.bk.given_back++;
            continue;
        }
        int xc = step_excuse(e, l, x, cfg);
        if (xc >= 0) {
            ck.bk.excused[xc]++;
        } else if (unexcused++ == 0) {
            first_x = (int)i;
        }
    }
    size_t allowed = named[0] != '\0' || unrecorded ? 0 : 1;
    if (named[0] != '\0' && found == 0) {
        ck_violation(V_EFFECTS,
                     "%s caller=%s key=%s: its outcome names %s %s, which no effect shows",
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
        ck_violation(V_EFFECTS,
                     "%s caller=%s key=%s: step %s took effect %zu times (%zu without evidence "
                     "that its owner could not record it, e.g. pid %ld fence %" PRIu64
                     " at %" PRIu64 ", %s; outcome names '%s')",
                     e->method, e->caller, e->key, step_names[s], l->n, unexcused, x->pid, x->fence,
                     x->t, why, named);
    }
}

bool ck_declined(const entry *e)
{
    return strncmp(e->payload, "decline", 7) == 0;
}

/* Whether hold effect h is among the first MAX_EFFECTS hold lines of the Book. */
static bool hold_shown(const step_log *hold, const execution *h)
{
    for (size_t i = 0; i < hold->n && i < MAX_EFFECTS; i++) {
        if (same_run(&hold->exec[i], h)) {
            return true;
        }
    }
    return false;
}

/* The undos of hold `of`, which undo line i names first: each but the last needs
 * step_excuse's evidence (its run killed or stopped after its effect, before its record:
 * an undo_crash), else the hold was undone twice. */
static void check_undos_of(entry *e, size_t i, const execution *kept, const chaos_cfg *cfg)
{
    const step_log *undo = &e->book->steps[S_UNDO];
    const execution *of = &undo->of[i];
    size_t n = undo->n < MAX_EFFECTS ? undo->n : MAX_EFFECTS, times = 0, unexcused = 0, last = i;
    for (size_t j = i; j < n; j++) {
        if (same_run(&undo->of[j], of)) {
            times++;
            unexcused += j != i && step_excuse(e, undo, &undo->exec[last], cfg) < 0;
            last = j;
        }
    }
    ck.bk.undos_again += times - 1;
    if (of->pid == 0) {
        ck_violation(V_EFFECTS, "%s caller=%s key=%s: %zu undo lines name no hold", e->method,
                     e->caller, e->key, times);
    } else if (!hold_shown(&e->book->steps[S_HOLD], of)) {
        ck_violation(V_EFFECTS,
                     "%s caller=%s key=%s: undoes hold.%ld.%" PRIu64 ", which no hold "
                     "effect shows",
                     e->method, e->caller, e->key, of->pid, of->fence);
    } else if (same_run(of, kept)) {
        ck_violation(V_EFFECTS,
                     "%s caller=%s key=%s: undoes hold.%ld.%" PRIu64 ", the hold its "
                     "OK outcome names",
                     e->method, e->caller, e->key, of->pid, of->fence);
    }
    if (unexcused > 0) {
        ck_violation(V_EFFECTS,
                     "%s caller=%s key=%s: hold.%ld.%" PRIu64 " undone %zu times (%zu of the "
                     "earlier undos without evidence that their run could not record them): "
                     "undone twice",
                     e->method, e->caller, e->key, of->pid, of->fence, times, unexcused);
    }
}

/* The undo lines of a Book (its compensation: a declined card, or the re-driver giving
 * up on the call). Each names the hold it undoes by the output the store recorded for
 * it, so a hold whose "recorded" note a kill cut off still counts (docs/chaos.md,
 * campaign finding 3): it must be one of this Book's hold effects, not the one its OK
 * outcome names (kept_hold), and each hold is undone once but for the evidence above. */
static void check_undos(entry *e, const char *kept_hold, const chaos_cfg *cfg)
{
    const step_log *undo = &e->book->steps[S_UNDO];
    execution kept = {0};
    if (kept_hold[0] != '\0' &&
        sscanf(kept_hold, "hold.%ld.%" SCNu64, &kept.pid, &kept.fence) != 2) {
        kept.pid = 0; /* check_step reports the malformed output */
    }
    ck.bk.undos += undo->n;
    for (size_t i = 0; i < undo->n && i < MAX_EFFECTS; i++) {
        size_t first = 0;
        while (!same_run(&undo->of[first], &undo->of[i])) {
            first++;
        }
        if (first == i) { /* its hold's undos are checked at the first */
            check_undos_of(e, i, &kept, cfg);
        }
    }
}

/* A declined Book (payload "decline N", chaos_server.c): its card is declined after
 * "hold", so each hold that was recorded is undone by the compensation (downstream.h,
 * sagas), also across a crash during it, a transient failure of the undo and the key's
 * new generation after the release: a hold noted recorded that no undo names is a
 * compensation lost or never finished (check_undos checks each is undone once). It
 * never pays. */
static void check_declined(entry *e)
{
    const step_log *hold = &e->book->steps[S_HOLD];
    ck.bk.declined++;
    if (e->book->steps[S_PAY].n > 0) {
        ck_violation(V_EFFECTS, "%s caller=%s key=%s: declined, yet it paid %zu times", e->method,
                     e->caller, e->key, e->book->steps[S_PAY].n);
    }
    for (size_t i = 0; i < hold->n_notes; i++) {
        const step_note *n = &hold->notes[i];
        execution h = {n->pid, n->fence, n->t};
        if (n->recorded && undos_of(e->book, &h) == 0) {
            ck_violation(V_EFFECTS,
                         "%s caller=%s key=%s: declined, hold.%ld.%" PRIu64 " recorded but "
                         "never undone: a compensation lost or never finished (journaled: %s)",
                         e->method, e->caller, e->key, n->pid, n->fence,
                         e->book->journaled ? "yes" : "no");
        }
    }
}

/* A Book after settling, from its record and its journal: safety (each step's effect
 * once, but for the evidence of an owner that could not record it; the outcome's step
 * outputs are the answers' and match effects) and the re-driver's liveness (a call
 * with a journaled step is finished: left IN_PROGRESS is a violation). */
/* Whether the Book's request still has a step journal in the store (listed for the
 * re-driver or not: a released call keeps its journal for a retry). */
static bool journaled(const entry *e)
{
    idem_key_ref ref = {e->caller, e->method, e->key};
    uint8_t fp[IDEM_FINGERPRINT_LEN];
    bool exists = false;
    if (!idem__fingerprint(e->method, e->payload, strlen(e->payload), fp) ||
        idem__steps_journal_exists(ck.store, &ref, fp, &exists) != IDEM_OK) {
        ck_violation(V_RECORDS, "%s caller=%s key=%s: reading its step journal: %s", e->method,
                     e->caller, e->key, idem_errmsg());
    }
    return exists;
}

void ck_check_book(entry *e, const chaos_cfg *cfg)
{
    book *b = e->book;
    idem_key_ref ref = {e->caller, e->method, e->key};
    idem_record rec;
    char named[N_OUT][96] = {"", ""};
    memset(&rec, 0, sizeof(rec));
    idem_code code = idem_store_get(ck.store, &ref, &rec);
    bool in_progress = code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS;
    bool completed = code == IDEM_OK && rec.state == IDEM_REC_COMPLETED;
    bool ok = completed && rec.response != NULL &&
              memmem(rec.response, rec.response_len, " pay=", 5) != NULL;
    ck.bk.keys++;
    ck.bk.abandoned += b->abandoned;
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        ck_violation(V_RECORDS, "%s caller=%s key=%s: reading its record: %s", e->method, e->caller,
                     e->key, idem_errmsg());
        return;
    }
    b->journaled = journaled(e);
    for (int i = 0; ok && i < N_OUT; i++) {
        step_output(rec.response, rec.response_len, step_names[i], named[i], sizeof(named[i]));
        if (b->ok_out[i][0] != '\0' && strcmp(b->ok_out[i], named[i]) != 0) {
            ck_violation(V_ANSWERS, "%s caller=%s key=%s: answered %s %s, its record names %s",
                         e->method, e->caller, e->key, step_names[i], b->ok_out[i], named[i]);
        }
    }
    if (in_progress && b->journaled) {
        ck_violation(V_RECORDS,
                     "%s caller=%s key=%s left IN_PROGRESS (lease until %" PRIu64 ") with a "
                     "journaled step after settling: the re-driver did not finish it (hold "
                     "effects %zu, pay effects %zu%s)",
                     e->method, e->caller, e->key, rec.lease_until_ms, b->steps[S_HOLD].n,
                     b->steps[S_PAY].n, b->abandoned ? ", its client gave up" : "");
    } else if (in_progress && !b->abandoned) {
        ck_violation(V_RECORDS, "%s caller=%s key=%s still IN_PROGRESS after the run settled",
                     e->method, e->caller, e->key);
    } else if (in_progress) {
        ck.bk.unstarted++; /* nothing recorded to run again from: its client's decision */
    } else if (completed && b->journaled) {
        ck_violation(V_RECORDS, "%s caller=%s key=%s: its step journal outlived its outcome",
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
    for (int i = 0; !ck_declined(e) && i < N_OUT; i++) {
        check_step(e, i, named[i], unrecorded, cfg);
    }
    if (ck_declined(e)) {
        check_declined(e);
    }
    check_undos(e, named[S_HOLD], cfg);
    if (e->acked_ok && !ok) {
        ck_violation(V_EFFECTS, "%s caller=%s key=%s acknowledged '%s' but has no OK record",
                     e->method, e->caller, e->key, e->body);
    }
    if (e->n_definitive == 0 && !e->refused && !b->abandoned) {
        ck_violation(V_RECORDS, "%s caller=%s key=%s never decided, even by the settle pass",
                     e->method, e->caller, e->key);
    }
    idem_record_clear(&rec);
}

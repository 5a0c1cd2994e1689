/* The fault campaign's checker (chaos/chaos_check_book.c) on hand-written histories of
 * one chaos.Trip/Book: what it must accept (issue 35's long campaign, findings 3 and 4:
 * gaps of the checker) and what it must still report (a real second undo). Each history
 * is an effect log as the campaign's servers write it, read by the checker's own reader,
 * checked against an empty store (the call was released: no record, no journal). */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "call.h"
#include "chaos_check.h"
#include "testutil.h"

#define LEASE_MS 500

static char *dir;
static chaos_cfg cfg;
static FILE *log_f;

static void setup(void)
{
    ck.store = tu_store_open("chaos-check", &dir);
    memset(&cfg, 0, sizeof(cfg));
    cfg.lease_ms = LEASE_MS;
    snprintf(cfg.effects, sizeof(cfg.effects), "%s/effects.log", dir);
    snprintf(cfg.dir, sizeof(cfg.dir), "%s", dir);
    log_f = fopen(cfg.effects, "w");
    cr_assert_not_null(log_f);
}

static void teardown(void)
{
    idem_store_close(ck.store);
    tu_rmtree(dir);
}

TestSuite(chaos_check, .init = setup, .fini = teardown, .timeout = 60);

/* An effect line (or a note) of key K's Book step: "STEP" or "STEP NOTE". */
static void line(long pid, uint64_t fence, uint64_t t, const char *tail)
{
    fprintf(log_f, "%s c K %ld %" PRIu64 " %" PRIu64 " %s\n", CHAOS_METHOD_BOOK, pid, fence, t,
            tail);
}

/* hold's effect by (pid, fence) at t, and its note "hold recorded" unless killed. */
static void hold(long pid, uint64_t fence, uint64_t t, bool noted)
{
    line(pid, fence, t, "hold");
    if (noted) {
        line(pid, fence, t + 2, "hold recorded");
    }
}

/* An undo by the run (pid, fence) at t of the hold (hold_pid, hold_fence). */
static void undo(long pid, uint64_t fence, uint64_t t, long hold_pid, uint64_t hold_fence)
{
    char tail[64];
    snprintf(tail, sizeof(tail), "undo=hold.%ld.%" PRIu64, hold_pid, hold_fence);
    line(pid, fence, t, tail);
}

static void killed(long pid, uint64_t t)
{
    cr_assert_lt(ck.n_faults, MAX_FAULTS);
    ck.faults[ck.n_faults++] = (fault){.t = t, .pid = pid, .stop = false};
}

/* Reads the log and checks the Book (payload: "decline 1" or "trip 1"); the violations. */
static uint64_t check(const char *payload)
{
    cr_assert_eq(fclose(log_f), 0);
    log_f = NULL;
    ck_read_effects(&cfg);
    ck_read_lapses(&cfg);
    entry *e = ck_lookup(CHAOS_METHOD_BOOK, "c", "K", false);
    cr_assert_not_null(e, "the checker did not read the log");
    snprintf(e->payload, sizeof(e->payload), "%s", payload);
    e->book->abandoned = true; /* its client gave up: nothing to decide */
    ck_check_book(e, &cfg);
    return ck.violations;
}

/* Finding 3 (lmdb 55573): the server was SIGKILLed 23 ms after a hold whose record had
 * committed, before its note; the re-driver replayed that hold and undid it. Three holds,
 * two notes, three undos: each hold undone once. */
Test(chaos_check, a_hold_killed_after_its_record_and_undone_by_the_redriver_is_undone_once)
{
    hold(100, 1, 1000, true);
    undo(100, 1, 1100, 100, 1);
    hold(100, 3, 10000, true);
    undo(100, 3, 10100, 100, 3);
    hold(100, 5, 20000, false);
    killed(100, 20023);
    undo(200, 9, 23000, 100, 5);
    cr_expect_eq(check("decline 1"), 0);
}

/* Finding 3's pg 10112 case: the compensating run undid the hold, lost its lease while
 * the handler ran (no kill, no stop), and the compensation ran the undo again. */
Test(chaos_check, a_hold_undone_twice_without_a_kill_or_stop_is_reported)
{
    hold(100, 1, 1000, true);
    undo(200, 7, 5000, 100, 1);
    undo(300, 8, 7000, 100, 1);
    cr_expect_eq(check("decline 1"), 1);
}

/* ... and a second undo after the first undo's run was killed before its record is
 * the at-least-once the campaign's undo_crash provokes. */
Test(chaos_check, a_hold_undone_again_after_the_undos_run_was_killed_is_accepted)
{
    hold(100, 1, 1000, true);
    undo(200, 7, 5000, 100, 1);
    killed(200, 5019);
    undo(300, 8, 7000, 100, 1);
    cr_expect_eq(check("decline 1"), 0);
}

/* The Book's record: COMPLETED with an OK answer naming hold.100.1 and pay.100.1. */
static void completed_ok(void)
{
    const char *answer = "OK hold=hold.100.1 pay=pay.100.1";
    idem_claim_req q = {.key = {"c", CHAOS_METHOD_BOOK, "K"}, .now_ms = 1, .lease_until_ms = 1000};
    idem_claim_outcome out;
    idem_record rec;
    q.expires_ms = UINT64_MAX / 2;
    cr_assert_eq(idem_store_claim(ck.store, &q, &out, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(out, IDEM_CLAIM_ACQUIRED);
    cr_assert_eq(
        idem_store_complete(ck.store, &q.key, rec.owner, answer, strlen(answer), UINT64_MAX / 2),
        IDEM_OK, "%s", idem_errmsg());
    idem_record_clear(&rec);
}

/* An undo of the hold that the call's OK outcome names: the outcome stands on a hold that
 * was given back. */
Test(chaos_check, an_undo_of_the_hold_an_ok_outcome_names_is_reported)
{
    hold(100, 1, 1000, true);
    line(100, 1, 1200, "pay");
    line(100, 1, 1202, "pay recorded");
    undo(200, 7, 5000, 100, 1);
    completed_ok();
    cr_expect_eq(check("trip 1"), 1);
}

/* Finding 4 (lmdb 4389, 16217, 965, 52615): a slow Book, abandoned; its re-runs lost
 * their claims; the re-driver gave up, undid the recorded hold and released the call
 * (no record, no journal). The hold was given back once: no violation. */
Test(chaos_check, an_abandoned_book_the_redriver_gave_up_and_compensated_is_accepted)
{
    hold(100, 1, 1000, true);
    undo(200, 12, 9000, 100, 1);
    cr_expect_eq(check("trip 1"), 0);
}

/* ... but that compensation undoing the hold twice is reported, */
Test(chaos_check, an_abandoned_book_whose_hold_was_undone_twice_is_reported)
{
    hold(100, 1, 1000, true);
    undo(200, 12, 9000, 100, 1);
    undo(300, 13, 9500, 100, 1);
    cr_expect_eq(check("trip 1"), 1);
}

/* ... and so is a recorded hold left standing after the call was released. */
Test(chaos_check, an_abandoned_book_released_with_a_recorded_hold_not_undone_is_reported)
{
    hold(100, 1, 1000, true);
    hold(100, 4, 3000, true);
    undo(200, 12, 9000, 100, 1);
    cr_expect_eq(check("trip 1"), 1);
}

/* A server's line that key K's lease ran out at t (the campaign's clock) by its owner's
 * own count, as result_cache_run.c writes it when the completion finds the claim lost. */
static void lapsed_line(uint64_t t)
{
    char path[600], hash[IDEM_LOG_KEY_HASH_CAP];
    struct timespec w, m;
    clock_gettime(CLOCK_REALTIME, &w);
    clock_gettime(CLOCK_MONOTONIC, &m);
    uint64_t wall =
        t + (uint64_t)(w.tv_sec - m.tv_sec) * 1000 + (uint64_t)((w.tv_nsec - m.tv_nsec) / 1000000);
    idem__log_key_hash(hash, "K");
    snprintf(path, sizeof(path), "%s/server-0.log", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "level=error request_id=\"r\" method=\"%s\" key=%s lapsed_at_ms=%" PRIu64
            " msg=\"claim lost while the handler ran; its answer is discarded\"\n",
            CHAOS_METHOD_BOOK, hash, wall);
    cr_assert_eq(fclose(f), 0);
}

/* Issue 35's long campaign on the fixed code (lmdb 16741): a step's effect twice, the
 * first run neither killed nor stopped and the store writing, its record refused
 * ABORTED 570 ms later: with nothing more, a violation... */
static void held_twice(void)
{
    const char *answer = "OK hold=hold.200.5 pay=pay.200.5";
    idem_claim_req q = {.key = {"c", CHAOS_METHOD_BOOK, "K"}, .now_ms = 1, .lease_until_ms = 1000};
    idem_claim_outcome out;
    idem_record rec;
    q.expires_ms = UINT64_MAX / 2;
    cr_assert_eq(idem_store_claim(ck.store, &q, &out, &rec), IDEM_OK, "%s", idem_errmsg());
    cr_assert_eq(
        idem_store_complete(ck.store, &q.key, rec.owner, answer, strlen(answer), UINT64_MAX / 2),
        IDEM_OK, "%s", idem_errmsg());
    idem_record_clear(&rec);
    hold(100, 1, 1000, false);
    line(100, 1, 1570, "hold unrecorded:ABORTED");
    hold(200, 5, 1700, true); /* the run whose outcome the call's record names */
    line(200, 5, 1800, "pay");
    line(200, 5, 1802, "pay recorded");
}

Test(chaos_check, a_step_twice_without_evidence_is_reported)
{
    held_twice();
    cr_expect_eq(check("trip 1"), 1);
}

/* ... and the at-least-once edge when the first run's owner logged that its lease ran
 * out by its own count (no renewal landed in time: a starved process, a slow store). */
Test(chaos_check, a_step_twice_after_its_owner_logged_its_lapse_is_accepted)
{
    held_twice();
    lapsed_line(1400);
    cr_expect_eq(check("trip 1"), 0);
    cr_expect_eq(ck.bk.excused[X_LAPSED], 1);
}

/* A key's life: the table (key_life.h). Read it event by event: a row holds for every
 * state in its mask. Codes are the answer the caller hears (-: the handler's own, or
 * nobody waits). The NEVER rows say why a pair cannot happen. */
#include "key_life.h"

#include "call.h"

#define S(x) IDEM__KL_S(IDEM__KL_##x)
#define ROW(states, ev, act, code, answer, test)                                                   \
    {                                                                                              \
        (states), IDEM__KL_##ev, IDEM__KL_##act, (code), (answer), (test)                          \
    }
#define NO IDEM__KL_NO_CODE
/* States where nobody holds a claim; where the key's record is this request's. */
#define FREE (S(NONE) | S(RELEASED) | S(COMPENSATED) | S(EXPIRED) | S(TOMBSTONE))
#define OWNED (S(LIVE) | S(STEPS) | S(COMPENSATING))
#define NOT_OWNED                                                                                  \
    (S(NONE) | S(LAPSED) | S(COMPLETED) | S(RELEASED) | S(COMPENSATED) | S(EXPIRED) | S(TOMBSTONE))
#define ALL ((1u << IDEM__KL_STATE_COUNT) - 1)
#define NO_OWNER_RUNS "only the claim's owner runs a handler"
#define TEST_TABLE "key_life/every_state_and_event_has_exactly_one_row"

static const idem__key_life_row rows[] = {
    /* ---- a claim by the same request ---- */
    ROW(S(NONE) | S(EXPIRED), CLAIM_SAME, RUN, NO,
        "the handler's (no tombstone: a late retry runs again)",
        "tombstones/off_by_default_an_expired_result_runs_again"),
    ROW(S(COMPENSATED), CLAIM_SAME, RUN, NO, "the handler's: afresh, new derived keys",
        "sagas/a_final_failure_after_a_step_gives_its_effect_back"),
    ROW(S(LIVE) | S(STEPS), CLAIM_SAME, WAIT, IDEM_ABORTED,
        "the first result once it is recorded; past the wait: in progress + retry-after-ms",
        "integration/duplicate_that_outwaits_its_deadline_gets_aborted_in_progress"),
    ROW(S(LAPSED), CLAIM_SAME, RESUME, NO, "the handler's: taken over, recorded steps replay",
        "crash/*_kill_after_claim_runs_once_after_lease"),
    ROW(S(COMPLETED), CLAIM_SAME, REPLAY, NO, "the stored result",
        "integration/final_business_error_is_stored_and_replayed"),
    ROW(S(RELEASED), CLAIM_SAME, RESUME, NO,
        "the handler's: recorded steps replay, same derived keys",
        "hops/a_run_after_a_failure_between_two_steps_replays_the_first_and_runs_the_second"),
    ROW(S(COMPENSATING), CLAIM_SAME, RESUME, NO, "the compensation's: its undos finish",
        "compensation/a_corrected_request_waits_until_the_earlier_compensation_finished"),
    ROW(S(TOMBSTONE), CLAIM_SAME, ANSWER_GONE, IDEM_ALREADY_EXISTS,
        "already done, result expired + idem-result-gone (HTTP 410)",
        "tombstones/a_late_duplicate_after_the_result_ttl_is_told_done_and_never_runs_again"),
    /* ---- a claim by another request ---- */
    ROW(S(NONE) | S(EXPIRED), CLAIM_OTHER, RUN, NO, "the handler's: new derived keys",
        "generations/a_keys_later_request_never_derives_an_earlier_requests_keys"),
    ROW(S(RELEASED), CLAIM_OTHER, RUN, NO, "the handler's: new derived keys",
        "sagas/another_request_after_a_transient_release_derives_new_keys"),
    ROW(S(COMPENSATED), CLAIM_OTHER, RUN, NO, "the handler's: afresh, new derived keys",
        "sagas/a_corrected_request_after_a_compensated_validation_error_runs_afresh"),
    ROW(S(LIVE) | S(STEPS) | S(COMPLETED), CLAIM_OTHER, REFUSE_REUSED, IDEM_INVALID_ARGUMENT,
        "key reused with a different request",
        "integration/key_reused_with_other_payload_is_rejected"),
    ROW(S(LAPSED), CLAIM_OTHER, REFUSE_REUSED, IDEM_INVALID_ARGUMENT, "key reused, at once",
        "shared_server/another_request_under_a_crashed_owners_key_is_refused_at_once"),
    ROW(S(TOMBSTONE), CLAIM_OTHER, REFUSE_REUSED, IDEM_INVALID_ARGUMENT, "key reused",
        "tombstones/another_request_under_a_tombstoned_key_is_key_reused"),
    ROW(S(COMPENSATING), CLAIM_OTHER, REFUSE_COMPENSATING, IDEM_ABORTED,
        "the key is compensating an earlier request; retry later + retry-after-ms",
        "compensation/a_corrected_request_waits_until_the_earlier_compensation_finished"),
    /* ---- the handler's outcome, on its owner's claim ---- */
    ROW(S(LIVE) | S(STEPS), RAN_OK, STORE, NO, "OK, once on disk (a journal is deleted in its txn)",
        "generations/the_redriver_never_reruns_a_completed_call_whose_record_was_swept"),
    ROW(S(LIVE), RAN_FINAL, STORE, NO, "the error, stored and replayed",
        "integration/final_business_error_is_stored_and_replayed"),
    ROW(S(STEPS), RAN_FINAL, COMPENSATE, NO, "the error once the undos ran",
        "sagas/a_final_failure_after_a_step_gives_its_effect_back"),
    ROW(S(LIVE), RAN_REFUSAL, RELEASE_FRESH, IDEM_INVALID_ARGUMENT,
        "the refusal, not stored (a journal and its generation go)",
        "promise/invalid_argument_is_not_stored_by_default"),
    ROW(S(STEPS), RAN_REFUSAL, COMPENSATE, IDEM_INVALID_ARGUMENT, "the refusal once the undos ran",
        "sagas/a_corrected_request_after_a_compensated_validation_error_runs_afresh"),
    ROW(S(LIVE), RAN_TRANSIENT, RELEASE, NO, "the transient error; the retry runs again",
        "integration/transient_failure_releases_claim_and_retry_runs_again"),
    ROW(S(STEPS), RAN_TRANSIENT, RELEASE_KEEP_JOURNAL, NO,
        "the transient error; the retry replays the steps",
        "hops/a_released_call_keeps_its_journal_for_the_retry"),
    ROW(S(COMPENSATING), RAN_OK, COMPENSATE, NO, "the recorded failure once the undos ran",
        "sagas/the_redriver_finishes_a_compensation_that_died_inside_an_undo"),
    ROW(S(COMPENSATING), RAN_FINAL, COMPENSATE, NO, "the recorded failure once the undos ran",
        "shop/order_killed_before_its_undo"),
    ROW(S(COMPENSATING), RAN_REFUSAL, COMPENSATE, NO, "the recorded failure once the undos ran",
        "shop/order_killed_inside_its_undo_after_the_release"),
    ROW(S(COMPENSATING), RAN_TRANSIENT, COMPENSATE, NO,
        "the recorded failure once the undos ran; a run that did not replay every recorded "
        "step (their undos unknown to it): as UNDOS_UNFINISHED",
        "key_life_model/a_transient_retry_keeps_a_compensation_unfinished"),
    ROW(S(LIVE), NOT_RUN, RELEASE, NO, "the interceptor's refusal, not stored",
        "chain_guard/an_auth_rejection_after_result_cache_is_released_not_replayed"),
    ROW(S(STEPS) | S(COMPENSATING), NOT_RUN, RELEASE_KEEP_JOURNAL, NO, "the refusal, not stored",
        "chain_guard/an_auth_rejection_after_result_cache_is_released_not_replayed"),
    ROW(S(LIVE), FENCE_REFUSED, RELEASE, IDEM_UNAVAILABLE,
        "the claim did not reach the disk; retry",
        "disk/a_fence_whose_claim_and_its_redo_fail_to_commit_is_refused_not_handed_out_twice"),
    ROW(S(STEPS) | S(COMPENSATING), FENCE_REFUSED, RELEASE_KEEP_JOURNAL, IDEM_UNAVAILABLE,
        "the claim did not reach the disk; retry",
        "disk/a_fence_whose_claim_and_its_redo_fail_to_commit_is_refused_not_handed_out_twice"),
    ROW(OWNED, CLAIM_LOST, ANSWER_WINNER, IDEM_ABORTED,
        "the winner's stored result, else claim lost; retry with the same key",
        "lease/a_claim_lost_while_its_handler_ran_is_logged_with_its_key_and_its_lapse"),
    ROW(NOT_OWNED, RAN_OK, NEVER, NO, NO_OWNER_RUNS, TEST_TABLE),
    ROW(NOT_OWNED, RAN_FINAL, NEVER, NO, NO_OWNER_RUNS, TEST_TABLE),
    ROW(NOT_OWNED, RAN_REFUSAL, NEVER, NO, NO_OWNER_RUNS, TEST_TABLE),
    ROW(NOT_OWNED, RAN_TRANSIENT, NEVER, NO, NO_OWNER_RUNS, TEST_TABLE),
    ROW(NOT_OWNED, NOT_RUN, NEVER, NO, NO_OWNER_RUNS, TEST_TABLE),
    ROW(NOT_OWNED, FENCE_REFUSED, NEVER, NO, NO_OWNER_RUNS, TEST_TABLE),
    ROW(NOT_OWNED, CLAIM_LOST, NEVER, NO, NO_OWNER_RUNS, TEST_TABLE),
    /* ---- a journaled step ---- */
    ROW(S(LIVE) | S(STEPS), STEP, JOURNAL, NO, "the step's output (replayed by every later run)",
        "hops/a_run_after_a_failure_between_two_steps_replays_the_first_and_runs_the_second"),
    ROW(S(LAPSED), STEP, REFUSE_STEP, IDEM_ABORTED, "claim lost: the step does not start",
        "hops/a_run_past_its_lease_starts_no_step"),
    ROW(S(COMPLETED), STEP, REFUSE_STEP, IDEM_ABORTED, "claim lost: nothing recorded",
        "hops/a_run_that_wakes_after_the_call_completed_records_no_step"),
    ROW(S(COMPENSATING), STEP, REFUSE_STEP, NO, "no new step runs: the compensation's failure",
        "shop/order_killed_before_its_undo"),
    ROW(FREE, STEP, REFUSE_STEP, IDEM_ABORTED, "claim lost: nothing recorded",
        "hops/a_run_that_lost_its_claim_cannot_record_a_step"),
    /* ---- a compensation's undos ---- */
    ROW(S(COMPENSATING), UNDOS_ALL, RELEASE_FRESH, NO, "the failure + idem-compensated: all",
        "sagas/a_final_failure_after_a_step_gives_its_effect_back"),
    ROW(S(COMPENSATING), UNDOS_STAND, STORE, NO,
        "the failure, stored (+ idem-compensated: partial when some undo ran)",
        "sagas/a_failure_after_a_step_without_undo_is_stored_with_the_downstreams_reason"),
    ROW(S(COMPENSATING), UNDOS_UNFINISHED, RELEASE_KEEP_LISTED, IDEM_UNAVAILABLE,
        "compensating: ...; retry with the same key to finish it",
        "compensation/a_corrected_request_waits_until_the_earlier_compensation_finished"),
    ROW(ALL & ~S(COMPENSATING), UNDOS_ALL, NEVER, NO, "undos run only in a compensation",
        TEST_TABLE),
    ROW(ALL & ~S(COMPENSATING), UNDOS_STAND, NEVER, NO, "undos run only in a compensation",
        TEST_TABLE),
    ROW(ALL & ~S(COMPENSATING), UNDOS_UNFINISHED, NEVER, NO, "undos run only in a compensation",
        TEST_TABLE),
    /* ---- a crash of the owner's process ---- */
    ROW(S(LIVE), CRASH, KEEP, NO, "IN_PROGRESS until its lease runs out; the retry runs once",
        "crash/*_kill_after_claim_runs_once_after_lease"),
    ROW(S(STEPS), CRASH, KEEP, NO, "listed: the re-driver (or the retry) finishes it",
        "sagas/the_redriver_finishes_a_call_that_died_inside_its_first_step"),
    ROW(S(COMPENSATING), CRASH, KEEP, NO, "listed: the retry or the re-driver finishes the undos",
        "shop/the_redriver_finishes_a_compensation_whose_process_died"),
    ROW(S(COMPLETED), CRASH, KEEP, NO, "the retry replays the first result",
        "crash/*_kill_after_commit_replays_first_result"),
    ROW(S(TOMBSTONE), CRASH, KEEP, NO, "the tombstone survives the restart",
        "tombstones/survive_a_server_restart"),
    ROW(S(NONE) | S(LAPSED) | S(RELEASED) | S(COMPENSATED) | S(EXPIRED), CRASH, KEEP, NO,
        "nothing held in the process; the retry runs once", "crash/*_kill_before_claim_runs_once"),
    /* ---- a lease running out ---- */
    ROW(S(LIVE), LEASE_LAPSE, KEEP, IDEM_ABORTED,
        "becomes lapsed; a handler not yet started does not start: claim lost",
        "lease/a_handler_does_not_start_on_a_claim_whose_lease_ran_out_before_it_started"),
    ROW(S(STEPS) | S(COMPENSATING), LEASE_LAPSE, KEEP, IDEM_ABORTED,
        "becomes lapsed; the run's next step does not start",
        "hops/a_run_past_its_lease_starts_no_step"),
    ROW(NOT_OWNED, LEASE_LAPSE, NEVER, NO, "no live lease", TEST_TABLE),
    /* ---- a re-driver pass over a listed call ---- */
    ROW(S(LIVE) | S(STEPS), REDRIVE, KEEP, NO, "left to its owner",
        "redrive/two_re_drivers_count_one_death_once_on_lmdb"),
    ROW(S(LAPSED), REDRIVE, RERUN, NO, "to the log; the outcome recorded for the client's retry",
        "sagas/the_redriver_finishes_a_call_that_died_inside_its_first_step"),
    ROW(S(RELEASED), REDRIVE, RERUN, NO, "to the log (a re-run released after a transient failure)",
        "hops/a_rerun_released_after_a_transient_failure_is_run_again"),
    ROW(S(COMPENSATING), REDRIVE, RERUN, NO, "to the log: the undos finish",
        "sagas/the_redriver_finishes_a_compensation_that_died_inside_an_undo"),
    ROW(S(COMPLETED), REDRIVE, FORGET_JOURNAL, NO, "to the log",
        "hops/the_redriver_removes_a_journal_its_completion_could_not_delete"),
    ROW(S(NONE) | S(COMPENSATED) | S(EXPIRED) | S(TOMBSTONE), REDRIVE, NEVER, NO,
        "not listed: no journal, or its completion deleted the listing in its txn",
        "generations/the_redriver_never_reruns_a_completed_call_whose_record_was_swept"),
    ROW(S(RELEASED), REDRIVE_OTHER, UNLIST, NO, "to the log; the journal waits for its retry",
        "sagas/another_request_after_a_transient_release_derives_new_keys"),
    ROW(S(COMPENSATING), REDRIVE_OTHER, KEEP_LISTED, NO, "re-run once the key is free",
        "compensation/the_redriver_finishes_a_compensation_whose_key_another_request_held"),
    ROW(ALL & ~(S(RELEASED) | S(COMPENSATING)), REDRIVE_OTHER, NEVER, NO,
        "the key's record is this request's, or nothing is listed", TEST_TABLE),
    /* ---- the TTL sweep ---- */
    ROW(S(COMPLETED), SWEEP, EXPIRE, NO,
        "after its TTL: a tombstone within tombstone_ttl_ms, else gone",
        "tombstones/a_late_duplicate_after_the_result_ttl_is_told_done_and_never_runs_again"),
    ROW(S(LAPSED) | S(EXPIRED), SWEEP, DELETE, NO, "past its expiry: gone",
        "store/sweep_deletes_only_expired_records_and_tokens"),
    ROW(S(TOMBSTONE), SWEEP, DELETE, NO, "past its horizon, in bounded batches",
        "tombstones/the_sweep_removes_expired_tombstones_in_bounded_batches"),
    ROW(OWNED | S(NONE) | S(RELEASED) | S(COMPENSATED), SWEEP, KEEP, NO,
        "not expired, or no record (a journal goes with its call)",
        "store/sweep_deletes_only_expired_records_and_tokens"),
    /* ---- an operator's forget ---- */
    ROW(S(LIVE) | S(STEPS) | S(LAPSED) | S(COMPLETED) | S(EXPIRED), FORGET, DELETE, NO,
        "idemctl delete (IN_PROGRESS only with --force): the record goes; the next claim runs",
        "store/delete_removes_any_record"),
    ROW(S(COMPENSATING), FORGET, DELETE, NO,
        "a running compensation's record goes (--force); journal and marker stay: the undos "
        "still finish",
        "store/delete_removes_any_record"),
    ROW(S(TOMBSTONE), FORGET, DELETE, NO, "idemctl tombstones delete",
        "tombstones/idemctl_shows_and_deletes_a_tombstone"),
    ROW(S(NONE) | S(RELEASED) | S(COMPENSATED), FORGET, KEEP, IDEM_NOT_FOUND, "no record to delete",
        "store/delete_removes_any_record"),
};

static const idem__key_life_row never = {0,  IDEM__KL_EVENT_COUNT, IDEM__KL_NEVER,
                                         NO, "out of range",       TEST_TABLE};

const idem__key_life_row *idem__key_life_decide(idem__kl_state state, idem__kl_event event)
{
    if ((unsigned)state >= IDEM__KL_STATE_COUNT) {
        return &never;
    }
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        if (rows[i].event == event && (rows[i].states & IDEM__KL_S(state))) {
            return &rows[i];
        }
    }
    return &never;
}

idem__kl_event idem__key_life_outcome(const idem_call *call, idem_code code)
{
    const idem_method_opts *o = &call->method->opts;
    uint32_t transient = o->transient_mask ? o->transient_mask : IDEM_TRANSIENT_CODES;
    if (call->fence_state == IDEM__FENCE_REFUSED) {
        return IDEM__KL_FENCE_REFUSED;
    }
    if (!call->executed) {
        return IDEM__KL_NOT_RUN;
    }
    if ((unsigned)code >= IDEM_CODE_COUNT || (IDEM_CODE_BIT(code) & transient) ||
        (code == IDEM_INVALID_ARGUMENT && !o->store_invalid_argument)) {
        /* an out-of-range code from an interceptor is not an answer to keep */
        return code == IDEM_INVALID_ARGUMENT ? IDEM__KL_RAN_REFUSAL : IDEM__KL_RAN_TRANSIENT;
    }
    return code == IDEM_OK ? IDEM__KL_RAN_OK : IDEM__KL_RAN_FINAL;
}

const idem__key_life_row *idem__key_life_rows(size_t *count)
{
    *count = sizeof(rows) / sizeof(rows[0]);
    return rows;
}

const char *idem__kl_state_name(idem__kl_state s)
{
    static const char *const names[IDEM__KL_STATE_COUNT] = {
        "no record",
        "IN_PROGRESS, live lease",
        "IN_PROGRESS, live lease, effectful steps recorded",
        "IN_PROGRESS, lease lapsed",
        "COMPLETED",
        "released with its journal",
        "compensating (marker set, undos unfinished)",
        "compensated (journal and generation gone)",
        "expired or swept, no tombstone",
        "tombstone"};
    return (unsigned)s < IDEM__KL_STATE_COUNT ? names[s] : "?";
}

const char *idem__kl_event_name(idem__kl_event e)
{
    static const char *const names[IDEM__KL_EVENT_COUNT] = {
        "claim by the same request",
        "claim by another request",
        "handler: OK",
        "handler: final error (stored)",
        "handler: INVALID_ARGUMENT (not stored)",
        "handler: transient error",
        "handler not run (an interceptor or the journal answered)",
        "fence refused",
        "claim lost",
        "step recorded",
        "undos: all ran",
        "undos: an effect stands",
        "undos: one unfinished",
        "crash",
        "lease lapse",
        "re-driver pass",
        "re-driver pass, key another request's",
        "TTL sweep",
        "operator forget"};
    return (unsigned)e < IDEM__KL_EVENT_COUNT ? names[e] : "?";
}

const char *idem__kl_action_name(idem__kl_action a)
{
    static const char *const names[IDEM__KL_ACTION_COUNT] = {
        "run (claim; new generation)",
        "resume (claim; steps replay, generation kept)",
        "replay",
        "wait, then look again",
        "refuse: key reused",
        "refuse: compensating",
        "answer: result gone",
        "store the outcome",
        "release",
        "release, keep the journal (unlisted)",
        "release, keep journal and listing",
        "release; journal and generation go",
        "compensate",
        "answer the winner's",
        "run and record the step",
        "refuse the step",
        "nothing",
        "re-run",
        "delete the journal",
        "unlist",
        "keep listed",
        "expire (tombstone or delete)",
        "delete",
        "cannot happen"};
    return (unsigned)a < IDEM__KL_ACTION_COUNT ? names[a] : "?";
}

/* The key's life table (src/core/key_life.c) as data: every (state, event) pair has
 * exactly one row (a pair that cannot happen: a NEVER row saying why), so no two rows
 * conflict, and the decider answers each pair's row. */
#include <criterion/criterion.h>
#include <string.h>

#include "key_life.h"

#define ALL_STATES ((1u << IDEM__KL_STATE_COUNT) - 1)

Test(key_life, every_state_and_event_has_exactly_one_row)
{
    size_t n;
    const idem__key_life_row *rows = idem__key_life_rows(&n);
    for (int s = 0; s < IDEM__KL_STATE_COUNT; s++) {
        for (int e = 0; e < IDEM__KL_EVENT_COUNT; e++) {
            size_t found = 0;
            for (size_t i = 0; i < n; i++) {
                found += rows[i].event == (idem__kl_event)e && (rows[i].states & IDEM__KL_S(s));
            }
            cr_expect_eq(found, 1, "state \"%s\" x event \"%s\": %zu rows", idem__kl_state_name(s),
                         idem__kl_event_name(e), found);
        }
    }
}

Test(key_life, every_row_is_well_formed_and_names_its_test)
{
    size_t n;
    const idem__key_life_row *rows = idem__key_life_rows(&n);
    for (size_t i = 0; i < n; i++) {
        const idem__key_life_row *r = &rows[i];
        cr_expect(r->states != 0 && (r->states & ~ALL_STATES) == 0, "row %zu: states", i);
        cr_expect((unsigned)r->event < IDEM__KL_EVENT_COUNT, "row %zu: event", i);
        cr_expect((unsigned)r->action < IDEM__KL_ACTION_COUNT, "row %zu: action", i);
        cr_expect(r->code == IDEM__KL_NO_CODE || (r->code >= 0 && r->code < IDEM_CODE_COUNT),
                  "row %zu: code", i);
        cr_expect(r->answer != NULL && r->answer[0] != '\0' && strchr(r->answer, '|') == NULL,
                  "row %zu: answer", i);
        cr_expect(r->test != NULL && strchr(r->test, '/') != NULL, "row %zu: test", i);
    }
}

Test(key_life, the_decider_answers_each_pairs_row)
{
    for (int s = 0; s < IDEM__KL_STATE_COUNT; s++) {
        for (int e = 0; e < IDEM__KL_EVENT_COUNT; e++) {
            const idem__key_life_row *r = idem__key_life_decide(s, e);
            cr_assert_not_null(r);
            cr_expect(r->event == (idem__kl_event)e && (r->states & IDEM__KL_S(s)));
        }
    }
    cr_expect_eq(idem__key_life_decide(IDEM__KL_STATE_COUNT, IDEM__KL_CLAIM_SAME)->action,
                 IDEM__KL_NEVER);
    cr_expect_eq(idem__key_life_decide(IDEM__KL_NONE, IDEM__KL_EVENT_COUNT)->action,
                 IDEM__KL_NEVER);
}

/* result_cache.c answers a claim the store refused as another request's (MISMATCH)
 * without knowing the record's state: every state that holds a record must agree. */
Test(key_life, another_requests_claim_on_any_held_record_is_key_reused)
{
    const idem__kl_state held[] = {IDEM__KL_LIVE, IDEM__KL_STEPS, IDEM__KL_LAPSED,
                                   IDEM__KL_COMPLETED, IDEM__KL_TOMBSTONE};
    for (size_t i = 0; i < sizeof(held) / sizeof(held[0]); i++) {
        cr_expect_eq(idem__key_life_decide(held[i], IDEM__KL_CLAIM_OTHER)->action,
                     IDEM__KL_REFUSE_REUSED, "%s", idem__kl_state_name(held[i]));
    }
}

/* Only a claim's owner hears a handler's outcome; nothing else runs one. */
Test(key_life, only_an_owned_key_hears_a_handlers_outcome)
{
    const uint32_t owned =
        IDEM__KL_S(IDEM__KL_LIVE) | IDEM__KL_S(IDEM__KL_STEPS) | IDEM__KL_S(IDEM__KL_COMPENSATING);
    for (int s = 0; s < IDEM__KL_STATE_COUNT; s++) {
        for (int e = IDEM__KL_RAN_OK; e <= IDEM__KL_CLAIM_LOST; e++) {
            bool never = idem__key_life_decide(s, e)->action == IDEM__KL_NEVER;
            cr_expect_eq(never, !(owned & IDEM__KL_S(s)), "%s x %s", idem__kl_state_name(s),
                         idem__kl_event_name(e));
        }
    }
}

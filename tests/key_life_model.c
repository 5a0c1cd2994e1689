/* The reference model of a key's life (key_life_model.h), written from
 * docs/semantics.md and docs/guide.md ("Sagas"), not from the code it checks. */
#include <string.h>

#include <idemrpc/idemrpc.h>

#include "key_life_model.h"

const char *const klm_event_names[N_EVENTS] = {
    "A ok",           "A fail",        "A transient",    "A undo ok",    "A undo stuck",
    "B ok",           "A crash@claim", "A crash@effect", "A crash@step", "A crash@commit",
    "re-driver pass", "TTL sweep",     "forget"};

static const answer DIED = {.code = -1};

static answer ans(int code)
{
    return (answer){.code = code};
}

/* The undos of a compensating run of s->who: all done (the inventory up) releases the
 * key with its journal and generation (guide.md: the next run is afresh), or left. */
static answer model_undo(mstate *s, mcount *c, bool undo_up, enum point p)
{
    if (!undo_up) {
        s->rec = R_NONE; /* released, the compensation marked: the key stays its own */
        s->jour = J_COMP;
        return ans(IDEM_UNAVAILABLE);
    }
    c->undos++;
    c->held--;
    *s = (mstate){0};
    return p == P_COMMIT ? DIED : (answer){.code = IDEM_FAILED_PRECONDITION, .compensated = true};
}

/* A run of the handler for request x (the claim is x's). */
static answer model_run(mstate *s, mcount *c, uint8_t x, const char *o, bool undo_up, enum point p)
{
    c->runs++;
    if (s->jour == J_NONE || s->jwho != x) { /* another request's journal is abandoned */
        s->jour = J_LISTED, s->jwho = x, s->eff = 0;
    }
    s->rec = R_RUN, s->who = x, s->listed = 1;
    if (p == P_CLAIM) {
        return DIED;
    }
    if (strcmp(o, "transient") == 0) { /* released; never final: a compensation stays */
        s->rec = R_NONE;
        s->listed = s->jour == J_COMP; /* a client's release unlists, its journal kept */
        return ans(IDEM_UNAVAILABLE);
    }
    if (strcmp(o, "fail") == 0) { /* a recorded step this run did not reach stands: */
        *s = (mstate){.rec = R_DONE, .who = x, .cls = C_FAIL}; /* its undo is unknown */
        return p == P_COMMIT ? DIED : ans(IDEM_FAILED_PRECONDITION);
    }
    if (s->jour == J_COMP) { /* the step answers the failure: the undos run */
        return model_undo(s, c, undo_up, p);
    }
    if (s->jour != J_STEP) { /* the step's fn runs (its derived key: one reservation) */
        c->held += !s->eff;
        s->eff = 1;
        if (p == P_EFFECT) {
            return DIED;
        }
        s->jour = J_STEP;
    }
    if (p == P_STEP) {
        return DIED;
    }
    if (strcmp(o, "refuse") == 0) {
        return model_undo(s, c, undo_up, p);
    }
    *s = (mstate){.rec = R_DONE, .who = x, .cls = C_OK};
    return p == P_COMMIT ? DIED : ans(IDEM_OK);
}

static answer model_request(mstate *s, mcount *c, uint8_t x, const char *o, bool undo_up,
                            enum point p)
{
    if (s->rec == R_DONE && s->who == x) {
        int code = s->cls == C_OK ? IDEM_OK : IDEM_FAILED_PRECONDITION;
        return (answer){.code = code, .replayed = true};
    }
    if (s->rec == R_TOMB && s->who == x) {
        return (answer){.code = IDEM_ALREADY_EXISTS, .gone = true};
    }
    if (s->rec != R_NONE && s->who != x) {
        return ans(IDEM_INVALID_ARGUMENT); /* key reused */
    }
    if (s->rec == R_NONE && s->jour == J_COMP && s->jwho != x) {
        return ans(IDEM_ABORTED); /* compensating an earlier request: retry later */
    }
    return model_run(s, c, x, o, undo_up, p);
}

/* The re-driver's pass over the key's listed call (the inventory up). */
static void model_redrive(mstate *s, mcount *c)
{
    if (s->jour == J_NONE || !s->listed) {
        return; /* a client's run released it: left to its retry */
    }
    if (s->rec == R_NONE || (s->rec == R_RUN && s->who == s->jwho)) {
        (void)model_run(s, c, s->jwho, "ok", true, P_NONE); /* its answer goes to the log */
    } else if (s->jour != J_COMP) {
        s->listed = 0; /* the key is another request's: unlisted, kept for its retry */
    }
}

answer klm_event(mstate *s, mcount *c, int e, bool tombstones)
{
    static const char *const outcomes[] = {"ok", "fail", "transient", "refuse", "refuse"};
    static const enum point points[] = {P_CLAIM, P_EFFECT, P_STEP, P_COMMIT};
    if (e <= E_A_UNDO_STUCK) {
        return model_request(s, c, 'A', outcomes[e], e != E_A_UNDO_STUCK, P_NONE);
    }
    if (e == E_B_OK) {
        return model_request(s, c, 'B', "ok", true, P_NONE);
    }
    if (e <= E_CRASH_COMMIT) {
        return model_request(s, c, 'A', "ok", true, points[e - E_CRASH_CLAIM]);
    }
    if (e == E_REDRIVE) {
        model_redrive(s, c);
    } else if (e == E_SWEEP && s->rec != R_TOMB) {
        s->rec = s->rec == R_DONE && tombstones ? R_TOMB : R_NONE;
        s->who = s->rec == R_TOMB ? s->who : 0;
        s->cls = s->rec == R_TOMB ? s->cls : C_NONE;
    } else if (e == E_FORGET) {
        s->rec = R_NONE, s->who = 0, s->cls = C_NONE;
    }
    return ans(IDEM_OK);
}

/* The reference model of a key's life (key_life_model.c) that test_key_life_model.c
 * checks a real server against: one key, requests A and B under it, and the events
 * below. Pure functions of a small state; the counts are compared, not explored. */
#ifndef IDEMRPC_KEY_LIFE_MODEL_H
#define IDEMRPC_KEY_LIFE_MODEL_H

#include <stdbool.h>
#include <stdint.h>

enum event {
    E_A_OK,
    E_A_FAIL,
    E_A_TRANSIENT,
    E_A_UNDO_OK,
    E_A_UNDO_STUCK,
    E_B_OK,
    E_CRASH_CLAIM,
    E_CRASH_EFFECT,
    E_CRASH_STEP,
    E_CRASH_COMMIT,
    E_REDRIVE,
    E_SWEEP,
    E_FORGET,
    N_EVENTS
};
extern const char *const klm_event_names[N_EVENTS];

enum rec { R_NONE, R_RUN, R_DONE, R_TOMB };        /* R_RUN: its owner dead, lapsed */
enum outcome_class { C_NONE, C_OK, C_FAIL };       /* a compensated call is released, not stored */
enum journal { J_NONE, J_LISTED, J_STEP, J_COMP }; /* J_COMP: an undo unfinished */
enum point { P_NONE, P_CLAIM, P_EFFECT, P_STEP, P_COMMIT };

typedef struct mstate {
    uint8_t rec, who, cls;   /* who: 0, 'A' or 'B' */
    uint8_t jour, jwho, eff; /* eff: jwho's reservation is made (recorded or not) */
    uint8_t listed;          /* the re-driver lists jwho's call */
} mstate;

typedef struct mcount {
    int held, undos, runs;
} mcount;

typedef struct answer {
    int code; /* -1: the server died */
    bool replayed, compensated, gone;
} answer;

/* Applies event e to s and c and returns the answer the server must give (requests;
 * IDEM_OK for the other events). tombstones: the store keeps them (LMDB here). */
answer klm_event(mstate *s, mcount *c, int e, bool tombstones);

#endif

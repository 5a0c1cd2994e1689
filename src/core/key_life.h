/* A key's life as one table (docs/semantics.md, "A key's life"): what happens to a key
 * in each state on each event, and what its caller is answered. Everybody who decides
 * about a key asks here (idem__key_life_decide): the claim's answer (result_cache.c),
 * the owner's record after its handler (result_cache_run.c), the journal's generation
 * and compensation (saga.c), whether a step may run (journal.c), the re-driver's verdict
 * (redriver.c, steps_redrive.c).
 * The sweeper and idemctl act as their rows say; the rows name the tests that prove them.
 *
 * Invariant (tests/test_key_life.c): every (state, event) pair is in exactly one row; a
 * pair that cannot happen has a row too, with IDEM__KL_NEVER and the reason. The
 * table's markdown in docs/semantics.md is printed from these rows (tests/key_life_table.c)
 * and checked against them (the key_life_doc test). */
#ifndef IDEMRPC_KEY_LIFE_H
#define IDEMRPC_KEY_LIFE_H

#include <stddef.h>
#include <stdint.h>

#include "idemrpc/status.h"

typedef struct idem_call idem_call;

typedef enum idem__kl_state {
    IDEM__KL_NONE,         /* no record, no journal */
    IDEM__KL_LIVE,         /* IN_PROGRESS, its lease live (no effectful step recorded) */
    IDEM__KL_STEPS,        /* IN_PROGRESS, lease live, an effectful step recorded */
    IDEM__KL_LAPSED,       /* IN_PROGRESS, its lease run out (the owner died or stalled) */
    IDEM__KL_COMPLETED,    /* COMPLETED, within its result TTL */
    IDEM__KL_RELEASED,     /* released, its request's journal kept */
    IDEM__KL_COMPENSATING, /* released or running, compensation marker set, undos unfinished */
    IDEM__KL_COMPENSATED,  /* every undo ran: journal and generation gone */
    IDEM__KL_EXPIRED,      /* COMPLETED past its TTL, or swept, without a tombstone */
    IDEM__KL_TOMBSTONE,    /* swept within the tombstone horizon */
    IDEM__KL_STATE_COUNT
} idem__kl_state;

typedef enum idem__kl_event {
    IDEM__KL_CLAIM_SAME,       /* a claim by the same request (same fingerprint) */
    IDEM__KL_CLAIM_OTHER,      /* a claim by another request under the key */
    IDEM__KL_RAN_OK,           /* the handler answered OK */
    IDEM__KL_RAN_FINAL,        /* ... a final error the method stores */
    IDEM__KL_RAN_REFUSAL,      /* ... INVALID_ARGUMENT the method does not store */
    IDEM__KL_RAN_TRANSIENT,    /* ... a transient code (the method's transient_mask) */
    IDEM__KL_NOT_RUN,          /* the handler did not run: an interceptor or the journal answered */
    IDEM__KL_FENCE_REFUSED,    /* the handler's fence was refused (claim not on disk) */
    IDEM__KL_CLAIM_LOST,       /* the outcome's record found the claim another's */
    IDEM__KL_STEP,             /* a journaled step asks to run and be recorded */
    IDEM__KL_UNDOS_ALL,        /* a compensation ran every undo */
    IDEM__KL_UNDOS_STAND,      /* a compensation ended with an effect standing (no undo) */
    IDEM__KL_UNDOS_UNFINISHED, /* an undo (or the journal) failed transiently */
    IDEM__KL_CRASH,            /* the owner's process is killed */
    IDEM__KL_LEASE_LAPSE,      /* the lease runs out (by the owner's own count) */
    IDEM__KL_REDRIVE,          /* a re-driver pass over the listed call */
    IDEM__KL_REDRIVE_OTHER,    /* ... finding the key's record another request's */
    IDEM__KL_SWEEP,            /* the TTL sweep reaches the key */
    IDEM__KL_FORGET,           /* an operator deletes the key (idemctl delete) */
    IDEM__KL_EVENT_COUNT
} idem__kl_event;

typedef enum idem__kl_action {
    IDEM__KL_RUN,                  /* claim, run the handler; a new generation (the fence) */
    IDEM__KL_RESUME,               /* claim, run again: recorded steps replay, generation kept */
    IDEM__KL_REPLAY,               /* answer the stored result */
    IDEM__KL_WAIT,                 /* wait (parked) for the owner, then look again */
    IDEM__KL_REFUSE_REUSED,        /* refuse: the key is another request's */
    IDEM__KL_REFUSE_COMPENSATING,  /* refuse: an earlier request's compensation holds it */
    IDEM__KL_ANSWER_GONE,          /* answer: done, result expired; never run again */
    IDEM__KL_STORE,                /* store the outcome (a journal deleted in its txn) */
    IDEM__KL_RELEASE,              /* release the claim (token restored) */
    IDEM__KL_RELEASE_KEEP_JOURNAL, /* release; the journal stays, unlisted unless re-driven */
    IDEM__KL_RELEASE_KEEP_LISTED,  /* release; journal and listing stay for a finisher */
    IDEM__KL_RELEASE_FRESH,        /* release; journal and generation go */
    IDEM__KL_COMPENSATE,           /* run the undos, last step first */
    IDEM__KL_ANSWER_WINNER,        /* discard the answer: the winner's result, or ABORTED */
    IDEM__KL_JOURNAL,              /* run the step, record it under the claim */
    IDEM__KL_REFUSE_STEP,          /* the step does not run, nothing written */
    IDEM__KL_KEEP,                 /* nothing written: the state stands, or its clock runs */
    IDEM__KL_RERUN,                /* re-run the stored request (counted) */
    IDEM__KL_FORGET_JOURNAL,       /* delete the completed call's journal and listing */
    IDEM__KL_UNLIST,               /* unlist; the journal waits for its request's retry */
    IDEM__KL_KEEP_LISTED,          /* keep the call listed until the key is free */
    IDEM__KL_EXPIRE,               /* delete the record; a tombstone within its horizon */
    IDEM__KL_DELETE,               /* delete it */
    IDEM__KL_NEVER,                /* cannot happen (the row's answer says why) */
    IDEM__KL_ACTION_COUNT
} idem__kl_action;

#define IDEM__KL_S(s) (1u << (s))
#define IDEM__KL_NO_CODE (-1) /* the answer's code is the handler's, or none is sent */

/* One row: in every state of states (IDEM__KL_S bits), event leads to action, and the
 * caller (where one waits) is answered code with a message of class answer. test: the
 * test that proves it, as docs/semantics.md cites tests. */
typedef struct idem__key_life_row {
    uint32_t states;
    idem__kl_event event;
    idem__kl_action action;
    int code; /* an idem_code, or IDEM__KL_NO_CODE */
    const char *answer;
    const char *test;
} idem__key_life_row;

/* The event a call's run answered code is (RAN_*, NOT_RUN, FENCE_REFUSED). Answers that
 * free the key instead of being stored: transient codes (the method's transient_mask),
 * by default a handler's INVALID_ARGUMENT (a refusal), and any answer given while the
 * handler did not run (an interceptor after result_cache said no, e.g. UNAUTHENTICATED:
 * nothing happened, and a stored refusal would be replayed to the corrected retry). */
idem__kl_event idem__key_life_outcome(const idem_call *call, idem_code code);
/* The row for (state, event); never NULL (an out-of-range pair gets a NEVER row). */
const idem__key_life_row *idem__key_life_decide(idem__kl_state state, idem__kl_event event);
/* The table, in the order docs/semantics.md prints it. */
const idem__key_life_row *idem__key_life_rows(size_t *count);
const char *idem__kl_state_name(idem__kl_state s);
const char *idem__kl_event_name(idem__kl_event e);
const char *idem__kl_action_name(idem__kl_action a);

#endif

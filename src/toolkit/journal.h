/* The step journal of a call (toolkit: steps.c, steps_redrive.c, saga.c), as the layers
 * above the toolkit use it: result_cache (claim, begin, unlist/relist, forget, the
 * saga's end) and the re-driver (the listed calls and its writes). */
#ifndef IDEMRPC_JOURNAL_H
#define IDEMRPC_JOURNAL_H

#include "call.h"
#include "keeper.h"
#include "key_life.h"
#include "store.h"

/* Deletes the call's step journal in t, every run's steps, its listing and the key's
 * generation (steps.c): in the txn that records the call's outcome. */
idem_code idem__call_steps_forget_in(idem_call *call, idem_txn *t);
/* The same for an outcome the lease keeper records later, after the call has ended: *with
 * completes the record and deletes the journal in one txn (with->arg malloc'd, the
 * keeper's once handed to it). */
idem_code idem__call_steps_record_with(idem_call *call, idem__record_with *with);

/* A call listed for the re-driver (steps.c): it recorded a step on a server that runs
 * one, and has not been released nor recorded its outcome since. */
typedef struct idem__journaled_call {
    uint8_t base[32]; /* its journal */
    struct {
        char caller[IDEM_MAX_CALLER + 1], method[IDEM_MAX_METHOD + 1], key[IDEM_MAX_KEY + 1];
    } key_ref;                                 /* its record */
    bool caller_verified;                      /* how its first run knew the caller */
    unsigned runs;                             /* re-runs so far (max + 1: given up) */
    uint8_t fingerprint[IDEM_FINGERPRINT_LEN]; /* the request's */
    void *request;                             /* the packed idem.v1.Request */
    size_t request_len;
} idem__journaled_call;
#define IDEM__JOURNAL_CURSOR 33
/* The next listed call after cursor (all zero: the first), advancing it;
 * IDEM_NOT_FOUND at the end of a round (cursor reset), IDEM_DATA_LOSS for an entry
 * that cannot be read (cursor past it; the listing is dropped, the journal kept),
 * IDEM_UNIMPLEMENTED for a newer version's (cursor past it, left alone). */
idem_code idem__steps_next_call(idem_store *st, uint8_t cursor[IDEM__JOURNAL_CURSOR],
                                idem__journaled_call *out);
void idem__journaled_call_clear(idem__journaled_call *c);
/* Whether a request (its record key and fingerprint) has a step journal: a head, listed
 * or not (the fault campaign's checker). */
idem_code idem__steps_journal_exists(idem_store *st, const idem_key_ref *key,
                                     const uint8_t fingerprint[IDEM_FINGERPRINT_LEN], bool *exists);

/* What a re-driver write found, deciding in its own txn on the record it read there. */
typedef enum idem__redrive_verdict {
    IDEM__REDRIVE_SKIP,       /* the record is not (or no longer) what the write needs */
    IDEM__REDRIVE_DONE,       /* written */
    IDEM__REDRIVE_GO,         /* count_run: counted, run it */
    IDEM__REDRIVE_GAVE_UP,    /* count_run: it has had its re-runs; noted, say so once */
    IDEM__REDRIVE_COMPENSATE, /* ... and its compensation started: run it to finish that */
    /* count_run: another re-driver counted this death and its run has not claimed yet:
     * run it too, uncounted (the claim lets one run in; this one takes nothing back) */
    IDEM__REDRIVE_GO_UNCOUNTED,
} idem__redrive_verdict;
/* Re-runs of one call in all: redrive_max_runs, then as many to finish a compensation
 * whose run died (the count is one byte of the listing). */
#define IDEM__REDRIVE_LIMIT(max_runs) ((max_runs)*2 + 1 < 255 ? (max_runs)*2 + 1 : 255)
/* The record is this request's and COMPLETED: delete the whole journal. */
idem_code idem__steps_forget_completed(idem_store *st, const idem__journaled_call *jc,
                                       idem__redrive_verdict *verdict);
/* Another request's record under the key: delete the listing only (the journal stays
 * for this request's retry); not once its compensation started (SKIP): the call stays
 * listed until a re-run finishes it. */
idem_code idem__steps_unlist(idem_store *st, const idem__journaled_call *jc,
                             idem__redrive_verdict *verdict);
/* This request's IN_PROGRESS record with its lease run out, or no record (a re-run
 * released it): count a re-run, unless it had max_runs. refund: take one back (a re-run
 * that never reached the handler: a full store, a live owner). */
idem_code idem__steps_count_run(idem_store *st, const idem__journaled_call *jc, unsigned max_runs,
                                bool refund, idem__redrive_verdict *verdict);
/* Takes back the count of a re-run that claimed and then, while its process lived, lost
 * its claim (or its own lease) within its max run time, or left its compensation
 * unfinished: it did not die, so it is not one of max_runs. Not when another re-driver
 * counted since, nor the count of the run that gave up (the give-up is said once). */
idem_code idem__steps_uncount_run(idem_store *st, const idem__journaled_call *jc, unsigned max_runs,
                                  idem__redrive_verdict *verdict);
/* Before its owner releases it: unlists the call (steps.c), keeping its journal; while
 * the claim is live, so that no re-driver can take the release for its own re-run's. */
idem_code idem__call_steps_unlist(idem_call *call);
/* The release that followed idem__call_steps_unlist failed (the call stays IN_PROGRESS
 * until its lease ends): lists it again, so that a re-driver can finish it. */
idem_code idem__call_steps_relist(idem_call *call);

/* The claim of an IDEM_METHOD_STEPS call on a server with a re-driver (steps_redrive.c),
 * in a store txn of its own: the call is listed in the same commit when the claim
 * acquires or takes over. IDEM_UNIMPLEMENTED when the store cannot claim in a txn. */
idem_code idem__call_steps_claim(idem_call *call, idem_store *st, const idem_claim_req *req,
                                 idem_claim_outcome *outcome, idem_record *rec);
/* Before the handler of a journaled call runs under its claim: reads the key's
 * generation (call->step_gen, for derived keys). A failed read runs nothing, nor does
 * another request under a key whose last request's compensation is unfinished
 * (IDEM_ABORTED, idem_errmsg says so): the key stays that request's until it is. */
idem_code idem__call_steps_begin(idem_call *call);

/* Keeps a generation the run drew (call->step_gen_pin) under its claim, before a key
 * derived from it leaves (idem_call_derive_key); IDEM_OK at once when there is none to
 * keep. A failure (the claim lost: ABORTED; a store outage) derives nothing. */
idem_code idem__call_steps_pin(idem_call *call);

/* How a journaled call ends after its handler returned code, outcome ev (saga.c): what
 * the key's life table says for its journal's state, the undos of its steps run on a
 * final failure (the call's answer may change: a compensation in progress answers its
 * recorded failure). Returns the action left to the caller: STORE; RELEASE or
 * RELEASE_KEEP_JOURNAL (the journal as it is); RELEASE_FRESH (journal and generation
 * gone); RELEASE_KEEP_LISTED (a compensation to finish later). */
idem__kl_action idem__call_saga_end(idem_call *call, idem_code *code, idem__kl_event ev);

#endif

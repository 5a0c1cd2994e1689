/* The step journal shared by steps.c (steps, listing, claim) and saga.c (undos). */
#ifndef IDEMRPC_STEPS_INTERNAL_H
#define IDEMRPC_STEPS_INTERNAL_H

#include "call.h"
#include "journal.h"
#include "store.h"

#include "idemrpc/downstream.h"

#define IDEM__STEPS_DB "idem.steps"
#define IDEM__JKEY 33                      /* a prefix byte and a SHA-256 */
#define GEN_LEN (8 + IDEM_FINGERPRINT_LEN) /* 'g': be64 generation ‖ the fingerprint */

/* The keys of a call's journal entries (steps.c's header says what each holds). */
typedef struct idem__journal {
    uint8_t head_key[IDEM__JKEY], step_key[IDEM__JKEY], call_key[IDEM__JKEY];
    uint8_t saga_key[IDEM__JKEY]; /* 'c': the failure a compensation answers */
    uint8_t gen_key[IDEM__JKEY];  /* 'g': the key's generation (no fingerprint in it) */
} idem__journal;

/* The 'r' listing of a call: 'R' 1 flags re-runs ‖ fingerprint ‖ be16-prefixed caller,
 * method, key ‖ the packed request. */
#define CALL_MAGIC 'R'
#define CALL_VERSION 1
#define CALL_VERIFIED 1u /* flags: the caller was verified, not only declared */
/* flags: a re-driver counted a re-run of the record's present holder (its death, or its
 * absence) and no run has claimed the call since: another re-driver that finds the same
 * death re-runs it without counting it again. The next claim clears it. */
#define CALL_COUNTED 2u
#define CALL_FIXED (4 + IDEM_FINGERPRINT_LEN) /* the entry up to the key's parts */

/* base = SHA-256(len-prefixed caller, method, key, request fingerprint). */
bool idem__journal_base(const char *caller, const char *method, const char *key,
                        const uint8_t fp[IDEM_FINGERPRINT_LEN], uint8_t base[32]);
/* The keys of the journal of base (gen_key unknown: zero). */
void idem__journal_of_base(const uint8_t base[32], idem__journal *j);
/* Whether the journal entry key is in the store, by a read. */
idem_code idem__journal_entry_exists(idem_store *st, const uint8_t key[IDEM__JKEY], bool *exists);

/* Reads an 'r' listing (steps_redrive.c): IDEM_DATA_LOSS for one nobody can read,
 * IDEM_UNIMPLEMENTED for a newer version's; out->request is malloc'd
 * (idem__journaled_call_clear). */
idem_code idem__journal_parse_call(const idem_app_entry *e, idem__journaled_call *out);
/* Writes the call's 'r' listing in t. */
idem_code idem__journal_put_call(idem_txn *t, const idem__journal *j, const idem_call *call);
/* The call's journal keys, and step_key for step (NULL: none). */
idem_code idem__journal_keys(idem_call *call, const char *step, idem__journal *j);
/* The recorded output of j->step_key (IDEM_OK), or IDEM_NOT_FOUND while the claim is
 * still this run's; ABORTED when it is not. */
idem_code idem__journal_look_up(idem_call *call, const idem__journal *j, void **v, size_t *n);
/* Records data under j->step_key (listed in the head), checking the claim in the txn,
 * riding out a store outage. */
idem_code idem__journal_record(idem_call *call, const idem__journal *j, const void *data,
                               size_t len);
/* IDEM_OK when the call's record is IN_PROGRESS under fence in t; else ABORTED, and the
 * call is marked claim_lost. */
idem_code idem__journal_claim_held(idem_txn *t, idem_call *call, uint64_t fence);
/* Deletes the journal of j (head, steps, listing, compensation) in t. */
idem_code idem__journal_forget_txn(idem_txn *t, void *j);
/* Writes the 'c' entry in t: the failure (be32 code ‖ message, at most IDEM_MAX_MESSAGE
 * bytes of it) a compensation answers. saga.c reads it. */
idem_code idem__journal_put_failure(idem_txn *t, const idem__journal *j, idem_code code,
                                    const char *msg);
/* Keeps the run's generation with its fingerprint in t (a record's txn): written when
 * absent or changed (steps.c). */
idem_code idem__journal_keep_generation(idem_txn *t, const idem_call *call, const idem__journal *j);
/* In the claim's txn t: keeps fence as the key's generation unless it is this request's. */
idem_code idem__journal_draw_generation(idem_txn *t, const idem_call *call, const idem__journal *j,
                                        uint64_t fence);
/* The saga's bookkeeping of a step this run completed or replayed (saga.c). */
idem_code idem__saga_add(idem_call *call, const char *step, const idem_step_opts *opts,
                         const idem_step_result *out);
/* IDEM_OK when no compensation has started; else its failure (idem_errmsg: its message):
 * no new step runs. */
idem_code idem__saga_check(idem_call *call, const idem__journal *j);
/* After a recorded step replayed (and was added): IDEM_OK, or, in a call whose
 * compensation has started once this run knows every recorded step, that failure, so
 * no code of the handler's after its last recorded step runs (a run that kept dying
 * there is compensated all the same). */
idem_code idem__saga_replayed(idem_call *call, const idem__journal *j);

#endif

/* result_cache's files: the looking side (result_cache.c: read, claim, wait), the owner's
 * side (result_cache_run.c: run, record, answer a failed record) and the replay both use
 * (result_cache_replay.c). Private to them. */
#ifndef IDEMRPC_RESULT_CACHE_H
#define IDEMRPC_RESULT_CACHE_H

#include "call.h"
#include "builtins.h"
#include "journal.h"
#include "store.h"

#include "inflight.h"

#define IDEM__RC_RETRY_AFTER_MS 100u /* hint given with ABORTED "in progress", UNAVAILABLE */

/* result_cache_replay.c: answers the stored first result rec (its response may move
 * into the call), with metadata idem-first-at, replayed. */
idem_code idem__rc_replay(idem_call *call, idem_record *rec);
/* code, with metadata retry-after-ms (IDEM__RC_RETRY_AFTER_MS). */
idem_code idem__rc_retry_after(idem_call *call, idem_code code);
/* The same, for a response the store lent (borrow: it moves into the call). */
idem_code idem__rc_replay_borrowed(idem_call *call, idem_record *rec, idem_borrow *borrow);
/* Runs the handler as the claim owner and records the outcome. txn is the handler txn
 * the claim was made in (stores with IDEM__STORE_CAP_TXN_CLAIM), else NULL; ticket the
 * claim's shared commit, still open maybe (the completion then joins it), else 0. May
 * suspend the call (IDEM__SUSPEND_RECORD) until its record's commit has ended. */
idem_code idem__rc_run_owned(idem_call *call, idem_next next, const idem_cache_cfg *cfg,
                             const idem_key_ref *key, uint64_t owner, idem_txn *txn,
                             uint64_t ticket);
/* A call that idem__rc_run_owned suspended, resumed once its commit has ended. */
idem_code idem__rc_record_resumed(idem_call *call, const idem_cache_cfg *cfg);

#endif

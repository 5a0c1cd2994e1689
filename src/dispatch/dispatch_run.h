/* dispatch.c's private half in dispatch_run.c: one call through decode, identity and
 * the chain. */
#ifndef IDEMRPC_DISPATCH_RUN_H
#define IDEMRPC_DISPATCH_RUN_H

#include "dispatch.h"

/* The key the call ran under, for the client (idem_result.key), in its metadata. */
void idem__dispatch_answer_key(idem_call *call);
/* idem__dispatch_reject with the runtime only. */
void idem__dispatch_reject_rt(idem_runtime *rt, idem_served *s, const char *reason,
                              idem_code code, const char *message);
/* Decode + identity + chain, with a dispatcher's cfg. false: a fast_only call needs a worker
 * (out->call is kept, suspended with DEFER: idem__dispatch_enqueue resumes it where it
 * stopped, or with RECORD: its claim is queued, fast_claim), or (parkable) the call
 * parked in out->call.suspend; nothing to answer yet. */
bool idem__dispatch_call_run(const idem_dispatch_cfg *cfg, const void *frame, size_t len,
                             const idem_peer *peer, idem_run_opts opts, bool parkable,
                             bool fast_claim, idem_served *out);

#endif

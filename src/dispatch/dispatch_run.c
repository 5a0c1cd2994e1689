/* One call's way through decode, identity and the chain, on whichever thread runs it
 * (dispatch.h: an nng callback's fast path, or a worker's job_step in dispatch.c). */
#include <stdio.h>

#include "dispatch_run.h"

/* The key the call ran under, for the client (idem_result.key): a business key may
 * have replaced the one it sent. A token is not echoed. */
void idem__dispatch_answer_key(idem_call *call)
{
    const char *key = idem__call_answer_key(call);
    if (key != NULL && call->replay_wire == NULL) { /* a stored-bytes replay: the front adds it */
        idem__call_set_meta(call, "idem-key", key);
    }
}

void idem__dispatch_reject_rt(idem_runtime *rt, idem_served *s, const char *reason,
                              idem_code code, const char *message)
{
    static const Idem__V1__Request empty = IDEM__V1__REQUEST__INIT;
    s->start_us = idem__mono_us();
    s->req = NULL;
    idem__call_init(&s->call, &empty, NULL, rt);
    idem__reject(&s->call, reason, code, "%s", message);
    idem__random_hex(s->call.request_id, 16);
}

bool idem__dispatch_call_run(const idem_dispatch_cfg *cfg, const void *frame, size_t len,
                             const idem_peer *peer, idem_run_opts opts, bool parkable,
                             bool fast_claim, idem_served *out)
{
    idem_runtime *rt = cfg->rt;
    uint64_t start = idem__mono_us();
    idem_code code;

    out->req = NULL;
    if (len > cfg->max_frame && !opts.frame_built) {
        code = idem__err(IDEM_RESOURCE_EXHAUSTED, "frame of %zu bytes exceeds the %zu byte limit",
                         len, cfg->max_frame);
    } else {
        idem__arena_init(&out->arena);
        code = idem__decode_request_arena(frame, len, opts.frame_writable, &out->arena, &out->req);
    }
    if (code != IDEM_OK) {
        idem__dispatch_reject_rt(
            rt, out, code == IDEM_RESOURCE_EXHAUSTED ? IDEM_REASON_TOO_LARGE : IDEM_REASON_BAD_FRAME,
            code, idem_errmsg());
        return true;
    }
    out->start_us = start;
    idem__call_init(&out->call, out->req, cfg->find_method(cfg->find_arg, out->req->method),
                    rt);
    out->call.fast_only = opts.fast_only;
    out->call.fast_claim = fast_claim;
    out->call.parkable = parkable;
    out->call.wire_reply = opts.wire_reply;
    if (peer != NULL && peer->redriven) { /* its client's deadline has passed: a new one */
        uint32_t a = out->req->attempt;
        out->req->deadline_unix_ms = peer->redriven_deadline_ms;
        out->req->call_deadline_unix_ms = peer->redriven_deadline_ms;
        out->req->attempt = a < 2 ? 2 : a == UINT32_MAX ? a : a + 1; /* a retry, not a submit */
        out->call.pinned_key = peer->redriven_key;
    }
    uint64_t deadline = out->req->deadline_unix_ms;
    /* Who is calling, before anything reads the caller: a refusal runs and claims nothing. */
    bool identified = idem__identity_resolve(cfg->identity, peer, &out->call) == IDEM_OK;
    if (identified && deadline != 0 && deadline <= idem__rt_now_ms(rt)) {
        /* Nobody waits for the answer any more: run nothing, claim nothing. */
        idem__reject(&out->call, IDEM_REASON_DEADLINE, IDEM_DEADLINE_EXCEEDED,
                     "deadline passed before the call started (deadline_unix_ms %llu)",
                     (unsigned long long)deadline);
    } else if (identified) {
        idem_call_next(&out->call, (idem_next){cfg->chain, 0});
        if (out->call.suspend != IDEM__SUSPEND_NONE) {
            return false;
        }
    }
    if (out->call.request_id[0] == '\0') { /* refused before request_id ran, or no request_id */
        idem__random_hex(out->call.request_id, 16);
    }
    idem__dispatch_answer_key(&out->call);
    return true;
}

/* idem_call_downstream (downstream.h): a call to another service as a step of the
 * current one, with a derived key, the upstream's deadline, request id and trace. */
#include <stdio.h>
#include <string.h>

#include "call.h"
#include "client_internal.h"
#include "journal.h"

#include "idemrpc/downstream.h"

idem_code idem_call_derive_key(const idem_call *call, const char *step,
                               char out[IDEM_DERIVED_KEY_LEN + 1])
{
    out[0] = '\0';
    if (!idem__step_name_ok(step)) {
        return idem__err(IDEM_INVALID_ARGUMENT, "step name must be 1..%d bytes of [A-Za-z0-9._-]",
                         IDEM_MAX_STEP);
    }
    if (call->key_source == IDEM_KEY_NONE || call->key[0] == '\0') {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "the call has no idempotency key to derive a downstream key from "
                         "(make %s KEY_REQUIRED)",
                         call->req->method);
    }
    /* The run's generation is in the store before a key derived from it leaves. The call
     * is the handler's own (only this flag changes): the signature stays const. */
    idem_code code = idem__call_steps_pin((idem_call *)call);
    if (code != IDEM_OK) {
        return code;
    }
    /* An undo's key is its own; a generation past 0 makes every key of the run new.
     * After the four parts come, each optional, "undo" (its prefix is be32 4) and the
     * generation: its be64 while below 2^32 (so it starts with be32 0), else be32 8 and
     * its be64. The four bytes after the parts, and after "undo", say which follows,
     * so no two inputs run together; below 2^32 the keys are those of every earlier
     * release (a call retried across an upgrade derives the keys its first run sent). */
    const char *parts[5] = {idem_call_caller(call), call->req->method, call->key, step, "undo"};
    uint8_t d[32], gen[12];
    size_t gen_len = call->step_gen > UINT32_MAX ? 4 : 0;
    idem__put_be32(gen, 8);
    idem__put_be64(gen + gen_len, call->step_gen);
    gen_len += call->step_gen != 0 ? 8 : 0;
    if (!idem__lp_sha256(parts, call->undoing != NULL ? 5 : 4, gen, gen_len, d)) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    out[0] = 'd';
    out[1] = '-';
    idem__hex(out + 2, d, sizeof(d));
    return IDEM_OK;
}

/* The upstream's whole-call deadline left for the hop (not its attempt's: an attempt that
 * times out is retried and waits for this run), minus the margin; *ms = 0 when none. */
static idem_code hop_deadline(const idem_call *call, uint32_t *ms)
{
    uint64_t deadline = idem_call_overall_deadline_ms(call), now = idem__rt_now_ms(call->rt);
    *ms = 0;
    if (deadline == 0) {
        return IDEM_OK;
    }
    uint64_t left = deadline > now ? deadline - now : 0;
    uint64_t margin = left / 10 < IDEM_HOP_MARGIN_MS ? left / 10 : IDEM_HOP_MARGIN_MS;
    if (left <= margin + 1) {
        return idem__err(IDEM_DEADLINE_EXCEEDED,
                         "the upstream deadline leaves no time for the downstream call");
    }
    *ms = left - margin > UINT32_MAX ? UINT32_MAX : (uint32_t)(left - margin);
    return IDEM_OK;
}

idem_code idem_call_downstream(idem_call *call, idem_client *client, const char *step,
                               const idem_request *req, idem_result *out)
{
    static const char *const trace[] = {"traceparent", "tracestate"};
    char key[IDEM_DERIVED_KEY_LEN + 1];
    idem_metadata_kv meta[IDEM_MAX_METADATA];
    uint32_t left;
    idem_code code;
    memset(out, 0, sizeof(*out));
    if (call == NULL || client == NULL || req == NULL) {
        code = idem__err(IDEM_INVALID_ARGUMENT, "downstream call needs a call, a client and a "
                                                "request");
    } else if (req->idempotency_key != NULL ||
               idem__client_request_meta(req, "idempotency-key") != NULL || req->caller != NULL) {
        code = idem__err(IDEM_INVALID_ARGUMENT,
                         "a downstream call's key is derived and its caller is this service: "
                         "leave idempotency_key (and metadata idempotency-key) and caller unset");
    } else if (req->metadata_count > IDEM_MAX_METADATA - 2) {
        code = idem__err(IDEM_INVALID_ARGUMENT, "too many metadata entries (%zu, max %d)",
                         req->metadata_count, IDEM_MAX_METADATA - 2);
    } else if ((code = idem_call_derive_key(call, step, key)) == IDEM_OK) {
        code = hop_deadline(call, &left);
    }
    if (code != IDEM_OK) {
        out->code = code;
        return code;
    }
    idem_request hop = *req;
    hop.idempotency_key = key;
    uint32_t own = hop.deadline_ms ? hop.deadline_ms : idem__client_deadline_ms(client);
    hop.deadline_ms = left != 0 && left < own ? left : own;
    if (hop.request_id == NULL && call->request_id[0] != '\0') {
        hop.request_id = call->request_id;
    }
    size_t n = req->metadata_count;
    if (n > 0) {
        memcpy(meta, req->metadata, n * sizeof(*meta));
    }
    for (size_t i = 0; i < 2; i++) {
        const char *v = idem_call_metadata(call, trace[i]);
        if (v != NULL && idem__client_request_meta(req, trace[i]) == NULL) {
            meta[n++] = (idem_metadata_kv){trace[i], v};
        }
    }
    hop.metadata = n > 0 ? meta : NULL;
    hop.metadata_count = n;
    code = idem_client_call(client, &hop, out);
    if (code != IDEM_OK && out->message != NULL && out->message[0] != '\0') {
        idem__err(code, "%s: %s", req->method, out->message); /* the downstream's own words */
    }
    return code;
}

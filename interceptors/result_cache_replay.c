/* result_cache's answer from a stored first result (result_cache.h): used by the
 * looking side (a completed record) and the owner's side (a claim lost to a winner that
 * completed). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "result_cache.h"

/* code, with metadata retry-after-ms: when a retry with the same key may find it done. */
idem_code idem__rc_retry_after(idem_call *call, idem_code code)
{
    char hint[16];
    snprintf(hint, sizeof(hint), "%u", IDEM__RC_RETRY_AFTER_MS);
    idem__call_set_meta(call, "retry-after-ms", hint);
    return code;
}

/* The first result, with metadata idem-first-at. Kept as the stored bytes (rec's buffer
 * moves into the call) when the front sends wire replies, nothing before result_cache
 * can look at the response (every interceptor there is a built-in that tail-calls) and
 * the bytes are canonical: the nng front then sends them with the per-call fields
 * appended, as the decode + re-encode below would have written them. A response the
 * store lent (borrow, may be NULL) moves into the call with its borrow. */
idem_code idem__rc_replay_borrowed(idem_call *call, idem_record *rec, idem_borrow *borrow)
{
    char first_at[24];
    snprintf(first_at, sizeof(first_at), "%" PRIu64, rec->first_at_ms);
    if (call->wire_reply && call->rt->can_park && rec->response != NULL &&
        idem__replay_wire_ok(rec->response, rec->response_len)) {
        const uint8_t *w = rec->response;
        idem__call_reset_response(call);
        call->code = rec->response_len > 0 && w[0] == 0x08 ? (idem_code)w[1] : IDEM_OK;
        call->replay_wire = rec->response;
        call->replay_wire_len = rec->response_len;
        if (borrow != NULL) {
            call->replay_borrow = *borrow;
            borrow->end = NULL;
        }
        rec->response = NULL;
        rec->response_len = 0;
        memcpy(call->replay_first_at, first_at, sizeof(first_at));
        call->replayed = true;
        return call->code;
    }
    idem_code code = idem__load_call_response(call, rec->response, rec->response_len);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "replay: %s", idem_errmsg());
    }
    idem__call_set_meta(call, "idem-first-at", first_at);
    call->replayed = true;
    return call->code;
}

idem_code idem__rc_replay(idem_call *call, idem_record *rec)
{
    return idem__rc_replay_borrowed(call, rec, NULL);
}

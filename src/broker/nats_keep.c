/* What the relay asks the broker about the messages it keeps (nats_relay.c): how the
 * broker syncs, and whether it lost what it acked. JetStream acks a publish once the
 * message is in its file store's buffers; the file store syncs them every sync_interval
 * (2 minutes by default) unless sync_always, so a host crash loses the tail acked since. */
#include <stdlib.h>
#include <string.h>

#include "nats_internal.h"

#define VARZ_SUBJECT "$SYS.REQ.SERVER.PING.VARZ"

idem_code idem__nats_sync_probe(natsConnection *nc, unsigned wait_ms, bool *always,
                                uint64_t *interval_ms)
{
    natsMsg *reply = NULL;
    *always = false;
    *interval_ms = 0;
    natsStatus s = natsConnection_RequestString(&reply, nc, VARZ_SUBJECT, "", wait_ms);
    if (s != NATS_OK) {
        return idem__err(IDEM_NOT_FOUND, "nats: %s: %s", VARZ_SUBJECT, natsStatus_GetText(s));
    }
    /* Go's encoding/json, no spaces: "sync_interval" in nanoseconds (nats-server 2.10+). */
    const char *data = natsMsg_GetData(reply), *p;
    idem_code code = IDEM_OK;
    if (data != NULL && strstr(data, "\"sync_always\":true") != NULL) {
        *always = true;
    } else if (data != NULL && (p = strstr(data, "\"sync_interval\":")) != NULL) {
        *interval_ms = strtoull(p + strlen("\"sync_interval\":"), NULL, 10) / 1000000;
    } else {
        code = idem__err(IDEM_NOT_FOUND, "nats: the broker reports no sync setting");
    }
    natsMsg_Destroy(reply);
    return code;
}

/* The stream's last sequence. */
static idem_code last_seq(jsCtx *js, const char *stream, uint64_t *last, bool *gone)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    natsStatus s = js_GetStreamInfo(&si, js, stream, NULL, &jerr);
    *gone = jerr == JSStreamNotFoundErr;
    if (s != NATS_OK) {
        return *gone ? IDEM_OK : idem__nats_code(s, jerr, "nats relay: stream info");
    }
    *last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    return IDEM_OK;
}

idem_code idem__nats_lost(jsCtx *js, const idem_outbox_kept_info *k, bool *lost)
{
    natsMsg *m = NULL;
    jsErrCode jerr = 0;
    const char *id = NULL;
    uint64_t last = 0;
    *lost = false;
    if (k->count == 0) {
        return IDEM_OK;
    }
    natsStatus s = js_GetMsg(&m, js, k->newest.stream, k->newest.stream_seq, NULL, &jerr);
    if (s == NATS_OK) {
        s = natsMsgHeader_Get(m, IDEM_NATS_MSG_ID_HEADER, &id);
        *lost = s != NATS_OK || strcmp(id, k->newest_msg_id) != 0;
        natsMsg_Destroy(m);
        return IDEM_OK;
    }
    if (jerr == JSStreamNotFoundErr) {
        *lost = true;
        return IDEM_OK;
    }
    if (jerr != JSNoMessageFoundErr) {
        return idem__nats_code(s, jerr, "nats relay: get the newest kept message");
    }
    idem_code code = last_seq(js, k->newest.stream, &last, lost);
    if (code == IDEM_OK && last < k->newest.stream_seq) {
        *lost = true; /* the stream went back: not removed by retention, forgotten */
    }
    return code;
}

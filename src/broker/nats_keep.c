/* What the relay asks the broker about the messages it keeps (nats_relay.c): how the
 * broker syncs, and whether it lost what it acked. JetStream acks a publish once the
 * message is in its file store's buffers; the file store syncs them every sync_interval
 * (2 minutes by default) unless sync_always, so a host crash loses the tail acked since.
 * The relay checks the newest kept message of every stream it kept messages from. */
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

/* Whether the broker lost message msg_id, acked at a. */
static idem_code lost_one(jsCtx *js, const idem_outbox_ack *a, const char *msg_id, bool *lost)
{
    natsMsg *m = NULL;
    jsErrCode jerr = 0;
    const char *id = NULL;
    uint64_t last = 0;
    *lost = false;
    natsStatus s = js_GetMsg(&m, js, a->stream, a->stream_seq, NULL, &jerr);
    if (s == NATS_OK) {
        s = natsMsgHeader_Get(m, IDEM_NATS_MSG_ID_HEADER, &id);
        *lost = s != NATS_OK || strcmp(id, msg_id) != 0;
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
    idem_code code = last_seq(js, a->stream, &last, lost);
    if (code == IDEM_OK && last < a->stream_seq) {
        *lost = true; /* the stream went back: not removed by retention, forgotten */
    }
    return code;
}

/* Checks message msg_id acked at a; notes a as its stream's newest when it held. */
static idem_code check_one(jsCtx *js, const idem_outbox_ack *a, const char *msg_id,
                           idem__nats_newest *nw, bool *lost)
{
    bool gone = false;
    idem_code code = lost_one(js, a, msg_id, &gone);
    if (code == IDEM_OK && gone) {
        *lost = true;
    } else if (code == IDEM_OK) {
        (void)idem__nats_went_back(nw, a);
    }
    return code;
}

idem_code idem__nats_check_kept(jsCtx *js, idem_store *st, idem__nats_newest *nw, bool *lost,
                                bool *unsure)
{
    idem_outbox_kept_info k;
    idem__kept_dir *d = malloc(sizeof(*d));
    *lost = *unsure = false;
    nw->n = 0;
    if (d == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "nats relay: out of memory");
    }
    idem_code code = idem_outbox_kept(st, &k);
    if (code == IDEM_OK && k.count > 0) { /* nothing kept: nothing the broker may lose */
        code = idem__kept_dir_read(st, d);
    } else {
        d->n = 0;
    }
    if (code == IDEM_OK && k.count > 0 && (d->overflow || !d->present)) {
        *lost = *unsure = true; /* some kept message is in no entry: all go again */
    }
    for (size_t j = 0; code == IDEM_OK && !*lost && j < d->n; j++) {
        code = check_one(js, &d->s[j].ack, d->s[j].msg_id, nw, lost);
    }
    if (code == IDEM_OK && !*lost && k.count > 0) { /* the entry of its stream, as a rule */
        code = check_one(js, &k.newest, k.newest_msg_id, nw, lost);
    }
    free(d);
    if (*lost) {
        nw->n = 0;
    }
    return code;
}

/* Room for one more stream in nw: grown (doubling), or at the bound, the stream acked
 * longest ago gives way. */
static void room(idem__nats_newest *nw)
{
    size_t cap = nw->cap == 0 ? 8 : 2 * nw->cap;
    idem_outbox_ack *s = NULL;
    if (nw->n < nw->cap) {
        return;
    }
    if (cap <= IDEM__NATS_STREAMS_MAX && (s = realloc(nw->s, cap * sizeof(*s))) != NULL) {
        nw->s = s;
        nw->cap = cap;
        return;
    }
    if (nw->n == 0) {
        return; /* no memory even for the first: nothing to give way */
    }
    memmove(&nw->s[0], &nw->s[1], (nw->n - 1) * sizeof(nw->s[0]));
    nw->n--;
}

bool idem__nats_went_back(idem__nats_newest *nw, const idem_outbox_ack *a)
{
    size_t j = 0;
    while (j < nw->n && strcmp(nw->s[j].stream, a->stream) != 0) {
        j++;
    }
    if (j < nw->n && a->stream_seq <= nw->s[j].stream_seq) {
        return true;
    }
    if (j < nw->n) {
        memmove(&nw->s[j], &nw->s[j + 1], (nw->n - j - 1) * sizeof(nw->s[0]));
        nw->n--;
    }
    room(nw);
    if (nw->n < nw->cap) { /* else no memory even for the first: nothing to compare with */
        nw->s[nw->n++] = *a;
    }
    return false;
}

void idem__nats_newest_fini(idem__nats_newest *nw)
{
    free(nw->s);
    memset(nw, 0, sizeof(*nw));
}

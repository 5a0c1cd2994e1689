/* The NATS connection both the consumer and the relay use: reconnecting forever, since a
 * broker restart must not end a consumer; each call that needs the broker is bounded by
 * the JetStream context's wait instead. */
#include <stdarg.h>
#include <stdio.h>

#include <string.h>

#include "nats_internal.h"

#define RECONNECT_WAIT_MS 100
#define CONNECT_TIMEOUT_MS 2000

/* Given to libnats so that a lazy first connect goes on in the background: without a
 * callback it retries on the caller's thread (for ever: reconnects are unlimited). */
static void connected(natsConnection *nc, void *arg)
{
    (void)nc, (void)arg;
}

static idem_code options_make(natsOptions **o, const char *url, bool lazy)
{
    natsStatus s = natsOptions_Create(o);
    if (s == NATS_OK) {
        s = natsOptions_SetURL(*o, url); /* a comma list: libnats splits it */
    }
    if (s == NATS_OK && lazy) { /* a first connect that fails goes on in the background */
        s = natsOptions_SetRetryOnFailedConnect(*o, true, connected, NULL);
    }
    if (s == NATS_OK) {
        s = natsOptions_SetMaxReconnect(*o, -1);
    }
    if (s == NATS_OK) {
        s = natsOptions_SetReconnectWait(*o, RECONNECT_WAIT_MS);
    }
    if (s == NATS_OK) {
        s = natsOptions_SetTimeout(*o, CONNECT_TIMEOUT_MS);
    }
    return s == NATS_OK ? IDEM_OK : idem__nats_code(s, 0, "nats options");
}

static idem_code connect_to(const char *url, unsigned publish_wait_ms, bool lazy,
                            natsConnection **nc, jsCtx **js)
{
    natsOptions *o = NULL;
    jsOptions jo;
    *nc = NULL;
    *js = NULL;
    if (url == NULL || *url == '\0') {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats: a url is required");
    }
    idem_code code = options_make(&o, url, lazy);
    natsStatus s = NATS_OK;
    if (code == IDEM_OK && (s = natsConnection_Connect(nc, o)) != NATS_OK &&
        !(lazy && s == NATS_NOT_YET_CONNECTED)) {
        code = idem__err(IDEM_UNAVAILABLE, "nats: connect to %s: %s", url, natsStatus_GetText(s));
    }
    natsOptions_Destroy(o);
    if (code != IDEM_OK) {
        return code;
    }
    jsOptions_Init(&jo);
    jo.Wait = publish_wait_ms;
    if ((s = natsConnection_JetStream(js, *nc, &jo)) != NATS_OK) {
        idem__nats_disconnect(*nc, NULL);
        *nc = NULL;
        return idem__nats_code(s, 0, "nats: jetstream context");
    }
    return IDEM_OK;
}

idem_code idem__nats_connect(const char *url, unsigned publish_wait_ms, natsConnection **nc,
                             jsCtx **js)
{
    return connect_to(url, publish_wait_ms, false, nc, js);
}

idem_code idem__nats_connect_lazy(const char *url, unsigned publish_wait_ms, natsConnection **nc,
                                  jsCtx **js)
{
    return connect_to(url, publish_wait_ms, true, nc, js);
}

void idem__nats_disconnect(natsConnection *nc, jsCtx *js)
{
    jsCtx_Destroy(js);
    if (nc != NULL) {
        natsConnection_Close(nc);
        natsConnection_Destroy(nc);
    }
}

idem_code idem__nats_code(natsStatus s, jsErrCode jerr, const char *what)
{
    idem_code code = IDEM_INTERNAL;
    switch (s) {
    case NATS_TIMEOUT:
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_NO_SERVER:
    case NATS_NOT_YET_CONNECTED:
    case NATS_NO_RESPONDERS:
    case NATS_IO_ERROR:
    case NATS_STALE_CONNECTION:
        code = IDEM_UNAVAILABLE;
        break;
    case NATS_NOT_FOUND:
        code = IDEM_NOT_FOUND;
        break;
    case NATS_MAX_PAYLOAD:
        code = IDEM_OUT_OF_RANGE;
        break;
    default:
        break;
    }
    if (jerr == JSStreamNotFoundErr || jerr == JSConsumerNotFoundErr) {
        code = IDEM_NOT_FOUND;
    } else if (jerr == JSStreamMessageExceedsMaximumErr) {
        code = IDEM_OUT_OF_RANGE;
    }
    /* libnats's text for this thread's last error, when it is this one's, says what a
     * bare status ("Error") does not: the broker's own words. Its "(js.c:1750): " goes. */
    natsStatus last = NATS_OK;
    const char *text = natsStatus_GetText(s), *detail = nats_GetLastError(&last);
    if (last == s && detail != NULL && detail[0] != '\0') {
        const char *end = detail[0] == '(' ? strstr(detail, "): ") : NULL;
        text = end != NULL ? end + 3 : detail;
    }
    char jbuf[40] = "";
    if (jerr != 0) {
        snprintf(jbuf, sizeof(jbuf), " (jetstream error %d)", (int)jerr);
    }
    return idem__err(code, "%s: %s%s", what, text, jbuf);
}

static const char *conn_status(natsConnection *nc)
{
    switch (nc != NULL ? natsConnection_Status(nc) : NATS_CONN_STATUS_CLOSED) {
    case NATS_CONN_STATUS_CONNECTING:
        return "connecting";
    case NATS_CONN_STATUS_RECONNECTING:
        return "reconnecting: the broker is unreachable";
    case NATS_CONN_STATUS_DISCONNECTED:
        return "disconnected: the broker is unreachable";
    case NATS_CONN_STATUS_CLOSED:
        return "closed";
    default:
        return "draining";
    }
}

idem_code idem__nats_code_on(natsConnection *nc, natsStatus s, jsErrCode jerr, const char *what)
{
    if (nc != NULL && natsConnection_Status(nc) == NATS_CONN_STATUS_CONNECTED) {
        return idem__nats_code(s, jerr, what);
    }
    char buf[128];
    snprintf(buf, sizeof(buf), "%s (broker connection %s)", what, conn_status(nc));
    return idem__nats_code(s, jerr, buf);
}

void idem__nats_log(idem_log_fn fn, void *arg, idem_log_level level, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (fn != NULL) {
        fn(arg, level, line);
    } else {
        fprintf(stderr, "%s\n", line);
    }
}

idem_code idem__nats_publish(jsCtx *js, natsMsg *m, const char *what, bool *duplicate,
                             natsStatus *status, idem_outbox_ack *where)
{
    jsPubAck *ack = NULL;
    jsErrCode jerr = 0;
    natsStatus s = js_PublishMsg(&ack, js, m, NULL, &jerr);
    *duplicate = false;
    if (status != NULL) {
        *status = s;
    }
    if (s != NATS_OK) {
        return idem__nats_code(s, jerr, what);
    }
    *duplicate = ack->Duplicate;
    if (where != NULL) {
        where->stream_seq = ack->Sequence;
        snprintf(where->stream, sizeof(where->stream), "%s",
                 ack->Stream != NULL ? ack->Stream : "");
    }
    jsPubAck_Destroy(ack);
    return IDEM_OK;
}

idem_code idem__nats_stream_of(jsCtx *js, const char *subject, int64_t *max_msg_size)
{
    jsOptions o;
    jsStreamInfoList *list = NULL;
    jsErrCode jerr = 0;
    *max_msg_size = 0;
    jsOptions_Init(&o);
    o.Stream.Info.SubjectsFilter = subject; /* the streams whose subjects take it */
    natsStatus s = js_Streams(&list, js, &o, &jerr);
    if (s == NATS_NOT_FOUND && jerr == 0) { /* an empty answer, not an API error */
        return idem__err(IDEM_NOT_FOUND, "nats: no stream takes subject %s", subject);
    }
    if (s != NATS_OK) {
        return idem__err(IDEM_UNAVAILABLE, "nats: stream lookup for %s: %s (jetstream error %d)",
                         subject, natsStatus_GetText(s), (int)jerr);
    }
    for (int i = 0; i < list->Count; i++) { /* one, as streams may not overlap */
        const jsStreamConfig *sc = list->List[i]->Config;
        if (sc != NULL && sc->MaxMsgSize > 0 &&
            (*max_msg_size <= 0 || sc->MaxMsgSize < *max_msg_size)) {
            *max_msg_size = sc->MaxMsgSize;
        }
    }
    jsStreamInfoList_Destroy(list);
    return IDEM_OK;
}

/* libnats before 3.9 (Debian's 3.4.1), _fetch in js.c: it first takes the messages already
 * queued in the subscription (late answers to an earlier pull request: after a broker
 * restart, many), then lowers its batch by that count and loops until the count equals
 * the lowered batch. With more than half a batch queued the two never meet, and every
 * further message is written past its array of batch slots (the campaign's consumer died
 * of a corrupted heap right after broker restarts, seeds 53025 and 61777; fixed in
 * nats.c 3.9, #749). A fetch of 1 cannot overflow (it takes one queued message, or asks
 * for one), so while anything is queued this fetches 1; only an empty queue gets the
 * whole batch. Messages that arrive between the look and the fetch's own are the rest
 * of the race: to overflow, more than half a batch would have to land in that window. */
natsStatus idem__nats_fetch(natsMsgList *list, natsSubscription *sub, int batch, int64_t wait_ms,
                            jsErrCode *jerr)
{
    int queued = 0;
    if (batch > 2 && nats_GetVersionNumber() < 0x030900 &&
        (natsSubscription_GetPending(sub, &queued, NULL) != NATS_OK || queued > 0)) {
        batch = 1;
    }
    return natsSubscription_Fetch(list, sub, batch, wait_ms, jerr);
}

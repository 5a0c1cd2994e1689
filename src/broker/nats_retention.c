/* How long a stream keeps its messages, and so how long a consumer's markers must stay.
 *
 * A message published at p is deleted by the broker at p + max_age at the latest; its
 * consumption, at c, came after p. So no copy of it can be delivered after c + max_age,
 * except one that was already fetched (handled later) or published again later (an
 * outbox relay that was down between an ack and its removal, or a kept message restored
 * after the broker lost it): horizon covers those. A marker consumed before
 * now - (max_age + horizon) is therefore needed by no delivery. A stream without max_age
 * may deliver a message at any time (its limits by count or size say nothing about
 * when): no marker is ever safe to purge. */
#include <string.h>

#include "nats_internal.h"

#define API_WAIT_MS 5000
#define NS_PER_MS 1000000ll

void idem_nats_stream_opts_init(idem_nats_stream_opts *o)
{
    memset(o, 0, sizeof(*o));
}

static idem_code stream_opts_check(const idem_nats_stream_opts *o)
{
    const uint64_t most = (uint64_t)INT64_MAX / NS_PER_MS;
    if (o->retention != IDEM_NATS_RETAIN_LIMITS && o->retention != IDEM_NATS_RETAIN_WORK_QUEUE) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats stream: retention %d out of range",
                         (int)o->retention);
    }
    if (o->max_age_ms > most || o->duplicate_window_ms > most || o->max_msgs > INT64_MAX ||
        o->max_bytes > INT64_MAX) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats stream: a limit over the broker's range");
    }
    if (o->max_age_ms != 0 && o->duplicate_window_ms > o->max_age_ms) {
        return idem__err(
            IDEM_INVALID_ARGUMENT, "nats stream: duplicate_window_ms %llu over max_age_ms %llu",
            (unsigned long long)o->duplicate_window_ms, (unsigned long long)o->max_age_ms);
    }
    return IDEM_OK;
}

/* Writes o's limits into sc; true when that changed any (0: none, or the broker's; a
 * window longer than max_age is cut to it). */
static bool limits_apply(jsStreamConfig *sc, const idem_nats_stream_opts *o)
{
    int64_t age = (int64_t)o->max_age_ms * NS_PER_MS;
    int64_t msgs = o->max_msgs != 0 ? (int64_t)o->max_msgs : -1;
    int64_t bytes = o->max_bytes != 0 ? (int64_t)o->max_bytes : -1;
    int64_t window = (int64_t)o->duplicate_window_ms * NS_PER_MS;
    if (window == 0 && age != 0 && sc->Duplicates > age) { /* JetStream refuses it longer */
        window = age;
    }
    bool changed = sc->MaxAge != age || sc->MaxMsgs != msgs || sc->MaxBytes != bytes ||
                   (window != 0 && sc->Duplicates != window);
    sc->MaxAge = age;
    sc->MaxMsgs = msgs;
    sc->MaxBytes = bytes;
    if (window != 0) {
        sc->Duplicates = window;
    }
    return changed;
}

/* Brings the existing stream si to o's limits; its retention cannot change. */
static idem_code stream_update(jsCtx *js, jsStreamInfo *si, const idem_nats_stream_opts *o)
{
    jsStreamInfo *after = NULL;
    jsErrCode jerr = 0;
    jsRetentionPolicy want =
        o->retention == IDEM_NATS_RETAIN_WORK_QUEUE ? js_WorkQueuePolicy : js_LimitsPolicy;
    if (si->Config->Retention != want) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "nats stream %s: exists with another retention (JetStream cannot "
                         "change it: create a new stream)",
                         si->Config->Name);
    }
    if (!limits_apply(si->Config, o)) {
        return IDEM_OK;
    }
    natsStatus s = js_UpdateStream(&after, js, si->Config, NULL, &jerr);
    jsStreamInfo_Destroy(after);
    return s == NATS_OK ? IDEM_OK : idem__nats_code(s, jerr, "nats stream: update limits");
}

static idem_code stream_ensure(jsCtx *js, const char *stream, const char *const *subjects, size_t n,
                               const idem_nats_stream_opts *o)
{
    jsStreamConfig sc;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    idem_code code = IDEM_OK;
    natsStatus s = js_GetStreamInfo(&si, js, stream, NULL, &jerr);
    if (s == NATS_OK && o != NULL) {
        code = stream_update(js, si, o);
    } else if (s == NATS_NOT_FOUND || jerr == JSStreamNotFoundErr) {
        jsStreamConfig_Init(&sc);
        sc.Name = stream;
        sc.Subjects = (const char **)subjects;
        sc.SubjectsLen = (int)n;
        if (o != NULL) {
            sc.Retention =
                o->retention == IDEM_NATS_RETAIN_WORK_QUEUE ? js_WorkQueuePolicy : js_LimitsPolicy;
            limits_apply(&sc, o);
        }
        jerr = 0;
        s = js_AddStream(&si, js, &sc, NULL, &jerr);
    }
    if (s != NATS_OK) {
        code = idem__nats_code(s, jerr, "nats stream");
    }
    jsStreamInfo_Destroy(si);
    return code;
}

idem_code idem_nats_ensure_stream_ex(const char *url, const char *stream,
                                     const char *const *subjects, size_t n,
                                     const idem_nats_stream_opts *o)
{
    natsConnection *nc;
    jsCtx *js;
    if (stream == NULL || *stream == '\0' || subjects == NULL || n == 0 || n > 64) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats stream: a name and 1..64 subjects");
    }
    idem_code code = o != NULL ? stream_opts_check(o) : IDEM_OK;
    if (code != IDEM_OK || (code = idem__nats_connect(url, API_WAIT_MS, &nc, &js)) != IDEM_OK) {
        return code;
    }
    code = stream_ensure(js, stream, subjects, n, o);
    idem__nats_disconnect(nc, js);
    return code;
}

idem_code idem_nats_ensure_stream(const char *url, const char *stream, const char *const *subjects,
                                  size_t n)
{
    return idem_nats_ensure_stream_ex(url, stream, subjects, n, NULL);
}

idem_code idem__nats_purge_markers(const idem__nats_purge *p, uint64_t horizon_ms, size_t max,
                                   size_t *purged)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    if (purged != NULL) {
        *purged = 0;
    }
    horizon_ms = horizon_ms != 0 ? horizon_ms : IDEM_NATS_PURGE_HORIZON_MS;
    if (horizon_ms < p->ack_wait_ms) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "nats purge markers: horizon_ms %llu under the ack wait %llu ms",
                         (unsigned long long)horizon_ms, (unsigned long long)p->ack_wait_ms);
    }
    natsStatus s = js_GetStreamInfo(&si, p->js, p->stream, NULL, &jerr);
    if (s != NATS_OK) {
        return idem__nats_code(s, jerr, "nats purge markers: stream info");
    }
    uint64_t age_ms = si->Config->MaxAge > 0 ? (uint64_t)si->Config->MaxAge / NS_PER_MS : 0;
    jsStreamInfo_Destroy(si);
    if (age_ms == 0) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "nats purge markers: stream %s has no max_age, it may deliver any "
                         "message again: no marker of group %s can be purged",
                         p->stream, p->group);
    }
    uint64_t now = idem__now_ms();
    if (horizon_ms >= now || age_ms >= now - horizon_ms) { /* no wrap: nothing that old */
        return IDEM_OK;
    }
    return idem__consume_purge_owned(p->st, p->group, p->stream, now - horizon_ms - age_ms, max,
                                     purged);
}

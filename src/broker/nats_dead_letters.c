/* Dead letters for a person (nats.h, idemctl dead): read from the stream that captures
 * them one sequence at a time (js_GetMsg: no consumer is created, nothing is acked),
 * published again to the subject they came from, or removed (js_DeleteMsg). A message
 * of the stream without IDEM_NATS_DEAD_REASON is not a dead letter: passed over by the
 * list, never replayed nor removed, so that a mistyped stream name cannot cost a user
 * their messages. Invariant of replay: the dead letter is removed only after the broker
 * acked its copy, so a crash between the two leaves a duplicate, never a loss. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_internal.h"

#define API_WAIT_MS 5000
#define PROBES_MAX 100000 /* sequences one list call reads; *next says where it stopped */

struct idem_nats_dead_letters {
    natsConnection *nc;
    jsCtx *js;
    char *stream;
};

/* The stream's first and last sequence now. */
static idem_code stream_range(idem_nats_dead_letters *d, uint64_t *first, uint64_t *last)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    natsStatus s = js_GetStreamInfo(&si, d->js, d->stream, NULL, &jerr);
    if (s != NATS_OK) {
        idem_code code = idem__nats_code_on(d->nc, s, jerr, "nats dead letters: stream info");
        return code == IDEM_NOT_FOUND
                   ? idem__err(code, "nats dead letters: no stream %s", d->stream)
                   : code;
    }
    *first = si->State.FirstSeq;
    *last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    return IDEM_OK;
}

idem_code idem_nats_dead_open(idem_nats_dead_letters **out, const char *url, const char *stream)
{
    uint64_t first, last;
    if (out == NULL || stream == NULL || *stream == '\0') {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats dead letters: a stream is required");
    }
    *out = NULL;
    idem_nats_dead_letters *d = calloc(1, sizeof(*d));
    if (d == NULL || (d->stream = strdup(stream)) == NULL) {
        free(d);
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "nats dead letters: out of memory");
    }
    idem_code code = idem__nats_connect(url, API_WAIT_MS, &d->nc, &d->js);
    if (code == IDEM_OK) {
        code = stream_range(d, &first, &last);
    }
    if (code != IDEM_OK) {
        idem_nats_dead_close(d);
        return code;
    }
    *out = d;
    return IDEM_OK;
}

void idem_nats_dead_close(idem_nats_dead_letters *d)
{
    if (d != NULL) {
        idem__nats_disconnect(d->nc, d->js);
        free(d->stream);
        free(d);
    }
}

/* Message seq of the stream (the caller destroys *m); NOT_FOUND when it has none. */
static idem_code get(idem_nats_dead_letters *d, uint64_t seq, natsMsg **m)
{
    jsErrCode jerr = 0;
    natsStatus s = js_GetMsg(m, d->js, d->stream, seq, NULL, &jerr);
    if (s == NATS_OK) {
        return IDEM_OK;
    }
    *m = NULL;
    if (s == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr) {
        return idem__err(IDEM_NOT_FOUND, "nats dead letters: stream %s has no message %llu",
                         d->stream, (unsigned long long)seq);
    }
    return idem__nats_code_on(d->nc, s, jerr, "nats dead letters: get");
}

/* m (sequence seq) as the dead letter im, its headers in room; false when it is none. */
static bool as_dead(natsMsg *m, uint64_t seq, idem_nats_msg *im, idem__nats_room *room)
{
    *im = (idem_nats_msg){0};
    idem__nats_msg_room(im, m, room);
    im->reason_slot = NULL; /* nothing handles it */
    if (idem_nats_msg_header(im, IDEM_NATS_DEAD_REASON) == NULL) {
        return false;
    }
    const char *delivered = idem_nats_msg_header(im, IDEM_NATS_DEAD_DELIVERED);
    im->subject = natsMsg_GetSubject(m);
    im->data = natsMsg_GetData(m);
    im->len = (size_t)natsMsg_GetDataLength(m);
    im->key = idem_nats_msg_header(im, IDEM_NATS_KEY_HEADER);
    im->stream_seq = seq;
    im->delivered = delivered != NULL ? strtoull(delivered, NULL, 10) : 0;
    return true;
}

idem_code idem_nats_dead_list(idem_nats_dead_letters *d, uint64_t from, size_t max,
                              bool (*fn)(const idem_nats_msg *dead, void *arg), void *arg,
                              uint64_t *next)
{
    uint64_t first, last, seq, probes = 0;
    bool go = true;
    if (next != NULL) {
        *next = 0;
    }
    if (d == NULL || fn == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats dead letters: NULL");
    }
    idem_code code = stream_range(d, &first, &last);
    for (seq = from > first ? from : first;
         code == IDEM_OK && go && max > 0 && seq <= last && probes < PROBES_MAX; seq++, probes++) {
        natsMsg *m;
        idem_nats_msg im;
        idem__nats_room room;
        if ((code = get(d, seq, &m)) == IDEM_NOT_FOUND) { /* removed: a gap */
            code = IDEM_OK;
            continue;
        }
        if (code == IDEM_OK && as_dead(m, seq, &im, &room)) {
            max--;
            go = fn(&im, arg);
        }
        natsMsg_Destroy(m);
    }
    if (next != NULL && code == IDEM_OK) {
        *next = seq <= last ? seq : 0;
    }
    return code;
}

/* Dead letter seq into *m, im and room; FAILED_PRECONDITION when it is another message. */
static idem_code dead_at(idem_nats_dead_letters *d, uint64_t seq, natsMsg **m, idem_nats_msg *im,
                         idem__nats_room *room)
{
    idem_code code = get(d, seq, m);
    if (code == IDEM_OK && !as_dead(*m, seq, im, room)) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "nats dead letters: message %llu of stream %s is no dead letter (no %s "
                         "header): left alone",
                         (unsigned long long)seq, d->stream, IDEM_NATS_DEAD_REASON);
    }
    return code;
}

static idem_code remove_msg(idem_nats_dead_letters *d, uint64_t seq)
{
    jsErrCode jerr = 0;
    natsStatus s = js_DeleteMsg(d->js, d->stream, seq, NULL, &jerr);
    return s == NATS_OK ? IDEM_OK : idem__nats_code_on(d->nc, s, jerr, "nats dead letters: remove");
}

idem_code idem_nats_dead_purge(idem_nats_dead_letters *d, uint64_t seq)
{
    natsMsg *m = NULL;
    idem_nats_msg im;
    idem__nats_room room;
    if (d == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats dead letters: NULL");
    }
    idem_code code = dead_at(d, seq, &m, &im, &room);
    natsMsg_Destroy(m);
    return code == IDEM_OK ? remove_msg(d, seq) : code;
}

/* What replay refuses: a copy that would not be the original message. */
static idem_code replayable(const idem_nats_msg *im, const char **subject)
{
    *subject = idem_nats_msg_header(im, IDEM_NATS_DEAD_SUBJECT);
    if (idem_nats_msg_header(im, IDEM_NATS_DEAD_TRUNCATED) != NULL) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "nats dead letters: %llu carries only the first bytes of its payload "
                         "(%s): a copy would be another message; not replayed",
                         (unsigned long long)im->stream_seq, IDEM_NATS_DEAD_TRUNCATED);
    }
    if (*subject == NULL || **subject == '\0') {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "nats dead letters: %llu names no original subject (%s); not replayed",
                         (unsigned long long)im->stream_seq, IDEM_NATS_DEAD_SUBJECT);
    }
    return IDEM_OK;
}

/* The copy of im for subject: its payload, its key as Idem-Key and Nats-Msg-Id. */
static idem_code copy_make(natsMsg **copy, const idem_nats_msg *im, const char *subject)
{
    natsStatus s = natsMsg_Create(copy, subject, NULL, (const char *)im->data, (int)im->len);
    if (s == NATS_OK && im->key != NULL) {
        s = natsMsgHeader_Set(*copy, IDEM_NATS_KEY_HEADER, im->key);
    }
    if (s == NATS_OK && im->key != NULL) {
        s = natsMsgHeader_Set(*copy, IDEM_NATS_MSG_ID_HEADER, im->key);
    }
    return s == NATS_OK ? IDEM_OK : idem__nats_code(s, 0, "nats dead letters: copy");
}

/* Publishes the copy; NOT_FOUND when no stream takes its subject, ALREADY_EXISTS when the
 * broker's duplicate window dropped it. */
static idem_code publish_copy(idem_nats_dead_letters *d, natsMsg *copy, const char *subject,
                              const char *key)
{
    bool duplicate;
    natsStatus status = NATS_OK;
    idem_code code =
        idem__nats_publish(d->js, copy, "nats dead letters: replay", &duplicate, &status, NULL);
    if (code != IDEM_OK && status == NATS_NO_RESPONDERS) {
        return idem__err(IDEM_NOT_FOUND,
                         "nats dead letters: no stream takes subject %s; not "
                         "replayed",
                         subject);
    }
    if (code == IDEM_OK && duplicate) {
        return idem__err(IDEM_ALREADY_EXISTS,
                         "nats dead letters: the broker dropped the copy as a duplicate of "
                         "message id %s inside its duplicate window; the dead letter is kept, "
                         "replay it after the window",
                         key != NULL ? key : "");
    }
    return code;
}

idem_code idem_nats_dead_replay(idem_nats_dead_letters *d, uint64_t seq)
{
    natsMsg *m = NULL, *copy = NULL;
    idem_nats_msg im;
    idem__nats_room room;
    const char *subject = NULL;
    char why[512];
    if (d == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "nats dead letters: NULL");
    }
    idem_code code = dead_at(d, seq, &m, &im, &room);
    if (code == IDEM_OK && (code = replayable(&im, &subject)) == IDEM_OK &&
        (code = copy_make(&copy, &im, subject)) == IDEM_OK &&
        (code = publish_copy(d, copy, subject, im.key)) == IDEM_OK &&
        (code = remove_msg(d, seq)) != IDEM_OK) {
        snprintf(why, sizeof(why), "%s", idem_errmsg()); /* not formatted into itself */
        code = idem__err(code,
                         "nats dead letters: %llu replayed to %s (acked), but it stays "
                         "in the stream: %s",
                         (unsigned long long)seq, subject, why);
    }
    natsMsg_Destroy(copy);
    natsMsg_Destroy(m);
    return code;
}

/* The dead letter: a message no delivery can make take effect, kept for a person on a
 * subject of its own with the reason, before its original is terminated. Its headers count
 * against what the broker takes like its payload (the connection's max_payload, and the
 * max_msg_size of the stream that captures the dead letters): when the original's payload
 * and these headers do not fit, the dead letter carries the payload's first bytes that do
 * and says so (IDEM_NATS_DEAD_TRUNCATED), so that it can be published. */
#include <stdio.h>
#include <string.h>

#include "nats_internal.h"

#define MAX_HEADERS 8
#define HEADERS_FRAME 12 /* "NATS/1.0\r\n" and the closing "\r\n" */

typedef struct dead_headers {
    const char *key[MAX_HEADERS], *value[MAX_HEADERS];
    int n;
    char seq[24], delivered[24], id[128], truncated[24];
    char reason[1024], key_text[4 * IDEM_MAX_MSG_KEY + 8]; /* no CR or LF: they would end it */
} dead_headers;

static void header(dead_headers *h, const char *key, const char *value)
{
    h->key[h->n] = key;
    h->value[h->n++] = value;
}

/* Their bytes as NATS counts them: each "key: value\r\n", and the frame. */
static size_t headers_len(const dead_headers *h)
{
    size_t n = HEADERS_FRAME;
    for (int i = 0; i < h->n; i++) {
        n += strlen(h->key[i]) + strlen(h->value[i]) + 4;
    }
    return n;
}

static void headers_make(dead_headers *h, const char *durable, const idem_nats_msg *im,
                         const char *reason)
{
    h->n = 0;
    snprintf(h->seq, sizeof(h->seq), "%llu", (unsigned long long)im->stream_seq);
    snprintf(h->delivered, sizeof(h->delivered), "%llu", (unsigned long long)im->delivered);
    snprintf(h->id, sizeof(h->id), "dead.%llu.%s", (unsigned long long)im->stream_seq, durable);
    idem__nats_escape(h->reason, sizeof(h->reason), reason, strlen(reason), false);
    header(h, IDEM_NATS_DEAD_REASON, h->reason);
    header(h, IDEM_NATS_DEAD_SUBJECT, im->subject);
    header(h, IDEM_NATS_DEAD_SEQ, h->seq);
    header(h, IDEM_NATS_DEAD_DELIVERED, h->delivered);
    header(h, IDEM_NATS_MSG_ID_HEADER, h->id);
    if (im->key != NULL) { /* a key_fn's may hold any byte; a header's holds no CR, LF */
        idem__nats_escape(h->key_text, sizeof(h->key_text), im->key, strlen(im->key), false);
        header(h, IDEM_NATS_KEY_HEADER, h->key_text);
    }
}

/* How much of the payload fits limit beside the headers (adding the truncation header
 * when not all of it does). */
static size_t payload_part(dead_headers *h, const idem_nats_msg *im, int64_t limit)
{
    if (limit <= 0 || headers_len(h) + im->len <= (uint64_t)limit) {
        return im->len;
    }
    snprintf(h->truncated, sizeof(h->truncated), "%zu", im->len);
    header(h, IDEM_NATS_DEAD_TRUNCATED, h->truncated);
    size_t used = headers_len(h);
    return used < (uint64_t)limit ? (size_t)limit - used : 0;
}

/* One publish of the dead letter sized by limit (<= 0: unknown, the whole payload). */
static idem_code publish(jsCtx *js, int64_t limit, const char *subject, const char *durable,
                         const idem_nats_msg *im, const char *reason)
{
    natsMsg *dm = NULL;
    dead_headers h;
    bool duplicate;
    headers_make(&h, durable, im, reason);
    size_t len = payload_part(&h, im, limit);
    natsStatus s = natsMsg_Create(&dm, subject, NULL, (const char *)im->data, (int)len);
    for (int i = 0; s == NATS_OK && i < h.n; i++) {
        s = natsMsgHeader_Set(dm, h.key[i], h.value[i]);
    }
    if (s != NATS_OK) {
        natsMsg_Destroy(dm);
        return idem__nats_code(s, 0, "nats dead letter: message");
    }
    idem_code code =
        idem__nats_publish(js, dm, "nats dead letter: publish", &duplicate, NULL, NULL);
    natsMsg_Destroy(dm);
    return code;
}

/* The connection's max_payload, or the stream's bound when smaller; reads the stream's
 * bound when not known yet or asked to (an unanswered read: unknown, asked again). */
static int64_t limit_of(jsCtx *js, natsConnection *nc, idem__nats_dead_bound *b,
                        const char *subject, bool refresh)
{
    int64_t max_payload = natsConnection_GetMaxPayload(nc);
    if (refresh || !b->known) {
        idem_errkeep k;
        idem__err_keep(&k);
        b->known = idem__nats_stream_of(js, subject, &b->max_msg_size) == IDEM_OK;
        idem__err_put(&k, IDEM_OK);
    }
    if (b->known && b->max_msg_size > 0 && (max_payload <= 0 || b->max_msg_size < max_payload)) {
        return b->max_msg_size;
    }
    return max_payload;
}

idem_code idem__nats_dead_letter(jsCtx *js, natsConnection *nc, idem__nats_dead_bound *b,
                                 const char *subject, const char *durable, const idem_nats_msg *im,
                                 const char *reason)
{
    idem_code code = publish(js, limit_of(js, nc, b, subject, false), subject, durable, im, reason);
    if (code != IDEM_OUT_OF_RANGE) {
        return code;
    }
    /* Too large: the stream's bound may have changed since it was read. */
    code = publish(js, limit_of(js, nc, b, subject, true), subject, durable, im, reason);
    if (code == IDEM_OUT_OF_RANGE && !b->known) { /* not for good: that bound is unknown */
        return idem__err(IDEM_UNAVAILABLE,
                         "nats dead letter: too large, and the bound of the stream taking %s "
                         "could not be read",
                         subject);
    }
    return code;
}

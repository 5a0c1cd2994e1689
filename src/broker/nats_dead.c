/* The dead letter: a message no delivery can make take effect, kept for a person on a
 * subject of its own with the reason, before its original is terminated. */
#include <stdio.h>

#include "nats_internal.h"

static natsStatus dead_headers(natsMsg *dm, const char *durable, natsMsg *orig,
                               const idem_nats_msg *im, const char *reason)
{
    char seq[24], delivered[24], id[128];
    snprintf(seq, sizeof(seq), "%llu", (unsigned long long)im->stream_seq);
    snprintf(delivered, sizeof(delivered), "%llu", (unsigned long long)im->delivered);
    snprintf(id, sizeof(id), "dead.%llu.%s", (unsigned long long)im->stream_seq, durable);
    natsStatus s = natsMsgHeader_Set(dm, IDEM_NATS_DEAD_REASON, reason);
    if (s == NATS_OK) {
        s = natsMsgHeader_Set(dm, IDEM_NATS_DEAD_SUBJECT, im->subject);
    }
    if (s == NATS_OK) {
        s = natsMsgHeader_Set(dm, IDEM_NATS_DEAD_SEQ, seq);
    }
    if (s == NATS_OK) {
        s = natsMsgHeader_Set(dm, IDEM_NATS_DEAD_DELIVERED, delivered);
    }
    if (s == NATS_OK) {
        s = natsMsgHeader_Set(dm, IDEM_NATS_MSG_ID_HEADER, id);
    }
    if (s == NATS_OK && im->key != NULL) {
        s = natsMsgHeader_Set(dm, IDEM_NATS_KEY_HEADER, im->key);
    }
    (void)orig;
    return s;
}

idem_code idem__nats_dead_letter(jsCtx *js, const char *subject, const char *durable, natsMsg *orig,
                                 const idem_nats_msg *im, const char *reason)
{
    natsMsg *dm = NULL;
    bool duplicate;
    natsStatus s = natsMsg_Create(&dm, subject, NULL, (const char *)im->data, (int)im->len);
    if (s == NATS_OK) {
        s = dead_headers(dm, durable, orig, im, reason);
    }
    if (s != NATS_OK) {
        natsMsg_Destroy(dm);
        return idem__nats_code(s, 0, "nats dead letter: message");
    }
    idem_code code = idem__nats_publish(js, dm, "nats dead letter: publish", &duplicate);
    natsMsg_Destroy(dm);
    return code;
}

/* idemctl's views of the queues the library keeps in a store: the transactional outbox
 * (toolkit.h) that a relay empties into the broker. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idemrpc/idemrpc.h>

#include "idemctl.h"
#include "json.h"

#define DATA_SHOWN 256 /* bytes of a message's data printed; data_bytes says how many */

void idemctl_escaped(const void *bytes, size_t len, size_t shown, char *out)
{
    const unsigned char *b = bytes;
    size_t o = 0;
    for (size_t i = 0; i < len && i < shown; i++) {
        if (b[i] >= 0x20 && b[i] < 0x7f && b[i] != '\\') {
            out[o++] = (char)b[i];
        } else {
            o += (size_t)snprintf(out + o, 5, "\\x%02x", b[i]);
        }
    }
    out[o] = '\0';
}

static void print_msg(const idem_outbox_msg *m, bool json, bool first)
{
    char text[4 * DATA_SHOWN + 1], subject[4 * IDEM_OUTBOX_MAX_SUBJECT + 1],
        id[4 * IDEM_OUTBOX_MAX_MSG_ID + 1];
    idemctl_escaped(m->data, m->len, DATA_SHOWN, text);
    idemctl_escaped(m->subject, strlen(m->subject), IDEM_OUTBOX_MAX_SUBJECT, subject);
    idemctl_escaped(m->msg_id, strlen(m->msg_id), IDEM_OUTBOX_MAX_MSG_ID, id);
    if (!json) {
        printf("seq %" PRIu64 "  subject %s  msg_id %s  %zu bytes\n  %s%s\n", m->seq, subject, id,
               m->len, text, m->len > DATA_SHOWN ? " ..." : "");
        return;
    }
    printf("%s{\"seq\":%" PRIu64 ",\"subject\":", first ? "" : ",", m->seq);
    idem__json_fputs(stdout, subject);
    fputs(",\"msg_id\":", stdout);
    idem__json_fputs(stdout, id);
    printf(",\"data_bytes\":%zu,\"data\":", m->len);
    idem__json_fputs(stdout, text);
    putchar('}');
}

/* outbox: the messages put and not yet relayed, and the oldest --limit of them (1 unless
 * --limit is given; at most IDEM_OUTBOX_MAX_BATCH). */
int idemctl_outbox(idem_store *st, const args *a)
{
    size_t max = a->limit_set ? (size_t)a->limit : 1, n = 0;
    max = max > IDEM_OUTBOX_MAX_BATCH ? IDEM_OUTBOX_MAX_BATCH : max;
    idem_outbox_msg *msgs = calloc(max ? max : 1, sizeof(*msgs));
    uint64_t pending;
    if (msgs == NULL) {
        fprintf(stderr, "idemctl: out of memory\n");
        return 1;
    }
    if (idem_outbox_pending(st, &pending) != IDEM_OK ||
        (max > 0 && idem_outbox_peek(st, msgs, max, &n) != IDEM_OK)) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        free(msgs);
        return 1;
    }
    if (a->json) {
        printf("{\"pending\":%" PRIu64 ",\"oldest\":[", pending);
    } else {
        printf("pending      %" PRIu64 "\n", pending);
    }
    for (size_t i = 0; i < n; i++) {
        print_msg(&msgs[i], a->json, i == 0);
    }
    if (a->json) {
        puts("]}");
    }
    idem_outbox_msgs_free(msgs, n);
    free(msgs);
    return 0;
}

#define MARKERS_WALKED 100000 /* markers counted without --limit: one read each */

/* markers GROUP: how many messages the group has consumed that idem_consume_purge has
 * not removed yet, and the oldest consumption among them. */
int idemctl_markers(idem_store *st, const args *a)
{
    idem_consume_markers m;
    size_t max = a->limit_set ? (size_t)a->limit : MARKERS_WALKED; /* 0: INVALID_ARGUMENT */
    if (idem_consume_group_markers(st, a->method, max, &m) != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return 1;
    }
    if (a->json) {
        fputs("{\"group\":", stdout);
        idem__json_fputs(stdout, a->method);
        printf(",\"markers\":%" PRIu64 ",\"more\":%s,\"oldest_ms\":%" PRIu64 "}\n", m.count,
               m.more ? "true" : "false", m.oldest_ms);
        return 0;
    }
    printf("group        %s\nmarkers      %s%" PRIu64 "\n", a->method, m.more ? "more than " : "",
           m.count);
    if (m.count > 0) {
        fputs("oldest       ", stdout);
        idemctl_print_time(m.oldest_ms);
        putchar('\n');
    }
    return 0;
}

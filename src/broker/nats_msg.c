/* What a handler sees of its message beyond the payload: the message's headers (read-only,
 * bounded) and a place to say why it fails (idem_nats_fail), which the dead letter carries.
 * Both live in the delivery's room (idem__nats_room): nothing here allocates per message
 * but libnats' own lists, freed before returning. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nats_internal.h"

void idem__nats_escape(char *out, size_t cap, const char *in, size_t len, bool all)
{
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char b = (unsigned char)in[i];
        bool plain = all ? b >= 0x20 && b < 0x7f && b != '\\' : b != '\r' && b != '\n';
        size_t need = plain ? 1 : 4, room = i + 1 < len ? 4 : 0; /* room for "..." */
        if (o + need + room >= cap) {
            snprintf(out + o, cap - o, "%s", o + 3 < cap ? "..." : "");
            return;
        }
        if (plain) {
            out[o++] = (char)b;
        } else {
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", b);
        }
    }
    out[o] = '\0';
}

/* Every value of name into the room, while it has space. */
static void header_values(idem_nats_msg *im, natsMsg *m, const char *name, idem_nats_header *room)
{
    const char **values = NULL;
    int n = 0;
    if (natsMsgHeader_Values(m, name, &values, &n) != NATS_OK) {
        im->headers_cut = true; /* not all of them are shown */
        return;
    }
    for (int i = 0; i < n; i++) {
        if (im->n_headers == IDEM_NATS_MAX_HEADERS) {
            im->headers_cut = true;
            break;
        }
        room[im->n_headers++] = (idem_nats_header){name, values[i]};
    }
    free((void *)values);
}

void idem__nats_msg_room(idem_nats_msg *im, natsMsg *m, idem__nats_room *room)
{
    const char **names = NULL;
    int n = 0;
    im->headers = room->headers;
    im->n_headers = 0;
    im->headers_cut = false;
    im->reason_slot = &room->reason;
    room->reason.text[0] = '\0';
    natsStatus s = natsMsgHeader_Keys(m, &names, &n);
    if (s != NATS_OK) { /* NOT_FOUND: it has none; else they could not be read */
        im->headers_cut = s != NATS_NOT_FOUND;
        return;
    }
    for (int i = 0; i < n; i++) {
        header_values(im, m, names[i], room->headers);
    }
    free((void *)names);
}

const char *idem__nats_reason_of(const idem_nats_msg *im)
{
    return im->reason_slot != NULL && im->reason_slot->text[0] != '\0' ? im->reason_slot->text
                                                                       : NULL;
}

const char *idem_nats_msg_header(const idem_nats_msg *m, const char *name)
{
    for (size_t i = 0; m != NULL && name != NULL && i < m->n_headers; i++) {
        if (strcmp(m->headers[i].name, name) == 0) {
            return m->headers[i].value;
        }
    }
    return NULL;
}

idem_code idem_nats_fail(const idem_nats_msg *m, idem_code code, const char *fmt, ...)
{
    char raw[4 * IDEM_NATS_MAX_REASON];
    va_list ap;
    if (m == NULL || m->reason_slot == NULL || fmt == NULL) {
        return code;
    }
    va_start(ap, fmt);
    int n = vsnprintf(raw, sizeof(raw), fmt, ap);
    va_end(ap);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof(raw) ? (size_t)n : sizeof(raw) - 1;
    idem__nats_escape(m->reason_slot->text, sizeof(m->reason_slot->text), raw, len, true);
    return code;
}

/* The kept log's stream directory (toolkit_internal.h): one record in IDEM_OUTBOX_DB,
 *   'N' → be16 (count | OVERFLOW) ‖ count × (be64 i ‖ be64 seq ‖ be64 stream_seq ‖
 *                                   u8 |stream| stream ‖ u8 |msg_id| msg_id)
 * in the order the streams were last acked (the oldest first). A relay publishing to
 * several streams finds a loss in any of them from this record: the kept log's newest
 * message names only the stream acked last. It is an index of the kept log: a record
 * that does not decode is dropped and the directory overflows (everything kept is
 * published again at the next check), never an error that stops the outbox. */
#include <stdlib.h>

#include "toolkit_internal.h"

#define DIR_KEY 'N'
#define ENTRY_FIXED 26 /* three be64, two u8 lengths */
#define OVERFLOW 0x8000
#define DIR_MAX (2 + IDEM__KEPT_STREAMS * (ENTRY_FIXED + 2 * 255))

static idem_code bad(void)
{
    return idem__err(IDEM_DATA_LOSS, "outbox: bad kept stream directory");
}

static idem_code dir_decode(const uint8_t *v, size_t n, idem__kept_dir *d)
{
    size_t at = 2, count = n >= 2 ? (size_t)((v[0] << 8 | v[1]) & ~OVERFLOW) : 0;
    if (n < 2 || count > IDEM__KEPT_STREAMS) {
        return bad();
    }
    d->overflow = (v[0] << 8 & OVERFLOW) != 0;
    for (d->n = 0; d->n < count; d->n++) {
        idem__kept_stream *e = &d->s[d->n];
        if (n < at + ENTRY_FIXED - 1) {
            return bad();
        }
        e->i = idem__get_be64(v + at);
        e->ack.seq = idem__get_be64(v + at + 8);
        e->ack.stream_seq = idem__get_be64(v + at + 16);
        size_t ls = v[at + 24], li;
        if (ls == 0 || n < at + 25 + ls + 1 || (li = v[at + 25 + ls]) == 0 ||
            n < at + 26 + ls + li) {
            return bad();
        }
        memcpy(e->ack.stream, v + at + 25, ls);
        e->ack.stream[ls] = '\0';
        memcpy(e->msg_id, v + at + 26 + ls, li);
        e->msg_id[li] = '\0';
        at += ENTRY_FIXED + ls + li;
    }
    return at == n ? IDEM_OK : bad();
}

/* d from the record v[0..n) (code: how reading it went): empty when absent; empty and
 * overflowing (and to be rewritten) when it does not decode. */
static idem_code dir_from(idem_code code, const void *v, size_t n, idem__kept_dir *d)
{
    memset(d, 0, sizeof(*d));
    if (code == IDEM_NOT_FOUND) {
        return IDEM_OK;
    }
    if (code != IDEM_OK) {
        return code;
    }
    d->present = true;
    if (dir_decode(v, n, d) != IDEM_OK) {
        d->n = 0;
        d->overflow = d->changed = true;
    }
    return IDEM_OK;
}

idem_code idem__kept_dir_load(idem_txn *t, idem__kept_dir *d)
{
    const uint8_t k = DIR_KEY;
    const void *v = NULL;
    size_t n = 0;
    idem_code code = idem_txn_get(t, IDEM_OUTBOX_DB, &k, 1, &v, &n);
    return dir_from(code, v, n, d);
}

idem_code idem__kept_dir_read(idem_store *st, idem__kept_dir *d)
{
    const uint8_t k = DIR_KEY;
    void *v = NULL;
    size_t n = 0;
    idem_code code = idem_store_app_get(st, IDEM_OUTBOX_DB, &k, 1, &v, &n);
    code = dir_from(code, v, n, d);
    free(v);
    return code;
}

static void drop(idem__kept_dir *d, size_t j)
{
    memmove(&d->s[j], &d->s[j + 1], (d->n - j - 1) * sizeof(d->s[0]));
    d->n--;
    d->changed = true;
}

idem_code idem__kept_dir_note(idem__kept_dir *d, uint64_t i, const idem_outbox_ack *a,
                              const uint8_t *m, size_t n)
{
    idem__kept_stream e = {.i = i, .ack = *a};
    idem_code code = idem__outbox_msg_id(m, n, a->seq, e.msg_id);
    if (code != IDEM_OK) {
        return code;
    }
    for (size_t j = 0; j < d->n; j++) {
        if (strcmp(d->s[j].ack.stream, a->stream) == 0) {
            e.i = d->s[j].i > i ? d->s[j].i : i;
            if (d->s[j].ack.stream_seq > a->stream_seq) { /* kept out of order */
                e.ack = d->s[j].ack;
                memcpy(e.msg_id, d->s[j].msg_id, sizeof(e.msg_id));
            }
            drop(d, j);
            break;
        }
    }
    if (d->n == IDEM__KEPT_STREAMS) {
        drop(d, 0); /* the stream acked longest ago */
        d->overflow = true;
    }
    d->s[d->n++] = e;
    d->changed = true;
    return IDEM_OK;
}

void idem__kept_dir_prune(idem__kept_dir *d, uint64_t head, uint64_t next)
{
    for (size_t j = d->n; j-- > 0;) {
        if (d->s[j].i < head || head == next) {
            drop(d, j);
        }
    }
    if (head == next && d->overflow) {
        d->overflow = false;
        d->changed = true;
    }
}

idem_code idem__kept_dir_store(idem_txn *t, idem__kept_dir *d)
{
    const uint8_t k = DIR_KEY;
    if (!d->changed) {
        return IDEM_OK;
    }
    if (d->n == 0 && !d->overflow) {
        idem_code code = idem_txn_del(t, IDEM_OUTBOX_DB, &k, 1);
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    uint8_t *v = malloc(DIR_MAX);
    size_t at = 2;
    if (v == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "outbox: out of memory");
    }
    size_t head = d->n | (d->overflow ? OVERFLOW : 0);
    v[0] = (uint8_t)(head >> 8), v[1] = (uint8_t)head;
    for (size_t j = 0; j < d->n; j++) {
        const idem__kept_stream *e = &d->s[j];
        size_t ls = strlen(e->ack.stream), li = strlen(e->msg_id);
        idem__put_be64(v + at, e->i);
        idem__put_be64(v + at + 8, e->ack.seq);
        idem__put_be64(v + at + 16, e->ack.stream_seq);
        v[at + 24] = (uint8_t)ls;
        memcpy(v + at + 25, e->ack.stream, ls);
        v[at + 25 + ls] = (uint8_t)li;
        memcpy(v + at + 26 + ls, e->msg_id, li);
        at += ENTRY_FIXED + ls + li;
    }
    idem_code code = idem_txn_put(t, IDEM_OUTBOX_DB, &k, 1, v, at);
    free(v);
    return code;
}

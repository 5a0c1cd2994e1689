/* The HTTP front's buffers and the bound on all of them together (see http_conn.h).
 *
 * A connection reads into one buffer that starts at IDEM_HBUF_INITIAL bytes and doubles
 * up to s->max_buf while a request arrives, and sends each answer from one buffer of its
 * exact size. What the buffers hold beyond their first IDEM_HBUF_INITIAL bytes (input
 * and answer each) is counted in s->buffered, which never passes s->cfg.max_buffered:
 * a growth that would pass it is refused before anything is allocated (the connection
 * answers 503), so is an answer (before its body is copied: http_conn.c answers 503 or
 * 507 instead), and a new request is not handed to the front while less than
 * IDEM_HBUF_INITIAL bytes of the bound are free. An input buffer goes back to its first
 * size between requests; an answer's count goes back when it is sent or dropped. The
 * count is an atomic reserved by compare-and-swap, so a connection reserves under its
 * own lock only (s->mtx is taken before it, never inside). */
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"

static bool reserve(idem_hsrv *s, size_t n)
{
    size_t cur = atomic_load(&s->buffered);
    do {
        if (n > s->cfg.max_buffered || cur > s->cfg.max_buffered - n) {
            return false;
        }
    } while (!atomic_compare_exchange_weak(&s->buffered, &cur, cur + n));
    return true;
}

bool idem__hbuf_admits(const idem_hsrv *s)
{
    size_t free_min =
        s->cfg.max_buffered < IDEM_HBUF_INITIAL ? s->cfg.max_buffered : IDEM_HBUF_INITIAL;
    return atomic_load(&s->buffered) <= s->cfg.max_buffered - free_min;
}

bool idem__hbuf_hold_answer(idem_hsrv *s, size_t size, size_t *counted)
{
    size_t n = size > IDEM_HBUF_INITIAL ? size - IDEM_HBUF_INITIAL : 0;
    if (!reserve(s, n)) {
        return false;
    }
    *counted = n;
    return true;
}

void idem__hbuf_release(idem_hsrv *s, size_t *counted)
{
    atomic_fetch_sub(&s->buffered, *counted);
    *counted = 0;
}

/* Moves *buf's first len bytes into a new buffer of cap bytes; false when out of memory. */
static bool move_to(char **buf, size_t len, size_t cap, idem_hreq *r)
{
    char *b = malloc(cap);
    if (b == NULL) {
        return false;
    }
    memcpy(b, *buf, len);
    if (r != NULL) {
        idem__http_head_moved(r, *buf, b);
    }
    free(*buf);
    *buf = b;
    return true;
}

idem_hbuf_grow idem__hbuf_grow(idem_hsrv *s, char **buf, size_t *cap, size_t len, idem_hreq *r)
{
    size_t want = *cap * 2 < s->max_buf ? *cap * 2 : s->max_buf;
    if (want <= *cap) {
        return IDEM_HBUF_TOO_LARGE;
    }
    if (!reserve(s, want - *cap)) {
        return IDEM_HBUF_FULL;
    }
    if (!move_to(buf, len, want, r)) {
        atomic_fetch_sub(&s->buffered, want - *cap);
        return IDEM_HBUF_TOO_LARGE;
    }
    *cap = want;
    return IDEM_HBUF_OK;
}

void idem__hbuf_shrink(idem_hsrv *s, char **buf, size_t *cap, size_t len)
{
    if (*cap > IDEM_HBUF_INITIAL && len <= IDEM_HBUF_INITIAL &&
        move_to(buf, len, IDEM_HBUF_INITIAL, NULL)) {
        atomic_fetch_sub(&s->buffered, *cap - IDEM_HBUF_INITIAL);
        *cap = IDEM_HBUF_INITIAL;
    }
}

void idem__hbuf_free(idem_hsrv *s, char *buf, size_t cap)
{
    if (cap > IDEM_HBUF_INITIAL) {
        atomic_fetch_sub(&s->buffered, cap - IDEM_HBUF_INITIAL);
    }
    free(buf);
}

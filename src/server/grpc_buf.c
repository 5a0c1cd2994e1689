/* The bound on the message and answer bytes of all the gRPC front's streams together
 * (grpc_conn.h, cfg.max_buffered): reserved by compare-and-swap before anything is
 * allocated, so a connection reserves under its own lock only. */
#include "grpc_conn.h"

bool idem__gbuf_reserve(idem_gsrv *s, size_t n)
{
    size_t cur = atomic_load(&s->buffered);
    do {
        if (n > s->cfg.max_buffered || cur > s->cfg.max_buffered - n) {
            return false;
        }
    } while (!atomic_compare_exchange_weak(&s->buffered, &cur, cur + n));
    return true;
}

void idem__gbuf_release(idem_gsrv *s, size_t *counted)
{
    atomic_fetch_sub(&s->buffered, *counted);
    *counted = 0;
}

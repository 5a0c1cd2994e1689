/* The NATS binding in a build without libnats (-Dnats=disabled, or auto without libnats
 * installed). meson compiles this file instead of nats_*.c: the public entry points stay,
 * so programs that offer the broker as an option link against either build and learn at
 * run time that it is missing. */
#include <string.h>

#include "internal.h"

#include "idemrpc/nats.h"

#define NATS_MISSING "built without NATS support (-Dnats=disabled)"

void idem_nats_consumer_opts_init(idem_nats_consumer_opts *o)
{
    memset(o, 0, sizeof(*o));
}

idem_code idem_nats_consumer_open(idem_nats_consumer **out, idem_store *st,
                                  const idem_nats_consumer_opts *o)
{
    (void)st;
    (void)o;
    *out = NULL;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_consumer_poll(idem_nats_consumer *c, unsigned *handled)
{
    (void)c;
    if (handled != NULL) {
        *handled = 0;
    }
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_consumer_start(idem_nats_consumer *c)
{
    (void)c;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

void idem_nats_consumer_stats(idem_nats_consumer *c, idem_nats_stats *out)
{
    (void)c;
    memset(out, 0, sizeof(*out));
}

void idem_nats_consumer_close(idem_nats_consumer *c)
{
    (void)c;
}

void idem_nats_relay_opts_init(idem_nats_relay_opts *o)
{
    memset(o, 0, sizeof(*o));
}

idem_code idem_nats_relay_open(idem_nats_relay **out, idem_store *st, const idem_nats_relay_opts *o)
{
    (void)st;
    (void)o;
    *out = NULL;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_relay_run_once(idem_nats_relay *r, unsigned *relayed)
{
    (void)r;
    if (relayed != NULL) {
        *relayed = 0;
    }
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_relay_start(idem_nats_relay *r)
{
    (void)r;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

void idem_nats_relay_stats(idem_nats_relay *r, idem_nats_relay_counts *out)
{
    (void)r;
    memset(out, 0, sizeof(*out));
}

void idem_nats_relay_close(idem_nats_relay *r)
{
    (void)r;
}

idem_code idem_nats_consumer_pending(idem_nats_consumer *c, uint64_t *pending)
{
    (void)c;
    *pending = 0;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_ensure_stream(const char *url, const char *stream, const char *const *subjects,
                                  size_t n)
{
    (void)url, (void)stream, (void)subjects, (void)n;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

void idem_nats_stream_opts_init(idem_nats_stream_opts *o)
{
    memset(o, 0, sizeof(*o));
}

idem_code idem_nats_ensure_stream_ex(const char *url, const char *stream,
                                     const char *const *subjects, size_t n,
                                     const idem_nats_stream_opts *o)
{
    (void)url, (void)stream, (void)subjects, (void)n, (void)o;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_consumer_purge_markers(idem_nats_consumer *c, uint64_t horizon_ms, size_t max,
                                           size_t *purged)
{
    (void)c, (void)horizon_ms, (void)max;
    if (purged != NULL) {
        *purged = 0;
    }
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

const char *idem_nats_msg_header(const idem_nats_msg *m, const char *name)
{
    (void)m;
    (void)name;
    return NULL;
}

idem_code idem_nats_fail(const idem_nats_msg *m, idem_code code, const char *fmt, ...)
{
    (void)m;
    (void)fmt;
    return code;
}

idem_code idem_nats_dead_open(idem_nats_dead_letters **out, const char *url, const char *stream)
{
    (void)url;
    (void)stream;
    if (out != NULL) {
        *out = NULL;
    }
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_dead_list(idem_nats_dead_letters *d, uint64_t from, size_t max,
                              bool (*fn)(const idem_nats_msg *dead, void *arg), void *arg,
                              uint64_t *next)
{
    (void)d, (void)from, (void)max, (void)fn, (void)arg;
    if (next != NULL) {
        *next = 0;
    }
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_dead_replay(idem_nats_dead_letters *d, uint64_t seq)
{
    (void)d, (void)seq;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_nats_dead_purge(idem_nats_dead_letters *d, uint64_t seq)
{
    (void)d, (void)seq;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

void idem_nats_dead_close(idem_nats_dead_letters *d)
{
    (void)d;
}

idem_code idem_server_add_nats_consumer(idem_server *srv, idem_nats_consumer *c, const char *name,
                                        unsigned *id)
{
    (void)srv, (void)c, (void)name, (void)id;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

idem_code idem_server_add_nats_relay(idem_server *srv, idem_nats_relay *r, const char *name,
                                     unsigned *id)
{
    (void)srv, (void)r, (void)name, (void)id;
    return idem__err(IDEM_UNIMPLEMENTED, NATS_MISSING);
}

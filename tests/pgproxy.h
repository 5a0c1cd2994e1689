/* A TCP proxy between the tests' server instances and PostgreSQL that can cut the
 * network without a FIN or RST (nothing is forwarded either way, as when packets are
 * dropped) and delay every chunk it forwards (a slow database). */
#ifndef IDEMRPC_TEST_PGPROXY_H
#define IDEMRPC_TEST_PGPROXY_H

#include <stdbool.h>

typedef struct pgproxy pgproxy;

/* Listens on 127.0.0.1:<free port> and forwards to the host and port of conninfo. */
pgproxy *pgproxy_start(const char *conninfo);
int pgproxy_port(const pgproxy *p);
/* cut: connections stay open, and nothing passes (new ones are accepted by the kernel,
 * then hear nothing) until the proxy is mended. */
void pgproxy_cut(pgproxy *p, bool cut);
/* Every chunk forwarded from now on waits ms first (0: none). */
void pgproxy_delay(pgproxy *p, unsigned ms);
/* Closes every connection and frees p. */
void pgproxy_stop(pgproxy *p);

#endif

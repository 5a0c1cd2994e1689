/* A host that accepts TCP connections and never answers: a stopped or partitioned
 * database server as a connecting client sees it (the kernel completes the handshake,
 * the startup packet goes unanswered). pgproxy.h cuts a live proxy the same way: a
 * fault campaign can give each server `host=127.0.0.1,127.0.0.1 port=A,B` with A a
 * hung host (or a proxy it cuts: an ex-leader that stops answering) and B its way to
 * the database (later keywords win in a conninfo). */
#ifndef IDEMRPC_TEST_HUNG_HOST_H
#define IDEMRPC_TEST_HUNG_HOST_H

typedef struct hung_host hung_host;

/* Listens on 127.0.0.1:<free port>; NULL when it cannot. */
hung_host *hung_host_start(void);
int hung_host_port(const hung_host *h);
/* The connections made to it so far (closed ones included), up to its backlog of 128
 * unread ones. */
int hung_host_connections(hung_host *h);
/* Closes every connection and frees h. */
void hung_host_stop(hung_host *h);

#endif

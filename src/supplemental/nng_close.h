/* nng_close that returns: see nng_close.c. */
#ifndef IDEMRPC_NNG_CLOSE_H
#define IDEMRPC_NNG_CLOSE_H

#include <stdbool.h>

#include <nng/nng.h>

/* Closes s and waits up to IDEM_NNG_CLOSE_WAIT_MS for nng to finish; true when it did.
 * On false the close goes on in the background and s is left to nng. */
#define IDEM_NNG_CLOSE_WAIT_MS 2000u
bool idem__nng_close_bounded(nng_socket s);

#endif

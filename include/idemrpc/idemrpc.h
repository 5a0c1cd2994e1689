/* idemrpc umbrella header: the whole public API.
 *
 * Every *_close, *_destroy, *_clear and *_free function of it takes NULL and does
 * nothing, so a cleanup path may call them unconditionally (idem_lock_release(NULL)
 * answers IDEM_INVALID_ARGUMENT). tests/test_headers.c checks this, and that every
 * default an options struct documents ("0 = ...") is the one the library uses. */
#ifndef IDEMRPC_H
#define IDEMRPC_H

#include "status.h"
#include "chain.h"
#include "store.h"
#include "server.h"
#include "client.h"
#include "downstream.h"
#include "txn.h"
#include "toolkit.h"
#include "lock.h"
#include "nats.h" /* a build without libnats answers IDEM_UNIMPLEMENTED there */

#endif

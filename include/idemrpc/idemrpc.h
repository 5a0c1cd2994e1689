/* idemrpc umbrella header. */
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

#endif

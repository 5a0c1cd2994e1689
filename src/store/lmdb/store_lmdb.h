/* LMDB-specific limits of idem_store. */
#ifndef IDEMRPC_STORE_LMDB_H
#define IDEMRPC_STORE_LMDB_H

#define IDEM_LMDB_MAX_DBS 33 /* named databases per env: 4 of idemrpc, 29 business (as in 0.1) */

#endif

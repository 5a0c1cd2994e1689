/* LMDB-specific limits of idem_store. */
#ifndef IDEMRPC_STORE_LMDB_H
#define IDEMRPC_STORE_LMDB_H

#define IDEM_LMDB_MAX_DBS 32 /* named databases per env: 4 of idemrpc, the rest business */

#endif

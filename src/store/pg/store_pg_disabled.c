/* The PostgreSQL backend in a build without libpq (-Dpostgres=disabled, or auto without
 * libpq installed). meson compiles this file instead of store_pg.c: the public entry
 * point stays, so programs that offer PostgreSQL as an option link against either build
 * and learn at run time that it is missing. */
#include "internal.h"

#include "idemrpc/txn.h"

idem_code idem_store_open_postgres(idem_store **out, const char *conninfo, size_t pool_size)
{
    (void)conninfo;
    (void)pool_size;
    *out = NULL;
    return idem__err(IDEM_UNIMPLEMENTED, "built without PostgreSQL support (-Dpostgres=disabled)");
}

idem_code idem_store_open_postgres_ex(idem_store **out, const char *conninfo,
                                      const idem_pg_opts *opts)
{
    (void)opts;
    return idem_store_open_postgres(out, conninfo, 0);
}

struct pg_conn *idem_txn_pg_conn(idem_txn *t)
{
    (void)t;
    return NULL;
}

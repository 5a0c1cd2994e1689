/* The PostgreSQL backend in a build without libpq (-Dpostgres=disabled, or auto without
 * libpq installed). meson compiles this file instead of store_pg.c: the public entry
 * point stays, so programs that offer PostgreSQL as an option link against either build
 * and learn at run time that it is missing. */
#include "internal.h"

idem_code idem_store_open_postgres(idem_store **out, const char *conninfo, size_t pool_size)
{
    (void)conninfo;
    (void)pool_size;
    *out = NULL;
    return idem__err(IDEM_UNIMPLEMENTED, "built without PostgreSQL support (-Dpostgres=disabled)");
}

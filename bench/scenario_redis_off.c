/* Scenarios r–u in a build without hiredis (-Dredis=disabled or not installed): every
 * cell fails and says why. */
#include <stdio.h>

#include "bench.h"

int run_redis(const scenario *sc, cell *c, cell_stats *out)
{
    (void)sc, (void)c;
    return cell_fail(out, "idemrpc-bench was built without hiredis");
}

void redis_preamble(void)
{
    printf("r-u: this idemrpc-bench was built without hiredis: those cells fail\n");
}

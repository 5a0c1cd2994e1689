/* w in a build without libnats (-Dnats=disabled): nothing to measure. */
#include <stdio.h>

#include "bench.h"

int run_nats(void)
{
    fprintf(stderr, "w: built without NATS support (-Dnats=disabled)\n");
    return -1;
}

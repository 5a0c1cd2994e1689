#include "cli.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

bool cli_parse_u64(const char *prog, const char *opt, const char *arg, uint64_t min, uint64_t max,
                   uint64_t *out)
{
    char *end;
    unsigned long long v;

    /* strtoull alone would accept " 5", "+5" and "-5" (as a huge number). */
    if (arg[0] >= '0' && arg[0] <= '9') {
        errno = 0;
        v = strtoull(arg, &end, 10);
        if (errno == 0 && *end == '\0' && v >= min && v <= max) {
            *out = (uint64_t)v;
            return true;
        }
    }
    fprintf(stderr, "%s: %s: '%s' is not a number from %" PRIu64 " to %" PRIu64 "\n", prog, opt,
            arg, min, max);
    return false;
}

#ifndef IDEMRPC_VERSION
#error "IDEMRPC_VERSION comes from meson.build (tools/meson.build)"
#endif

void cli_print_version(const char *prog)
{
    printf("%s %s\n", prog, IDEMRPC_VERSION);
}

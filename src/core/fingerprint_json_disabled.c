/* idem_fingerprint_json in a build without jansson: a method cannot be registered with
 * it (fingerprint.c says UNIMPLEMENTED), so this never runs; it refuses if it does. */
#include "internal.h"

bool idem__fingerprint_json_built(void)
{
    return false;
}

char *idem__json_canonical(const void *payload, size_t len, size_t *n)
{
    (void)payload, (void)len, (void)n;
    return NULL;
}

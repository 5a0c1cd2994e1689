/* The canonical form of a JSON payload for idem_fingerprint_json (fingerprint.c): parsed
 * by jansson and dumped back with sorted keys and no whitespace. */
#include <jansson.h>
#include <stdlib.h>

#include "internal.h"

#define CANON_FLAGS (JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY)

bool idem__fingerprint_json_built(void)
{
    return true;
}

char *idem__json_canonical(const void *payload, size_t len, size_t *n)
{
    json_error_t err;
    json_t *j = json_loadb(payload != NULL ? payload : "", len,
                           JSON_DECODE_ANY | JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &err);
    if (j == NULL) {
        return NULL;
    }
    *n = json_dumpb(j, NULL, 0, CANON_FLAGS);
    char *canon = *n > 0 ? malloc(*n) : NULL;
    if (canon != NULL && json_dumpb(j, canon, *n, CANON_FLAGS) != *n) {
        free(canon);
        canon = NULL;
    }
    json_decref(j);
    return canon;
}

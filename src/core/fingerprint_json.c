/* The canonical form of a JSON payload for idem_fingerprint_json (fingerprint.c): parsed
 * by jansson and dumped back with sorted keys and no whitespace. jansson holds a real
 * number as a double, which cannot tell two decimals apart past DBL_DIG significant
 * digits (100000000000000001.0 and …002.0 are one double), nor below the smallest
 * normal double: a payload with such a number is refused rather than made the same
 * request as another amount. */
#include <ctype.h>
#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define CANON_FLAGS (JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY)

bool idem__fingerprint_json_built(void)
{
    return true;
}

/* Whether the real number whose text starts at p (valid JSON) is one double alone
 * stands for; *len its length. */
static bool real_exact(const char *p, const char *end, size_t *len)
{
    const char *q = p + (*p == '-');
    size_t digits = 0, zeros = 0; /* significant digits, trailing zeros among them */
    bool real = false, nonzero = false;
    for (; q < end && (isdigit((unsigned char)*q) || *q == '.'); q++) {
        if (*q == '.') {
            real = true;
        } else if (*q != '0' || nonzero) {
            nonzero = true;
            digits++;
            zeros = *q == '0' ? zeros + 1 : 0;
        }
    }
    for (; q < end &&
           (*q == 'e' || *q == 'E' || *q == '+' || *q == '-' || isdigit((unsigned char)*q));
         q++) {
        real = true;
    }
    *len = (size_t)(q - p);
    if (!real || !nonzero) {
        return true; /* an integer (jansson's are exact or refused), or a zero */
    }
    char buf[64];
    if (digits - zeros > DBL_DIG || *len >= sizeof(buf)) {
        return false;
    }
    memcpy(buf, p, *len);
    buf[*len] = '\0';
    double v = fabs(strtod(buf, NULL));
    return v >= DBL_MIN && v <= DBL_MAX;
}

/* Whether every number outside the strings of the JSON text [p, end) is exact. */
static bool numbers_exact(const char *p, const char *end)
{
    bool in_string = false;
    while (p < end) {
        size_t len = 1;
        if (in_string) {
            len = *p == '\\' ? 2 : 1;
            in_string = *p != '"';
        } else if (*p == '"') {
            in_string = true;
        } else if ((*p == '-' || isdigit((unsigned char)*p)) && !real_exact(p, end, &len)) {
            return false;
        }
        p += len;
    }
    return true;
}

char *idem__json_canonical(const void *payload, size_t len, size_t *n)
{
    json_error_t err;
    json_t *j = json_loadb(payload != NULL ? payload : "", len,
                           JSON_DECODE_ANY | JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &err);
    if (j == NULL || !numbers_exact(payload, (const char *)payload + len)) {
        json_decref(j);
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

/* Helpers shared by the toolkit's files (state_machine.c, versioned.c, consume.c, ...). */
#ifndef IDEMRPC_TOOLKIT_INTERNAL_H
#define IDEMRPC_TOOLKIT_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "internal.h"

/* Big-endian u64: byte order = numeric order, so keys built with it sort by number. */
static inline void idem__put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (56 - 8 * i));
    }
}

static inline uint64_t idem__get_be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* Length of s if it is 1..max bytes, else 0. */
static inline size_t idem__bounded_len(const char *s, size_t max)
{
    size_t n = s != NULL ? strnlen(s, max + 1) : 0;
    return n <= max ? n : 0;
}

#endif

/* Helpers shared by the toolkit's files (state_machine.c, versioned.c, consume.c, ...). */
#ifndef IDEMRPC_TOOLKIT_INTERNAL_H
#define IDEMRPC_TOOLKIT_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "internal.h"

/* Length of s if it is 1..max bytes, else 0. */
static inline size_t idem__bounded_len(const char *s, size_t max)
{
    size_t n = s != NULL ? strnlen(s, max + 1) : 0;
    return n <= max ? n : 0;
}

#endif

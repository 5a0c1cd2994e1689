/* The protobuf wire format's varints, for the walks protobuf-c does not do itself:
 * codec.c (a NUL in a string, the request payload borrowed in place) and replay.c
 * (the stored reply checked and completed as bytes). */
#ifndef IDEMRPC_WIRE_H
#define IDEMRPC_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A varint of up to 64 bits at *p (advanced past it); false when it runs past end. */
static inline bool read_varint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; *p < end && shift < 64; shift += 7) {
        uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            return true;
        }
    }
    return false;
}

/* The bytes v takes as a varint. */
static inline size_t varint_size(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* Writes v as a varint at p; past it. */
static inline uint8_t *put_varint(uint8_t *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

#endif

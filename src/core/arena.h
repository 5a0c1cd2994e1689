/* A per-call arena for protobuf-c (ProtobufCAllocator): a decoded message and its
 * strings live in buf, or in chunks malloc'd when buf is full, and go all at once with
 * idem__arena_reset (the allocator's free does nothing). Used for the server's request
 * decode (codec.c) and the client's reply decode. The arena must not move while a
 * message lives in it. */
#ifndef IDEMRPC_ARENA_H
#define IDEMRPC_ARENA_H

#include <stddef.h>

#include "idemrpc.pb-c.h"

#define IDEM_ARENA_BYTES 2048
typedef struct idem_arena_chunk idem_arena_chunk;
typedef struct idem_arena {
    ProtobufCAllocator pa; /* allocator_data is the arena */
    size_t used;
    idem_arena_chunk *chunks;
    _Alignas(16) unsigned char buf[IDEM_ARENA_BYTES];
} idem_arena;

void idem__arena_init(idem_arena *a);
void idem__arena_reset(idem_arena *a); /* frees the chunks; the arena is empty again */
/* size bytes, 16-byte aligned, that live until the reset; NULL when out of memory. */
void *idem__arena_alloc(idem_arena *a, size_t size);

/* A Response decoded into a (empty, initialised); its payload, when it occurs once,
 * points into buf, which must outlive it. NULL when buf is not a Response (a is then
 * empty again). */
Idem__V1__Response *idem__decode_response_arena(const void *buf, size_t len, idem_arena *a);

#endif

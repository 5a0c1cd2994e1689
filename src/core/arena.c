/* The per-call arena (arena.h): protobuf-c's allocations bump through the arena's own
 * buffer, 16-byte aligned, then go to malloc'd chunks chained for the reset; nothing is
 * freed one at a time, so a decoded message costs no free() per field. */
#include <stdint.h>
#include <stdlib.h>

#include "arena.h"

struct idem_arena_chunk {
    idem_arena_chunk *next;
    _Alignas(16) uint8_t data[];
};

#define ARENA_ALIGN ((size_t)16)

void *idem__arena_alloc(idem_arena *a, size_t size)
{
    size_t n = (size + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1);
    if (n >= size && n <= sizeof(a->buf) - a->used) {
        void *p = a->buf + a->used;
        a->used += n;
        return p;
    }
    if (size > SIZE_MAX - sizeof(idem_arena_chunk)) {
        return NULL;
    }
    idem_arena_chunk *c = malloc(sizeof(*c) + size);
    if (c == NULL) {
        return NULL;
    }
    c->next = a->chunks;
    a->chunks = c;
    return c->data;
}

static void *arena_alloc(void *arg, size_t size)
{
    return idem__arena_alloc(arg, size);
}

static void arena_free(void *arg, void *p)
{
    (void)arg, (void)p; /* everything goes at once, in idem__arena_reset */
}

void idem__arena_init(idem_arena *a)
{
    a->pa.alloc = arena_alloc;
    a->pa.free = arena_free;
    a->pa.allocator_data = a;
    a->used = 0;
    a->chunks = NULL;
}

void idem__arena_reset(idem_arena *a)
{
    for (idem_arena_chunk *c = a->chunks, *next; c != NULL; c = next) {
        next = c->next;
        free(c);
    }
    a->chunks = NULL;
    a->used = 0;
}

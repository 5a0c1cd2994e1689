/* The allocation count behind the allocs/c column. This binary defines malloc, calloc
 * and realloc, so every call to them in the process (libidemrpc, nng, protobuf-c,
 * LMDB, libcrypto, hiredis, libpq, glibc itself: ELF symbol interposition, which glibc
 * supports, see "Replacing malloc" in its manual) comes here first, is counted and goes
 * on to glibc's own allocator through its __libc_* entry points. free and the aligned
 * allocators stay glibc's: the same allocator, so every pointer goes back where it came
 * from. Not counted: posix_memalign, aligned_alloc, memalign, valloc, direct mmap.
 *
 * The count is sharded over cache lines by thread (a thread takes the next shard at its
 * first allocation) so that counting does not make the threads contend; a reader sums
 * the shards. Only idemrpc-bench has this, and only without a sanitizer: ASan, TSan
 * and MSan bring their own malloc, which these definitions would bypass. */
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>

#include "bench.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) ||                         \
    __has_feature(memory_sanitizer)
#define ALLOC_COUNT_OFF 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ALLOC_COUNT_OFF 1
#endif

#ifdef ALLOC_COUNT_OFF

double alloc_count(void)
{
    return NAN;
}

#else

#define SHARDS 32

extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);

static struct {
    _Alignas(64) atomic_ullong n;
} shards[SHARDS];
static atomic_uint next_shard;
static _Thread_local unsigned my_shard; /* index + 1; 0 until the first allocation */

static void count_one(void)
{
    if (my_shard == 0) {
        my_shard = atomic_fetch_add_explicit(&next_shard, 1, memory_order_relaxed) % SHARDS + 1;
    }
    atomic_fetch_add_explicit(&shards[my_shard - 1].n, 1, memory_order_relaxed);
}

void *malloc(size_t n)
{
    count_one();
    return __libc_malloc(n);
}

void *calloc(size_t n, size_t size)
{
    count_one();
    return __libc_calloc(n, size);
}

void *realloc(void *p, size_t n)
{
    count_one();
    return __libc_realloc(p, n);
}

double alloc_count(void)
{
    unsigned long long sum = 0;
    for (int i = 0; i < SHARDS; i++) {
        sum += atomic_load_explicit(&shards[i].n, memory_order_relaxed);
    }
    return (double)sum;
}

#endif

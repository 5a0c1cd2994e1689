/* The self-contained helpers of src/supplemental/ (util.c, sha256.c): clocks,
 * randomness, encodings, SHA-256, the outage retry. They use nothing of the library
 * above them; src/core/internal.h includes this header. */
#ifndef IDEMRPC_SUPPLEMENTAL_H
#define IDEMRPC_SUPPLEMENTAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

uint64_t idem__now_ms(void);  /* CLOCK_REALTIME, unix ms: stored in records */
uint64_t idem__mono_ms(void); /* CLOCK_MONOTONIC: for waits and timeouts */
uint64_t idem__mono_us(void);
void idem__sleep_ms(uint64_t ms); /* the whole time, across signals */

/* Riding out a transient store failure (a database restarting, a full store): up to
 * IDEM_OUTAGE_RETRY_MS of attempts, pausing 10 ms, doubled up to 500 ms, between them.
 *   idem_outage o = idem__outage_start();
 *   do { code = attempt(); } while (idem__outage_again(&o, code == IDEM_UNAVAILABLE)); */
#define IDEM_OUTAGE_RETRY_MS 10000u
typedef struct idem_outage {
    uint64_t give_up, backoff;
} idem_outage;
idem_outage idem__outage_start(void);
/* True, after a pause, when a transient failure is worth another attempt. */
bool idem__outage_again(idem_outage *o, bool transient);

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

static inline void idem__put_be32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) {
        p[i] = (uint8_t)(v >> (24 - 8 * i));
    }
}

static inline uint32_t idem__get_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* a + b, at most UINT64_MAX: a "forever" TTL must not wrap into the past. */
static inline uint64_t idem__add_sat(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}
/* Timed waits run on the monotonic clock, so a wall-clock step (NTP) cannot stretch
 * or cut them: a condition variable made by idem__cond_init, waited on until
 * idem__abs_timespec(wait_ms). */
void idem__cond_init(pthread_cond_t *cv);
void idem__abs_timespec(struct timespec *ts, uint64_t wait_ms); /* MONOTONIC now + wait */

/* Fills buf from getrandom(2) (the kernel CSPRNG). Returns false only if the kernel
 * refuses, which callers treat as IDEM_INTERNAL. */
bool idem__random(void *buf, size_t len);
uint64_t idem__random_u64(void);
double idem__random_unit(void); /* [0,1), for jitter; not for secrets */

/* bytes fresh random bytes as lowercase hex into out (2*bytes+1): request ids and
 * generated keys. false when the kernel refused (out then holds zeros). */
bool idem__random_hex(char *out, size_t bytes);

/* A generated idempotency key, 32 lowercase hex digits: the wall clock's unix ms in 48
 * bits, then 80 fresh random bits (UUIDv7's layout), so that keys made in a later
 * millisecond sort later and a store's new records land next to each other (docs/performance.md:
 * random keys make every new record touch a cold page of a large store). false when
 * the kernel refused the random bits. */
bool idem__ordered_key_hex(char out[33]);

/* Lowercase hex of len bytes into out (2*len+1). */
void idem__hex(char *out, const void *bytes, size_t len);
/* Unpadded base64url of len bytes into out (4*ceil(len/3)+1). */
void idem__base64url(char *out, const void *bytes, size_t len);

bool idem__utf8_valid(const char *s, size_t len);

/* SHA-256. */
/* false only when out of memory (out is then undefined). */
bool idem__sha256(const void *const *parts, const size_t *lens, size_t n, uint8_t out[32]);

/* SHA-256 over each part prefixed with its be32 length (so that no two lists of parts
 * run together), then tail (tail_len bytes, may be NULL). n <= 8. */
bool idem__lp_sha256(const char *const *parts, size_t n, const void *tail, size_t tail_len,
                     uint8_t out[32]);

/* strdup that returns NULL only on ENOMEM; NULL in → "". */
char *idem__strdup(const char *s);

#endif

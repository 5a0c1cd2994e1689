/* Clocks, randomness and encodings used across the library. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "supplemental.h"

uint64_t idem__now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t idem__mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t idem__mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

void idem__sleep_ms(uint64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

idem_outage idem__outage_start(void)
{
    return (idem_outage){.give_up = idem__mono_ms() + IDEM_OUTAGE_RETRY_MS, .backoff = 10};
}

bool idem__outage_again(idem_outage *o, bool transient)
{
    if (!transient || idem__mono_ms() + o->backoff > o->give_up) {
        return false;
    }
    idem__sleep_ms(o->backoff);
    o->backoff = o->backoff * 2 > 500 ? 500 : o->backoff * 2;
    return true;
}

void idem__cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

void idem__abs_timespec(struct timespec *ts, uint64_t wait_ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += (time_t)(wait_ms / 1000u);
    ts->tv_nsec += (long)(wait_ms % 1000u) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

bool idem__random(void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = getrandom(p, len, 0);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return false;
        }
        p += n;
        len -= (size_t)n;
    }
    return true;
}

uint64_t idem__random_u64(void)
{
    uint64_t v = 0;
    while (!idem__random(&v, sizeof(v)) || v == 0) {
        /* getrandom only fails before the pool is seeded or with a bad buffer; spin
         * rather than return a predictable value. */
    }
    return v;
}

double idem__random_unit(void)
{
    return (double)(idem__random_u64() >> 11) / (double)(UINT64_C(1) << 53);
}

bool idem__random_hex(char *out, size_t bytes)
{
    uint8_t rnd[32] = {0};
    bool ok = bytes <= sizeof(rnd) && idem__random(rnd, bytes);
    idem__hex(out, rnd, bytes <= sizeof(rnd) ? bytes : 0);
    return ok;
}

bool idem__ordered_key_hex(char out[33])
{
    uint8_t b[16];
    uint64_t ms = idem__now_ms();
    for (int i = 0; i < 6; i++) {
        b[i] = (uint8_t)(ms >> (40 - 8 * i));
    }
    bool ok = idem__random(b + 6, sizeof(b) - 6);
    idem__hex(out, b, sizeof(b));
    return ok;
}

void idem__hex(char *out, const void *bytes, size_t len)
{
    static const char digits[] = "0123456789abcdef";
    const uint8_t *b = bytes;
    for (size_t i = 0; i < len; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * len] = '\0';
}

void idem__base64url(char *out, const void *bytes, size_t len)
{
    static const char alphabet[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    const uint8_t *b = bytes;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 3) {
        uint32_t v = (uint32_t)b[i] << 16;
        size_t n = len - i < 3 ? len - i : 3;
        if (n > 1) {
            v |= (uint32_t)b[i + 1] << 8;
        }
        if (n > 2) {
            v |= b[i + 2];
        }
        out[o++] = alphabet[(v >> 18) & 63];
        out[o++] = alphabet[(v >> 12) & 63];
        if (n > 1) {
            out[o++] = alphabet[(v >> 6) & 63];
        }
        if (n > 2) {
            out[o++] = alphabet[v & 63];
        }
    }
    out[o] = '\0';
}

/* Well-formed UTF-8 per RFC 3629: no overlongs, no surrogates, <= U+10FFFF, no NUL
 * (a NUL would truncate keys that are used as C strings). */
bool idem__utf8_valid(const char *s, size_t len)
{
    const uint8_t *p = (const uint8_t *)s, *end = p + len;
    while (p < end) {
        uint8_t c = *p;
        size_t n;
        uint32_t cp;
        if (c == 0) {
            return false;
        } else if (c < 0x80) {
            p++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 1, cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            n = 2, cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            n = 3, cp = c & 0x07;
        } else {
            return false;
        }
        if ((size_t)(end - p) <= n) {
            return false;
        }
        for (size_t i = 1; i <= n; i++) {
            if ((p[i] & 0xC0) != 0x80) {
                return false;
            }
            cp = (cp << 6) | (p[i] & 0x3F);
        }
        static const uint32_t min_cp[4] = {0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
            return false;
        }
        p += n + 1;
    }
    return true;
}

char *idem__strdup(const char *s)
{
    return strdup(s != NULL ? s : "");
}

/* The history: one JSON object per line, {"t":MS,"ev":EV,"name":"value",...}, written
 * under one mutex and flushed per line so that a campaign that dies leaves a readable
 * prefix. The reader understands exactly what the writer writes (string fields with \"
 * and \\ escapes), not JSON in general. Also the small shared helpers (clock, RNG, a
 * free port). */
#include <arpa/inet.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "chaos.h"
#include "json.h"

static pthread_mutex_t history_mu = PTHREAD_MUTEX_INITIALIZER;
static FILE *history;

uint64_t chaos_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

void chaos_sleep_ms(uint64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

int chaos_free_port(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0) {
        port = ntohs(a.sin_port);
    }
    if (fd >= 0) {
        close(fd);
    }
    return port;
}

int chaos_connect_local(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

uint64_t chaos_rand(uint64_t *state)
{
    uint64_t x = *state ? *state : 0x9e3779b97f4a7c15ull;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545f4914f6cdd1dull;
}

uint64_t chaos_between(uint64_t *state, uint64_t lo, uint64_t hi)
{
    return lo + chaos_rand(state) % (hi - lo + 1);
}

uint64_t chaos_digest(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ b[i]) * 0x100000001b3ull;
    }
    return h;
}

bool chaos_history_open(const char *path)
{
    history = fopen(path, "w");
    return history != NULL;
}

void chaos_history_close(void)
{
    pthread_mutex_lock(&history_mu);
    if (history != NULL) {
        fclose(history);
        history = NULL;
    }
    pthread_mutex_unlock(&history_mu);
}

void chaos_history_event(const char *ev, size_t n, const char *const *fields)
{
    pthread_mutex_lock(&history_mu);
    if (history != NULL) {
        fprintf(history, "{\"t\":%" PRIu64 ",\"ev\":\"%s\"", chaos_now_ms(), ev);
        for (size_t i = 0; i < n; i++) {
            fprintf(history, ",\"%s\":", fields[2 * i]);
            idem__json_fputs(history, fields[2 * i + 1]);
        }
        fputs("}\n", history);
        fflush(history);
    }
    pthread_mutex_unlock(&history_mu);
}

bool chaos_history_field(const char *line, const char *name, char *buf, size_t cap)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", name);
    const char *p = strstr(line, pat);
    size_t o = 0;
    if (p == NULL || cap == 0) {
        return false;
    }
    p += strlen(pat);
    if (*p != '"') { /* a number */
        while (*p >= '0' && *p <= '9' && o + 1 < cap) {
            buf[o++] = *p++;
        }
        buf[o] = '\0';
        return o > 0;
    }
    for (p++; *p != '\0' && *p != '"' && o + 1 < cap; p++) {
        if (*p == '\\' && p[1] != '\0') {
            p++;
        }
        buf[o++] = *p;
    }
    buf[o] = '\0';
    return *p == '"';
}

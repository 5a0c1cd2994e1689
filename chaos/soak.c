/* idemrpc-soak: many distinct keys through a live server with a short result TTL, to
 * show the sweeper keeping the store bounded. Prints, every interval, the calls done,
 * the process RSS, the records in the store and the LMDB pages in use.
 *
 *   idemrpc-soak [--keys N] [--clients K] [--ttl-ms T] [--seconds S] [--every-ms E]
 *   defaults:      1000000   8            2000         600           2000
 *
 * Bounded: stops after N keys or S seconds, whichever comes first. Runs on
 * tcp://127.0.0.1:<free port> with a non-durable (MDB_NOSYNC) store: this measures
 * boundedness, not fsync. */
#include <ftw.h>
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>

#include "cli.h"

static struct {
    long keys, clients, ttl_ms, seconds, every_ms;
} cfg = {1000000, 8, 2000, 600, 2000};

static atomic_long next_key, done, failed;
static atomic_bool stop;
static char url[64];

static idem_code h_put(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    return idem_call_reply(call, IDEM_OK, p, n);
}

static void *client_main(void *arg)
{
    (void)arg;
    idem_client *c;
    const char *u = url;
    if (idem_client_open(&c, &u, 1, NULL) != IDEM_OK) {
        return NULL;
    }
    char key[32], payload[64];
    memset(payload, 'p', sizeof(payload));
    while (!atomic_load(&stop)) {
        long k = atomic_fetch_add(&next_key, 1);
        if (k >= cfg.keys) {
            break;
        }
        snprintf(key, sizeof(key), "soak-%ld", k);
        idem_request q = {.method = "soak.Store/Put",
                          .idempotency_key = key,
                          .payload = payload,
                          .payload_len = sizeof(payload)};
        idem_result r;
        atomic_fetch_add(idem_client_call(c, &q, &r) == IDEM_OK ? &done : &failed, 1);
        idem_result_clear(&r);
    }
    idem_client_close(c);
    return NULL;
}

static long rss_kib(void)
{
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f != NULL) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2) {
            resident = 0;
        }
        fclose(f);
    }
    return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: idemrpc-soak [--keys N] [--clients K] [--ttl-ms T] [--seconds S] "
               "[--every-ms E]\n"
               "  --keys N      distinct keys to call (default 1000000)\n"
               "  --clients K   client threads (default 8; 0 means 1)\n"
               "  --ttl-ms T    the server's result TTL (default 2000)\n"
               "  --seconds S   stop after S seconds at the latest (default 600)\n"
               "  --every-ms E  report period (default 2000; 0 means 1000)\n");
}

/* The field of cfg that option opt sets. */
static long *option_field(int opt)
{
    switch (opt) {
    case 'k':
        return &cfg.keys;
    case 'c':
        return &cfg.clients;
    case 't':
        return &cfg.ttl_ms;
    case 's':
        return &cfg.seconds;
    case 'e':
        return &cfg.every_ms;
    default:
        return NULL;
    }
}

/* True to run; false with *status the exit status (0 after --help, 2 after a usage
 * error, which getopt_long or cli_parse_u64 has named). */
static bool parse(int argc, char **argv, int *status)
{
    static const struct option longs[] = {{"keys", required_argument, NULL, 'k'},
                                          {"clients", required_argument, NULL, 'c'},
                                          {"ttl-ms", required_argument, NULL, 't'},
                                          {"seconds", required_argument, NULL, 's'},
                                          {"every-ms", required_argument, NULL, 'e'},
                                          {"help", no_argument, NULL, 'h'},
                                          {NULL, 0, NULL, 0}};
    char name[32];
    int opt, index;
    uint64_t v;

    *status = CLI_USAGE_ERROR;
    while ((opt = getopt_long(argc, argv, "h", longs, &index)) != -1) {
        if (opt == 'h') {
            usage(stdout);
            *status = 0;
            return false;
        }
        if (opt == '?') {
            usage(stderr);
            return false;
        }
        snprintf(name, sizeof(name), "--%s", longs[index].name);
        if (!cli_parse_u64("idemrpc-soak", name, optarg, 0, LONG_MAX, &v)) {
            usage(stderr);
            return false;
        }
        *option_field(opt) = (long)v;
    }
    if (optind < argc) {
        fprintf(stderr, "idemrpc-soak: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return false;
    }
    cfg.clients = cfg.clients > 0 ? cfg.clients : 1;
    cfg.every_ms = cfg.every_ms > 0 ? cfg.every_ms : 1000;
    return true;
}

int main(int argc, char **argv)
{
    int status;
    if (!parse(argc, argv, &status)) {
        return status;
    }
    char dir[] = "/tmp/idemrpc-soak-XXXXXX";
    idem_store *st;
    idem_server *srv;
    idem_server_opts o;
    if (mkdtemp(dir) == NULL || idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NOSYNC) != IDEM_OK) {
        fprintf(stderr, "soak: store: %s\n", idem_errmsg());
        return 1;
    }
    idem_server_opts_init(&o);
    o.store = st;
    o.result_ttl_ms = (uint64_t)cfg.ttl_ms;
    o.sweep_interval_ms = 200;
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED, .lease_ms = 5000};
    if (idem_server_create(&srv, &o) != IDEM_OK ||
        idem_server_register(srv, "soak.Store/Put", h_put, NULL, &m) != IDEM_OK ||
        idem_server_listen(srv, "tcp://127.0.0.1:0") != IDEM_OK) {
        fprintf(stderr, "soak: server: %s\n", idem_errmsg());
        return 1;
    }
    snprintf(url, sizeof(url), "tcp://127.0.0.1:%d", idem_server_port(srv));
    printf("soak: %ld keys, %ld clients, ttl %ld ms, sweep every 200 ms, limit %ld s\n", cfg.keys,
           cfg.clients, cfg.ttl_ms, cfg.seconds);
    printf("%8s %10s %8s %10s %10s %10s\n", "t_s", "calls", "failed", "rss_kib", "records",
           "map_kib");
    pthread_t *t = calloc((size_t)cfg.clients, sizeof(pthread_t));
    for (long i = 0; i < cfg.clients; i++) {
        pthread_create(&t[i], NULL, client_main, NULL);
    }
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    size_t max_records = 0;
    for (;;) {
        struct timespec ts = {cfg.every_ms / 1000, (cfg.every_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL); /* sampling period of a report, not synchronisation */
        clock_gettime(CLOCK_MONOTONIC, &now);
        double el = (double)(now.tv_sec - start.tv_sec) + (now.tv_nsec - start.tv_nsec) / 1e9;
        idem_store_stats s;
        idem_store_stats_get(st, &s);
        max_records = s.records > max_records ? s.records : max_records;
        printf("%8.1f %10ld %8ld %10ld %10zu %10zu\n", el, atomic_load(&done), atomic_load(&failed),
               rss_kib(), s.records, s.map_used / 1024);
        fflush(stdout);
        bool finished = atomic_load(&done) + atomic_load(&failed) >= cfg.keys;
        if (finished || el >= (double)cfg.seconds) {
            break;
        }
    }
    atomic_store(&stop, true);
    for (long i = 0; i < cfg.clients; i++) {
        pthread_join(t[i], NULL);
    }
    free(t);
    idem_server_destroy(srv);
    idem_store_close(st);
    nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    printf("soak: %ld calls, %ld failed, at most %zu records in the store at once\n",
           atomic_load(&done), atomic_load(&failed), max_records);
    return atomic_load(&failed) == 0 ? 0 : 1;
}

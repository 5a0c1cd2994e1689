/* The store agent: a third process on the lmdb topology's store,
 *   idemrpc-chaos --agent --db DIR --map-size BYTES --log FILE
 * started before the servers and driven by the fault thread over a pipe (one command
 * line in, one answer line out). It is plain LMDB, as another program sharing the store
 * would be, with the servers' map size, so that its "full" is theirs.
 *
 *   ballast  "ballast N": writes ballast into the business database "app.chaos_fill"
 *            until only N bytes of the map are free (the rest of the map is business
 *            data nobody touches). Answers "ballast BYTES FREE".
 *   fill     "fill": begins a read txn and keeps it (the pin, as a long backup or
 *            report would), then writes ballast until LMDB answers MDB_MAP_FULL, in
 *            values of 64 KiB, then smaller, so that the last free pages go too. While
 *            the pin lasts LMDB reuses no page freed after it began: every writer needs
 *            fresh pages and there are none, so no write txn commits at all. Answers
 *            "full BYTES FREE".
 *   free     "free N": ends the pin (the pages freed meanwhile are reusable at once) and
 *            deletes ballast, newest first, until N bytes are free; "free all" deletes
 *            it all. Answers "freed BYTES FREE".
 *   monitor  samples the store's last committed txn id every 10 ms and logs each
 *            interval of 100 ms or more in which it did not move, as
 *            {"t":END,"ev":"no_commit","from":START,"ms":N} (CLOCK_MONOTONIC ms, as
 *            the history). Under the campaign's load a live owner commits a renewal
 *            every lease/3: a lease without any commit is a store that took no write
 *            (a process stopped holding the writer lock, a slow fsync, a full map),
 *            the checker's evidence that an owner could not renew.
 * FREE counts pages above LMDB's high-water mark and pages on its free list. Why the pin:
 * a map filled to its last page can be a dead end, since a delete needs a few free pages
 * itself and LMDB reuses the pages a txn freed only after one more commit; the pin makes
 * the way out certain without making the full store any less full. Every txn is synced
 * like the servers' own. It ends when stdin closes. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "chaos.h"
#include "cli.h"

#define FILL_DB "app.chaos_fill"
#define BIG_VALUE 65536
#define CHUNK 64 /* values per txn at the largest size: 4 MiB */
#define MONITOR_STEP_MS 10
#define MONITOR_REPORT_MS 100

typedef struct ballast {
    uint64_t id;
    size_t size;
} ballast;

static struct {
    MDB_env *env;
    MDB_dbi dbi;
    MDB_txn *pin;   /* the read txn of a fill, until the next free */
    ballast *items; /* written and committed, oldest first */
    size_t n, cap;
    uint64_t next_id;
    FILE *log;
    volatile bool stop;
} ag;

static void ballast_key(uint64_t id, char key[20])
{
    snprintf(key, 20, "b%016" PRIx64, id);
}

/* Bytes of the map that a writer could still get: above the high-water mark, or on
 * LMDB's free list (FREE_DBI, dbi 0: each value is a list of pages, its count first). */
static long long free_bytes(void)
{
    MDB_envinfo info;
    MDB_stat stat;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val k, v;
    if (mdb_env_info(ag.env, &info) != 0 || mdb_env_stat(ag.env, &stat) != 0 ||
        mdb_txn_begin(ag.env, NULL, MDB_RDONLY, &txn) != 0) {
        return -1;
    }
    size_t pages = info.me_mapsize / stat.ms_psize - (info.me_last_pgno + 1);
    if (mdb_cursor_open(txn, 0, &cur) == 0) {
        while (mdb_cursor_get(cur, &k, &v, MDB_NEXT) == 0) {
            pages += *(const size_t *)v.mv_data;
        }
        mdb_cursor_close(cur);
    }
    mdb_txn_abort(txn);
    return (long long)pages * stat.ms_psize;
}

/* Puts n values of size bytes in one txn: 0, MDB_MAP_FULL (nothing kept), or an rc. */
static int put_values(size_t n, size_t size)
{
    static unsigned char zeros[BIG_VALUE];
    MDB_txn *txn;
    if (ag.n + n > ag.cap) {
        size_t cap = ag.cap ? ag.cap * 2 : 4096;
        ballast *grown = realloc(ag.items, (cap > ag.n + n ? cap : ag.n + n) * sizeof(*grown));
        if (grown == NULL) {
            return ENOMEM;
        }
        ag.items = grown;
        ag.cap = cap > ag.n + n ? cap : ag.n + n;
    }
    int rc = mdb_txn_begin(ag.env, NULL, 0, &txn);
    for (size_t i = 0; i < n && rc == 0; i++) {
        char key[20];
        ballast_key(ag.next_id + i, key);
        MDB_val k = {strlen(key), key}, v = {size, zeros};
        if ((rc = mdb_put(txn, ag.dbi, &k, &v, 0)) != 0) {
            mdb_txn_abort(txn);
        }
    }
    if (rc != 0 || (rc = mdb_txn_commit(txn)) != 0) {
        return rc;
    }
    for (size_t i = 0; i < n; i++) {
        ag.items[ag.n++] = (ballast){ag.next_id++, size};
    }
    return 0;
}

/* "ballast N": big values until at most N bytes are free; the bytes written or -1. */
static long long ballast_to(long long target)
{
    long long bytes = 0, free_now;
    while ((free_now = free_bytes()) > target) {
        size_t n = (size_t)((free_now - target) / (BIG_VALUE + 4096)); /* 17 pages each */
        n = n > CHUNK ? CHUNK : n;
        if (n == 0) {
            break;
        }
        int rc = put_values(n, BIG_VALUE);
        if (rc != 0) {
            fprintf(stderr, "chaos agent: ballast: %s\n", mdb_strerror(rc));
            return rc == MDB_MAP_FULL ? bytes : -1;
        }
        bytes += (long long)(n * BIG_VALUE);
    }
    return bytes;
}

/* "fill": pins, then writes until not even one small value fits; bytes written or -1. */
static long long fill(void)
{
    static const size_t sizes[] = {BIG_VALUE, 8192, 1024, 128};
    long long bytes = 0;
    if (ag.pin == NULL && mdb_txn_begin(ag.env, NULL, MDB_RDONLY, &ag.pin) != 0) {
        ag.pin = NULL;
        return -1;
    }
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t chunk = s == 0 ? CHUNK : 8;
        for (;;) {
            int rc = put_values(chunk, sizes[s]);
            if (rc == 0) {
                bytes += (long long)(chunk * sizes[s]);
            } else if (rc == MDB_MAP_FULL && chunk > 1) {
                chunk /= 2;
            } else if (rc == MDB_MAP_FULL) {
                break;
            } else {
                fprintf(stderr, "chaos agent: fill: %s\n", mdb_strerror(rc));
                return -1;
            }
        }
    }
    return bytes;
}

/* Deletes up to max of the newest ballast values in one txn: 0 or an rc. */
static int delete_newest(size_t max, long long *freed)
{
    MDB_txn *txn;
    size_t n = ag.n;
    long long bytes = 0;
    int rc = mdb_txn_begin(ag.env, NULL, 0, &txn);
    while (rc == 0 && n > 0 && ag.n - n < max) {
        char key[20];
        ballast_key(ag.items[n - 1].id, key);
        MDB_val k = {strlen(key), key};
        if ((rc = mdb_del(txn, ag.dbi, &k, NULL)) != 0) {
            mdb_txn_abort(txn);
        }
        bytes += (long long)ag.items[--n].size;
    }
    if (rc != 0 || (rc = mdb_txn_commit(txn)) != 0) {
        return rc;
    }
    ag.n = n;
    *freed += bytes;
    return 0;
}

/* "free N": ends the pin, deletes until N bytes are free (all: target < 0); the bytes
 * deleted or -1. A full map is retried: the servers' txns give pages back meanwhile. */
static long long free_to(long long target)
{
    long long freed = 0;
    if (ag.pin != NULL) {
        mdb_txn_abort(ag.pin);
        ag.pin = NULL;
    }
    for (int failures = 0; ag.n > 0 && (target < 0 || free_bytes() < target);) {
        int rc = delete_newest(failures > 0 ? 1 : CHUNK, &freed);
        if (rc == MDB_MAP_FULL && ++failures < 500) {
            chaos_sleep_ms(10);
        } else if (rc != 0) {
            fprintf(stderr, "chaos agent: free: %s\n", mdb_strerror(rc));
            return -1;
        }
    }
    return freed;
}

static void *monitor_main(void *arg)
{
    (void)arg;
    MDB_envinfo info;
    mdb_env_info(ag.env, &info);
    size_t last_txn = info.me_last_txnid;
    uint64_t since = chaos_now_ms();
    while (!ag.stop) {
        chaos_sleep_ms(MONITOR_STEP_MS);
        mdb_env_info(ag.env, &info);
        uint64_t now = chaos_now_ms();
        if (info.me_last_txnid == last_txn) {
            continue;
        }
        if (now - since >= MONITOR_REPORT_MS) {
            fprintf(ag.log,
                    "{\"t\":%" PRIu64 ",\"ev\":\"no_commit\",\"from\":%" PRIu64 ",\"ms\":%" PRIu64
                    "}\n",
                    now, since, now - since);
            fflush(ag.log);
        }
        last_txn = info.me_last_txnid;
        since = now;
    }
    return NULL;
}

static bool agent_open(const char *dir, uint64_t map_size)
{
    MDB_txn *txn;
    int rc;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        perror(dir);
        return false;
    }
    if ((rc = mdb_env_create(&ag.env)) != 0 || (rc = mdb_env_set_maxdbs(ag.env, 4)) != 0 ||
        (rc = mdb_env_set_maxreaders(ag.env, 512)) != 0 ||
        (rc = mdb_env_set_mapsize(ag.env, (size_t)map_size)) != 0 ||
        (rc = mdb_env_open(ag.env, dir, MDB_NOTLS, 0600)) != 0 ||
        (rc = mdb_txn_begin(ag.env, NULL, 0, &txn)) != 0) {
        fprintf(stderr, "chaos agent: open %s: %s\n", dir, mdb_strerror(rc));
        return false;
    }
    if ((rc = mdb_dbi_open(txn, FILL_DB, MDB_CREATE, &ag.dbi)) != 0 ||
        (rc = mdb_txn_commit(txn)) != 0) {
        fprintf(stderr, "chaos agent: %s: %s\n", FILL_DB, mdb_strerror(rc));
        return false;
    }
    return true;
}

/* One command, one answer line on stdout: WORD BYTES FREE. */
static void serve_commands(void)
{
    char line[64];
    while (fgets(line, sizeof(line), stdin) != NULL) {
        long long n = -1, bytes;
        const char *word = "error";
        if (strcmp(line, "fill\n") == 0) {
            word = "full";
            bytes = fill();
        } else if (strcmp(line, "free all\n") == 0) {
            word = "freed";
            bytes = free_to(-1);
        } else if (sscanf(line, "free %lld", &n) == 1 && n >= 0) {
            word = "freed";
            bytes = free_to(n);
        } else if (sscanf(line, "ballast %lld", &n) == 1 && n >= 0) {
            word = "ballast";
            bytes = ballast_to(n);
        } else {
            bytes = -1;
        }
        printf("%s %lld %lld\n", bytes < 0 ? "error" : word, bytes, free_bytes());
        fflush(stdout);
    }
}

int chaos_agent(int argc, char **argv)
{
    static const struct option longs[] = {{"agent", no_argument, NULL, 'A'},
                                          {"db", required_argument, NULL, 'd'},
                                          {"map-size", required_argument, NULL, 'm'},
                                          {"log", required_argument, NULL, 'l'},
                                          {NULL, 0, NULL, 0}};
    const char *dir = NULL, *log = NULL;
    uint64_t map_size = 0;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
        if (c == 'd') {
            dir = optarg;
        } else if (c == 'l') {
            log = optarg;
        } else if (c == 'm' && !cli_parse_u64("idemrpc-chaos", "--map-size", optarg, 1 << 20,
                                              1ull << 40, &map_size)) {
            return CLI_USAGE_ERROR;
        } else if (c != 'A' && c != 'm') {
            return CLI_USAGE_ERROR;
        }
    }
    if (dir == NULL || log == NULL || map_size == 0) {
        fprintf(stderr, "usage: idemrpc-chaos --agent --db DIR --map-size BYTES --log FILE\n");
        return CLI_USAGE_ERROR;
    }
    if ((ag.log = fopen(log, "a")) == NULL) {
        perror(log);
        return 1;
    }
    if (!agent_open(dir, map_size)) {
        return 1;
    }
    pthread_t mon;
    if (pthread_create(&mon, NULL, monitor_main, NULL) != 0) {
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    serve_commands();
    if (ag.pin != NULL) {
        mdb_txn_abort(ag.pin);
    }
    ag.stop = true;
    pthread_join(mon, NULL);
    mdb_env_close(ag.env);
    fclose(ag.log);
    free(ag.items);
    return 0;
}

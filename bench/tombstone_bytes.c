/* Tombstones on LMDB (docs/semantics.md "Tombstones"): bytes per tombstone and the
 * sweep's cost. Fills N COMPLETED records (payload-sized responses) whose results have
 * expired, over E distinct expiry times (the sweep writes tombstones in expiry order,
 * then key hash: one time writes them in key order, many in a random one), sweeps them
 * into tombstones and times it, counts the pages of "tombs", "tomb_buckets" (with its
 * sub-databases) and "expiry", then times the sweep that deletes the tombstones. Prints
 * values, asserts nothing.
 *   idemrpc-tombstone-bytes [--records N] [--payload BYTES] [--batch N] [--expiries E] */
#include <getopt.h>
#include <lmdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "store.h"

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int fail(const char *what)
{
    fprintf(stderr, "tombstone-bytes: %s: %s\n", what, idem_errmsg());
    return 1;
}

/* n expired COMPLETED records of len-byte responses, every one claimed at t0, expiring
 * over t0 + 10 … t0 + 10 + spread - 1. */
static int fill(idem_store *st, size_t n, size_t len, uint64_t t0, uint64_t spread)
{
    char key[32], *resp = calloc(1, len + 1);
    if (resp == NULL) {
        return fail("out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        snprintf(key, sizeof(key), "order-%zu", i);
        idem_claim_req req = {.key = {"shop", "pay.Pay/Charge", key},
                              .now_ms = t0,
                              .lease_until_ms = t0 + 100,
                              .expires_ms = t0 + 200};
        req.fingerprint[0] = (uint8_t)i;
        idem_claim_outcome out;
        idem_record rec;
        if (idem_store_claim(st, &req, &out, &rec) != IDEM_OK ||
            idem__store_complete_at(st, &req.key, rec.owner, resp, len, t0 + 10 + i % spread, t0,
                                    0) != IDEM_OK) {
            free(resp);
            return fail("fill");
        }
        idem_record_clear(&rec);
    }
    free(resp);
    return 0;
}

/* Batches of at most batch until none is due at now: the total, and the seconds in *s. */
static int sweep(idem_store *st, uint64_t now, size_t batch, size_t *total, double *s)
{
    size_t n;
    double t = mono_s();
    *total = 0;
    do {
        if (idem_store_sweep(st, now, batch, &n) != IDEM_OK) {
            return fail("sweep");
        }
        *total += n;
    } while (n == batch);
    *s = mono_s() - t;
    return 0;
}

/* The pages of one database's tree (dbi 0: the free list, 1: the main database). */
static int tree_pages(MDB_txn *txn, MDB_dbi dbi, size_t *pages, size_t *entries)
{
    MDB_stat s;
    int rc = mdb_stat(txn, dbi, &s);
    if (rc == 0) {
        *pages = s.ms_branch_pages + s.ms_leaf_pages + s.ms_overflow_pages;
        *entries = s.ms_entries;
    }
    return rc;
}

/* Pages on the free list: each of its values is an array of page numbers, its count
 * first. */
static int free_pages(MDB_txn *txn, size_t *pages)
{
    MDB_cursor *cur;
    MDB_val k, v;
    int rc = mdb_cursor_open(txn, 0, &cur);
    *pages = 0;
    for (MDB_cursor_op op = MDB_FIRST; rc == 0 && (rc = mdb_cursor_get(cur, &k, &v, op)) == 0;
         op = MDB_NEXT) {
        size_t n;
        memcpy(&n, v.mv_data, sizeof(n));
        *pages += n;
    }
    if (rc == MDB_NOTFOUND) {
        rc = 0;
    }
    mdb_cursor_close(cur);
    return rc;
}

/* The bytes of the tombstones' databases (b: "tombs", "tomb_buckets", "expiry") and
 * their entries. mdb_stat leaves out the pages of a DUPSORT database's sub-databases:
 * "tomb_buckets" is every page in use but the other trees' and the two meta pages. */
static int stat_dbs(MDB_txn *txn, MDB_env *env, size_t b[3], size_t e[3])
{
    static const char *const others[] = {"records", "tokens", "meta", "tombs", "expiry"};
    static const int slot[] = {-1, -1, -1, 0, 2}; /* where others[i] goes in b and e */
    MDB_envinfo info;
    MDB_stat es;
    MDB_dbi dbi;
    size_t used, pages, entries, freed;
    int rc = mdb_env_info(env, &info);
    if (rc != 0 || (rc = mdb_env_stat(env, &es)) != 0 || (rc = free_pages(txn, &freed)) != 0) {
        return rc;
    }
    used = info.me_last_pgno + 1 - freed - 2; /* pages 0 and 1: the meta pages */
    for (MDB_dbi d = 0; d < 2 && rc == 0; d++) {
        if ((rc = tree_pages(txn, d, &pages, &entries)) == 0) {
            used -= pages;
        }
    }
    for (size_t i = 0; i < 5 && rc == 0; i++) {
        if ((rc = mdb_dbi_open(txn, others[i], 0, &dbi)) == 0 &&
            (rc = tree_pages(txn, dbi, &pages, &entries)) == 0) {
            used -= pages;
            if (slot[i] >= 0) {
                b[slot[i]] = pages * es.ms_psize, e[slot[i]] = entries;
            }
        }
    }
    if (rc == 0 && (rc = mdb_dbi_open(txn, "tomb_buckets", 0, &dbi)) == 0 &&
        (rc = tree_pages(txn, dbi, &pages, &e[1])) == 0) {
        b[1] = used * es.ms_psize;
    }
    return rc;
}

/* stat_dbs of the store at dir (closed: one env per process). */
static int db_bytes(const char *dir, size_t b[3], size_t e[3])
{
    MDB_env *env;
    MDB_txn *txn;
    int rc = mdb_env_create(&env);
    if (rc == 0 && (rc = mdb_env_set_maxdbs(env, 64)) == 0 &&
        (rc = mdb_env_set_mapsize(env, 1ull << 30)) == 0 &&
        (rc = mdb_env_open(env, dir, MDB_RDONLY, 0600)) == 0 &&
        (rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn)) == 0) {
        rc = stat_dbs(txn, env, b, e);
        mdb_txn_abort(txn);
    }
    mdb_env_close(env);
    if (rc != 0) {
        fprintf(stderr, "tombstone-bytes: databases: %s\n", mdb_strerror(rc));
    }
    return rc != 0;
}

static void usage(FILE *to)
{
    fputs("usage: idemrpc-tombstone-bytes [--records N (100000)] [--payload BYTES (64)]\n"
          "                               [--batch N (1000)] [--expiries E (1)]\n"
          "  Bytes per tombstone on LMDB and the sweep's cost per record and tombstone.\n",
          to);
}

/* The options into v (records, payload, batch, expiries); false (status set) to exit. */
static bool parse_args(int argc, char **argv, uint64_t v[4], int *status)
{
    static const struct option opts[] = {
        {"records", required_argument, NULL, 0}, {"payload", required_argument, NULL, 1},
        {"batch", required_argument, NULL, 2},   {"expiries", required_argument, NULL, 3},
        {"help", no_argument, NULL, 'h'},        {NULL, 0, NULL, 0}};
    static const uint64_t lo[4] = {1, 0, 1, 1}, hi[4] = {10000000, 1 << 20, 1000000, 1000000};
    int c;
    *status = CLI_USAGE_ERROR;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            *status = 0;
            return false;
        }
        if (c < 0 || c > 3 ||
            !cli_parse_u64("idemrpc-tombstone-bytes", opts[c].name, optarg, lo[c], hi[c], &v[c])) {
            usage(stderr);
            return false;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "idemrpc-tombstone-bytes: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return false;
    }
    return true;
}

int main(int argc, char **argv)
{
    uint64_t v[4] = {100000, 64, 1000, 1};
    int status;
    if (!parse_args(argc, argv, v, &status)) {
        return status;
    }
    size_t n = (size_t)v[0], len = (size_t)v[1], batch = (size_t)v[2];
    uint64_t spread = v[3];
    const uint64_t t0 = 1000000, keep = 7ull * 24 * 3600 * 1000;
    char dir[] = "/tmp/idemrpc-tombstone-bytes-XXXXXX";
    idem_store *st;
    size_t swept, b[3] = {0}, e[3] = {0};
    double made_s, gone_s;
    if (mkdtemp(dir) == NULL) {
        perror("idemrpc-tombstone-bytes: mkdtemp");
        return 1;
    }
    if (idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NOSYNC) != IDEM_OK) {
        return fail("open");
    }
    if (idem__store_tomb_keep(st, keep) != IDEM_OK || fill(st, n, len, t0, spread) != 0 ||
        sweep(st, t0 + 10 + spread, batch, &swept, &made_s) != 0) {
        idem_store_close(st);
        return 1;
    }
    idem_store_close(st);
    if (db_bytes(dir, b, e) != 0) {
        return 1;
    }
    size_t tombs = e[0] + e[1];
    printf("tombstones %zu (records swept %zu, %zu-byte responses, %llu expiry times, batches "
           "of %zu)\n",
           tombs, swept, len, (unsigned long long)spread, batch);
    /* What the expiry index still holds after the records went is the tombstones' (the
     * first layout's entries; none for the present one). */
    printf("tombstone_bytes   tombs db %.1f + tomb_buckets db %.1f + expiry db %.1f B "
           "(%zu entries) = %.1f B/tombstone\n",
           (double)b[0] / (double)tombs, (double)b[1] / (double)tombs, (double)b[2] / (double)tombs,
           e[2], (double)(b[0] + b[1] + b[2]) / (double)tombs);
    printf("sweep_to_tomb     %.2f us per record (delete record and its entry, write tombstone)\n",
           made_s * 1e6 / (double)swept);
    if (idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NOSYNC) != IDEM_OK) {
        return fail("reopen");
    }
    if (sweep(st, t0 + 10 + spread + keep, batch, &swept, &gone_s) != 0) {
        idem_store_close(st);
        return 1;
    }
    idem_store_close(st);
    printf("sweep_tombstones  %.2f us per tombstone (%zu deleted)\n", gone_s * 1e6 / (double)swept,
           swept);
    char path[sizeof(dir) + 16];
    int rc = 0;
    for (const char *const *f = (const char *const[]){"data.mdb", "lock.mdb", NULL}; *f; f++) {
        snprintf(path, sizeof(path), "%s/%s", dir, *f);
        rc |= unlink(path);
    }
    return (rc | rmdir(dir)) == 0 ? 0 : 1;
}

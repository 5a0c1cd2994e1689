/* z: the scale stores, preloaded once and cached in --scale-dir: DIR/records-N holds
 * an LMDB store of N COMPLETED records of the bench's method (64 B echo results, one
 * expiry entry each), written by the store's own bulk load (load.c: sorted keys,
 * MDB_APPEND, 100 000 records per txn), not through the network. A marker file says
 * what the directory holds; a directory whose marker matches is reused as it is. Every
 * SCALE_EVERY-th record goes in a second pass that splits the packed pages (load.c):
 * leaves end about as full as random inserts leave them, and a new key lands in a page
 * with room as often as in a live store, not in a full one every time.
 *
 * The keys: record i is "%016llx" of i * (2^64 / N) + stride/2, so the N keys are
 * sorted by i and spread evenly over the space of random 64-bit keys; a new key of a
 * timed call is a random 64-bit value in the same format (scale_new_key), which lands
 * between two stored ones at a uniformly random place, as a UUID would. Record i
 * expires at SCALE_EXPIRY_BASE + i ms: far ahead (no sweep takes it), and before any
 * expiry the bench's server gives a new record (SCALE_TTL_MS), so new entries of the
 * expiry index append as in a live store.
 *
 * A new-key cell deletes its keys again (scenario_scale.c), but the splits they caused
 * stay: the churn file counts them, and a store churned by more than 1 % of its records
 * is loaded afresh, so every run measures stores of the same shape. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "lmdb/store_lmdb.h"
#include "scale.h"

#define MARKER "idemrpc-scale.marker"
#define CHURN "idemrpc-scale.churn" /* new keys put and deleted again since the load */

void scale_key(char out[17], uint64_t n, uint64_t i)
{
    uint64_t stride = UINT64_MAX / n;
    snprintf(out, 17, "%016llx", (unsigned long long)(i * stride + stride / 2));
}

typedef struct load_arg {
    uint64_t n;
    char key[17];
} load_arg;

static void load_key_at(void *arg, size_t i, idem_key_ref *ref, uint64_t *expires_ms)
{
    load_arg *a = arg;
    scale_key(a->key, a->n, i);
    *ref = (idem_key_ref){SCALE_CALLER, METHOD, a->key};
    *expires_ms = SCALE_EXPIRY_BASE + i;
}

/* The marker's text for a store of n records. */
static void marker_text(char *buf, size_t cap, uint64_t n)
{
    snprintf(buf, cap, "idemrpc-scale format %d records %llu payload %d\n", SCALE_FORMAT,
             (unsigned long long)n, SCALE_PAYLOAD);
}

static bool marker_ok(const char *dir, uint64_t n)
{
    char path[4200], want[128], got[128] = "";
    snprintf(path, sizeof(path), "%s/" MARKER, dir);
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return false;
    }
    size_t len = fread(got, 1, sizeof(got) - 1, f);
    fclose(f);
    got[len] = '\0';
    marker_text(want, sizeof(want), n);
    return strcmp(got, want) == 0;
}

static int marker_write(const char *dir, uint64_t n)
{
    char path[4200], text[128];
    snprintf(path, sizeof(path), "%s/" MARKER, dir);
    marker_text(text, sizeof(text), n);
    FILE *f = fopen(path, "w");
    if (f == NULL || fputs(text, f) < 0) {
        if (f != NULL) {
            fclose(f);
        }
        return -1;
    }
    return fclose(f) == 0 ? 0 : -1;
}

static uint64_t churn_read(const char *dir)
{
    char path[4200];
    unsigned long long v = 0;
    snprintf(path, sizeof(path), "%s/" CHURN, dir);
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        if (fscanf(f, "%llu", &v) != 1) {
            v = 0;
        }
        fclose(f);
    }
    return v;
}

void scale_churn_add(const char *dir, uint64_t keys)
{
    char path[4200];
    uint64_t v = churn_read(dir) + keys;
    snprintf(path, sizeof(path), "%s/" CHURN, dir);
    FILE *f = fopen(path, "w");
    if (f == NULL || fprintf(f, "%llu\n", (unsigned long long)v) < 0 || fclose(f) != 0) {
        fprintf(stderr, "idemrpc-bench: cannot write %s: the store is loaded again\n", path);
        remove(path);
        snprintf(path, sizeof(path), "%s/" MARKER, dir);
        remove(path);
    }
}

/* Removes what an unfinished load left (data.mdb, lock.mdb, the marker). */
static int store_files_remove(const char *dir)
{
    static const char *const names[] = {"data.mdb", "lock.mdb", MARKER, CHURN};
    char path[4200];
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        if (remove(path) != 0 && errno != ENOENT) {
            fprintf(stderr, "idemrpc-bench: remove %s: %s\n", path, strerror(errno));
            return -1;
        }
    }
    return 0;
}

/* Drops data.mdb from the page cache after a load: the load's large writes leave it in
 * large folios, and LMDB's later 4 KiB writes into them cost (and dirty) the whole folio,
 * which a store that LMDB wrote commit by commit does not see. Read back through the map
 * it comes in pages, as after a restart. */
static void cache_drop(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/data.mdb", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) {
        fprintf(stderr, "idemrpc-bench: z: cannot drop %s from the page cache\n", path);
    }
    if (fd >= 0) {
        close(fd);
    }
}

/* Loads n records after the template into the empty store st. */
static int load_into(idem_store *st, uint64_t n, const idem_record *tmpl)
{
    load_arg a = {.n = n};
    idem__lmdb_load_src src = {
        .n = n, .every = SCALE_EVERY, .tmpl = tmpl, .key_at = load_key_at, .arg = &a};
    if (idem__lmdb_load(st, &src) != IDEM_OK) {
        fprintf(stderr, "idemrpc-bench: load: %s\n", idem_errmsg());
        return -1;
    }
    return 0;
}

int scale_store_ready(const char *dir, uint64_t n, const char *transport)
{
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "idemrpc-bench: mkdir %s: %s\n", dir, strerror(errno));
        return -1;
    }
    uint64_t churn = churn_read(dir);
    if (marker_ok(dir, n) && churn <= n / 100) {
        printf("z: %s: %llu records, reused (churn %llu)\n", dir, (unsigned long long)n,
               (unsigned long long)churn);
        return 0;
    }
    if (store_files_remove(dir) != 0) {
        return -1;
    }
    uint64_t t0 = now_ns();
    idem_record tmpl;
    idem_store *st = NULL;
    int rv = -1;
    if (idem_store_open_lmdb(&st, dir, SCALE_MAP_SIZE, 0) != IDEM_OK) {
        fprintf(stderr, "idemrpc-bench: open %s: %s\n", dir, idem_errmsg());
        return -1;
    }
    if (scale_template(st, transport, &tmpl) == 0) {
        rv = load_into(st, n, &tmpl);
        idem_record_clear(&tmpl);
    }
    idem_store_close(st);
    if (rv == 0) {
        cache_drop(dir);
    }
    if (rv == 0 && (rv = marker_write(dir, n)) != 0) {
        fprintf(stderr, "idemrpc-bench: cannot write the marker in %s\n", dir);
    }
    if (rv == 0) {
        printf("z: %s: %llu records loaded in %.1f s\n", dir, (unsigned long long)n,
               (double)(now_ns() - t0) / 1e9);
    }
    return rv;
}

/* ---- a store grown as a server grows it ---- */

/* Pages of database name in the env at dir: leaf + branch + overflow; its depth. */
static int db_pages(MDB_env *env, const char *name, size_t *pages, unsigned *depth)
{
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    MDB_stat s;
    int rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    if (rc == 0 && (rc = mdb_dbi_open(txn, name, 0, &dbi)) == 0 &&
        (rc = mdb_stat(txn, dbi, &s)) == 0) {
        *pages = s.ms_leaf_pages + s.ms_branch_pages + s.ms_overflow_pages;
        *depth = s.ms_depth;
    }
    if (txn != NULL) {
        mdb_txn_abort(txn);
    }
    return rc;
}

int scale_shape(const char *dir, scale_shape_t *out)
{
    MDB_env *env;
    MDB_envinfo info;
    int rc = mdb_env_create(&env);
    if (rc != 0) {
        return rc;
    }
    if ((rc = mdb_env_set_maxdbs(env, 64)) == 0 &&
        (rc = mdb_env_open(env, dir, MDB_RDONLY, 0600)) == 0 &&
        (rc = db_pages(env, "records", &out->records_pages, &out->records_depth)) == 0 &&
        (rc = db_pages(env, "expiry", &out->expiry_pages, &out->expiry_depth)) == 0) {
        mdb_env_info(env, &info);
        out->used_pages = info.me_last_pgno + 1;
    }
    mdb_env_close(env);
    return rc;
}

/* Claims and completes record i of the grown store as the result cache does: lease
 * 30 s, the claim's expiry the lease's end plus the TTL, the completion's now + TTL.
 * Its key: i itself when ordered, else i scattered over the 64-bit keys. */
static idem_code grow_one(idem_store *st, uint64_t i, bool ordered, const idem_record *tmpl)
{
    char key[17];
    snprintf(key, sizeof(key), "%016llx",
             (unsigned long long)(ordered ? i : i * 0x9e3779b97f4a7c15ull));
    uint64_t now = SCALE_EXPIRY_BASE + i;
    idem_claim_req req = {.key = {SCALE_CALLER, METHOD, key},
                          .owner = i + 1,
                          .now_ms = now,
                          .lease_until_ms = now + 30000,
                          .expires_ms = now + 30000 + SCALE_TTL_MS};
    idem_claim_outcome outcome;
    memcpy(req.fingerprint, tmpl->fingerprint, sizeof(req.fingerprint));
    idem_code code = idem_store_claim(st, &req, &outcome, NULL);
    if (code == IDEM_OK && outcome != IDEM_CLAIM_ACQUIRED) {
        fprintf(stderr, "idemrpc-bench: z: grown: claim of %s did not acquire\n", key);
        return IDEM_ABORTED;
    }
    return code != IDEM_OK ? code
                           : idem_store_complete(st, &req.key, i + 1, tmpl->response,
                                                 tmpl->response_len, now + 1 + SCALE_TTL_MS);
}

int scale_grow(const char *dir, uint64_t n, bool ordered, const idem_record *tmpl,
               scale_shape_t *out)
{
    idem_store *st;
    if (store_files_remove(dir) != 0 ||
        idem_store_open_lmdb(&st, dir, SCALE_MAP_SIZE,
                             IDEM_STORE_NOSYNC | IDEM_STORE_NO_GROUP_COMMIT) != IDEM_OK) {
        fprintf(stderr, "idemrpc-bench: z: grown store %s: %s\n", dir, idem_errmsg());
        return -1;
    }
    idem_code code = IDEM_OK;
    for (uint64_t i = 0; i < n && code == IDEM_OK; i++) {
        code = grow_one(st, i, ordered, tmpl);
    }
    idem_store_close(st);
    if (code != IDEM_OK) {
        fprintf(stderr, "idemrpc-bench: z: grown store: %s\n", idem_errmsg());
        return -1;
    }
    int rc = scale_shape(dir, out);
    if (rc != 0) {
        fprintf(stderr, "idemrpc-bench: z: mdb_stat %s: %s\n", dir, mdb_strerror(rc));
    }
    store_files_remove(dir);
    return rc == 0 ? 0 : -1;
}

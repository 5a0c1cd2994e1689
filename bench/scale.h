/* z: cost against the store's size (scenario_scale.c runs it, scale_load.c keeps the
 * preloaded stores). Only by --scenarios z with --scale-dir DIR. */
#ifndef IDEMRPC_BENCH_SCALE_H
#define IDEMRPC_BENCH_SCALE_H

#include <stdbool.h>
#include <stdint.h>

#include <idemrpc/idemrpc.h>

#define SCALE_FORMAT 2 /* the marker's: bump when what a load writes changes */
#define SCALE_EVERY 3  /* every 3rd record put after the appends (load.c) */
#define SCALE_PAYLOAD 64
#define SCALE_CALLER "bench"
#define SCALE_MAP_SIZE ((size_t)64 << 30) /* 10M records take ~3 GiB; a sparse map */
/* Preloaded record i expires at SCALE_EXPIRY_BASE + i ms (the year 2096); the server of
 * the timed cells keeps results SCALE_TTL_MS (100 years), so new ones expire later. */
#define SCALE_EXPIRY_BASE 4000000000000ull
#define SCALE_TTL_MS (100ull * 365 * 24 * 3600 * 1000)

/* The key of preloaded record i of n (16 hex digits, ascending in i). */
void scale_key(char out[17], uint64_t n, uint64_t i);
/* A COMPLETED record of the bench's method and payload, from one real call through a
 * server on st (the record is deleted again): what every preloaded record copies. */
int scale_template(idem_store *st, const char *transport, idem_record *out);
/* dir holds n preloaded records when this returns 0: reused when its marker says so,
 * loaded otherwise (the time it took printed). */
int scale_store_ready(const char *dir, uint64_t n, const char *transport);

/* A store's shape (mdb_stat): pages of its two big databases, their depths, and the
 * pages the file uses. */
typedef struct scale_shape_t {
    size_t records_pages, expiry_pages, used_pages;
    unsigned records_depth, expiry_depth;
} scale_shape_t;
int scale_shape(const char *dir, scale_shape_t *out); /* an LMDB error */
/* Grows a store in dir (emptied first, removed after) by n new keys through the store's
 * own claim and complete, as the result cache writes them, in random key order or
 * ascending (ordered); its shape into out. */
int scale_grow(const char *dir, uint64_t n, bool ordered, const idem_record *tmpl,
               scale_shape_t *out);

/* Counts keys put into dir's store and deleted again (reloaded past 1 % of it). */
void scale_churn_add(const char *dir, uint64_t keys);

#endif

/* LMDB env lifecycle: open (databases created), close, the read-txn pool, and the ops
 * table, this backend's only link to store.c. The layout is in lmdb_internal.h. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lmdb_internal.h"

#define DEFAULT_MAP_SIZE ((size_t)1 << 30)
#define GROUP_COMMIT_BATCH 256 /* writes per shared txn at most */

/* Environments open in this process, by directory. LMDB forbids opening one directory
 * twice in a process (its fcntl locks are per process: closing either would drop the
 * other's), so a second open fails clearly instead; share the first (opts.store). */
static pthread_mutex_t open_mu = PTHREAD_MUTEX_INITIALIZER;
static lmdb_store *open_list;

/* Enters st (dir_dev/dir_ino set) in the list; false when its directory is in it. */
static bool open_list_enter(lmdb_store *st)
{
    bool fresh = true;
    pthread_mutex_lock(&open_mu);
    for (lmdb_store *p = open_list; p != NULL && fresh; p = p->next_open) {
        fresh = !(p->dir_dev == st->dir_dev && p->dir_ino == st->dir_ino);
    }
    if (fresh) {
        st->next_open = open_list;
        open_list = st;
    }
    pthread_mutex_unlock(&open_mu);
    return fresh;
}

static void open_list_leave(lmdb_store *st)
{
    pthread_mutex_lock(&open_mu);
    for (lmdb_store **pp = &open_list; *pp != NULL; pp = &(*pp)->next_open) {
        if (*pp == st) {
            *pp = st->next_open;
            break;
        }
    }
    pthread_mutex_unlock(&open_mu);
}

/* Stats dir into st and enters it in the open list. */
static idem_code open_list_claim(lmdb_store *st, const char *dir)
{
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        return idem__err(IDEM_UNAVAILABLE, "open LMDB store %s: %s", dir, strerror(errno));
    }
    st->dir_dev = sb.st_dev;
    st->dir_ino = sb.st_ino;
    if (!open_list_enter(st)) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "LMDB store %s is already open in this process (LMDB allows one "
                         "environment per directory per process): open it once with "
                         "idem_store_open_lmdb and share it through idem_server_opts.store",
                         dir);
    }
    return IDEM_OK;
}

idem_code idem__lmdb_commit(lmdb_store *st, MDB_txn *txn)
{
    return idem__gc_commit_durable(&st->gc, txn); /* its meta page too (MDB_NOMETASYNC) */
}

/* Group commit's re-write after a failed sync (group_commit_sync.c): a key of the meta
 * db changes, so that the commit writes a new meta page. */
static idem_code sync_mark_put(MDB_txn *txn, void *ctx)
{
    lmdb_store *st = ctx;
    MDB_val k = {6, "synced"}, v;
    uint8_t b[8];
    int rc = mdb_get(txn, st->meta, &k, &v);
    if (rc != 0 && rc != MDB_NOTFOUND) {
        return idem__lmdb_code(rc, "sync mark get");
    }
    idem__put_be64(b, (rc == 0 && v.mv_size == 8 ? idem__get_be64(v.mv_data) : 0) + 1);
    v = (MDB_val){8, b};
    rc = mdb_put(txn, st->meta, &k, &v, 0);
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "sync mark put");
}

int idem__lmdb_read_begin(lmdb_store *st, MDB_txn **txn)
{
    pthread_mutex_lock(&st->rpool_mu);
    *txn = st->rpool_n > 0 ? st->rpool[--st->rpool_n] : NULL;
    pthread_mutex_unlock(&st->rpool_mu);
    if (*txn != NULL) {
        if (mdb_txn_renew(*txn) == 0) {
            return 0;
        }
        mdb_txn_abort(*txn);
    }
    return mdb_txn_begin(st->env, NULL, MDB_RDONLY, txn);
}

void idem__lmdb_read_end(lmdb_store *st, MDB_txn *txn)
{
    mdb_txn_reset(txn);
    pthread_mutex_lock(&st->rpool_mu);
    if (st->rpool_n < READ_POOL) {
        st->rpool[st->rpool_n++] = txn;
        txn = NULL;
    }
    pthread_mutex_unlock(&st->rpool_mu);
    if (txn != NULL) {
        mdb_txn_abort(txn);
    }
}

/* LMDB opens its data file without O_CLOEXEC (its lock file and its meta-page writer
 * with): a program the process starts would inherit a descriptor that reads every
 * caller's results. 0 or an errno. */
static int close_on_exec(MDB_env *env)
{
    mdb_filehandle_t fd;
    int rc = mdb_env_get_fd(env, &fd), flags;
    if (rc == 0 &&
        ((flags = fcntl(fd, F_GETFD)) < 0 || fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0)) {
        rc = errno;
    }
    return rc;
}

/* The LMDB environment of dir (st->env; closed again on failure). */
static idem_code open_env(lmdb_store *st, const char *dir, size_t map_size, unsigned flags)
{
    bool ro = (flags & IDEM_STORE_READONLY) != 0;
    /* A durable store with group commit writes meta pages unsynced: its batches wait for
     * the next sync instead (group_commit_pipe.c), one fdatasync per commit. */
    bool pipelined = !ro && !(flags & (IDEM_STORE_NOSYNC | IDEM_STORE_NO_GROUP_COMMIT));
    unsigned env_flags = MDB_NOTLS | (ro ? MDB_RDONLY : 0) |
                         ((flags & IDEM_STORE_NOSYNC) ? MDB_NOSYNC : 0) |
                         (pipelined ? MDB_NOMETASYNC : 0);
    int rc;
    if ((rc = mdb_env_create(&st->env)) != 0 ||
        (rc = mdb_env_set_maxdbs(st->env, IDEM_LMDB_MAX_DBS)) != 0 ||
        (rc = mdb_env_set_maxreaders(st->env, 512)) != 0 ||
        (rc = mdb_env_set_mapsize(st->env, map_size ? map_size : DEFAULT_MAP_SIZE)) != 0 ||
        (rc = mdb_env_open(st->env, dir, env_flags, 0600)) != 0 ||
        (rc = close_on_exec(st->env)) != 0) {
        idem_code c = idem__err(IDEM_UNAVAILABLE, "open LMDB store %s: %s", dir, mdb_strerror(rc));
        if (st->env != NULL) {
            mdb_env_close(st->env);
        }
        return c;
    }
    return IDEM_OK;
}

/* Opens the named databases in one txn; an LMDB error. create: the store's databases may
 * be created (not for IDEM_STORE_EXISTING); "meta", newer than the others, is created by
 * any read-write open (a store from before it is upgraded, not refused). */
static int open_dbis(lmdb_store *st, bool ro, bool create)
{
    MDB_txn *txn = NULL;
    unsigned dbi_flags = create ? MDB_CREATE : 0;
    int rc;
    if ((rc = mdb_txn_begin(st->env, NULL, ro ? MDB_RDONLY : 0, &txn)) != 0) {
        return rc;
    }
    if ((rc = mdb_dbi_open(txn, "records", dbi_flags, &st->records)) != 0 ||
        (rc = mdb_dbi_open(txn, "tokens", dbi_flags, &st->tokens)) != 0 ||
        (rc = mdb_dbi_open(txn, "expiry", dbi_flags, &st->expiry)) != 0) {
        mdb_txn_abort(txn);
        return rc;
    }
    rc = mdb_dbi_open(txn, "meta", ro ? 0 : MDB_CREATE, &st->meta);
    st->has_meta = rc == 0;
    st->read_only = ro;
    if (rc == 0 || (ro && rc == MDB_NOTFOUND)) { /* "tombs" came with 0.4, as "meta" did */
        rc = mdb_dbi_open(txn, "tombs", ro ? 0 : MDB_CREATE, &st->tombs);
        st->has_tombs = rc == 0;
    }
    if (rc == 0 || (ro && rc == MDB_NOTFOUND)) { /* tomb_db.c: the present layout's */
        rc = mdb_dbi_open(txn, "tomb_buckets", MDB_DUPSORT | MDB_DUPFIXED | (ro ? 0 : MDB_CREATE),
                          &st->tomb_buckets);
        st->has_tomb_buckets = rc == 0;
    }
    if (rc != 0 && !(ro && rc == MDB_NOTFOUND)) {
        mdb_txn_abort(txn);
        return rc;
    }
    return mdb_txn_commit(txn); /* commit frees txn even when it fails */
}

/* The store's format: meta "format" → be32, written by the first read-write open of a
 * store that has none (every store before 0.4 has format 1: the layout lmdb_internal.h
 * describes). A binary refuses a store of a newer format than it knows instead of
 * misreading it; older binaries ignore the key, so the way back stays open while the
 * format is unchanged. */
static idem_code format_ensure(lmdb_store *st, const char *dir)
{
    MDB_val k = {6, "format"}, v;
    MDB_txn *txn;
    uint8_t b[4];
    int rc;
    if (!st->has_meta) {
        return IDEM_OK; /* read-only, older than "meta": format 1 */
    }
    if ((rc = mdb_txn_begin(st->env, NULL, st->read_only ? MDB_RDONLY : 0, &txn)) != 0) {
        return idem__lmdb_code(rc, "format");
    }
    if ((rc = mdb_get(txn, st->meta, &k, &v)) == 0) {
        uint32_t f = v.mv_size == 4 ? idem__get_be32(v.mv_data) : UINT32_MAX;
        mdb_txn_abort(txn);
        if (f > IDEM__LMDB_FORMAT) {
            return idem__err(IDEM_FAILED_PRECONDITION,
                             "store %s has format %" PRIu32 ", newer than the %d this idemrpc "
                             "understands: open it with the release that wrote it "
                             "(docs/upgrading.md)",
                             dir, f, IDEM__LMDB_FORMAT);
        }
        return IDEM_OK;
    }
    if (rc != MDB_NOTFOUND || st->read_only) {
        mdb_txn_abort(txn);
        return rc == MDB_NOTFOUND ? IDEM_OK : idem__lmdb_code(rc, "format");
    }
    idem__put_be32(b, IDEM__LMDB_FORMAT);
    v = (MDB_val){4, b};
    if ((rc = mdb_put(txn, st->meta, &k, &v, 0)) != 0) {
        mdb_txn_abort(txn);
        return idem__lmdb_code(rc, "format");
    }
    /* Synced: the first batch's log entry builds on it (wal.h: a replay's chain). */
    if ((rc = mdb_txn_commit(txn)) == 0) {
        rc = mdb_env_sync(st->env, 1);
    }
    return rc == 0 ? IDEM_OK : idem__lmdb_code(rc, "format");
}

/* open_dbis, synced when read-write; IDEM_NOT_FOUND for an existing LMDB environment
 * without the store's databases. */
static idem_code open_databases(lmdb_store *st, const char *dir, bool ro, bool existing)
{
    int rc;
    if ((rc = open_dbis(st, ro, !ro && !existing)) == 0 &&
        (ro || (rc = mdb_env_sync(st->env, 1)) == 0)) {
        return IDEM_OK;
    }
    return existing && rc == MDB_NOTFOUND
               ? idem__err(IDEM_NOT_FOUND,
                           "%s is not an idemrpc store (an LMDB environment without its databases)",
                           dir)
               : idem__lmdb_code(rc, "open databases");
}

/* The log idem__wal_replay left (wal, or NULL), kept on a store that pipelines its
 * commits (a durable one with group commit) unless IDEM_STORE_NO_LOG: st->gc.wal, set
 * before the first write (the writer thread's); else closed. wal is closed on failure. */
static idem_code wal_keep(lmdb_store *st, const char *dir, unsigned flags, idem_wal *wal,
                          const MDB_dbi dbis[6])
{
    if (!st->gc.pipelined || (flags & IDEM_STORE_NO_LOG)) {
        idem__wal_close(wal); /* replayed only */
        return IDEM_OK;
    }
    idem_code code = idem__wal_start(&wal, dir, st->env, dbis);
    idem__gc_log_to(&st->gc, wal);
    return code;
}

/* dir/data.mdb is a file (a store, or at least an LMDB environment, lives there). */
static bool store_file_exists(const char *dir)
{
    char path[PATH_MAX];
    struct stat sb;
    int n = snprintf(path, sizeof(path), "%s/data.mdb", dir);
    return n > 0 && (size_t)n < sizeof(path) && stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* dir names a store to open: set; holding data.mdb when it must exist; else created when
 * missing (read-write). */
static idem_code store_dir_ready(const char *dir, bool ro, bool existing)
{
    if (dir == NULL || *dir == '\0') {
        return idem__err(IDEM_INVALID_ARGUMENT, "store directory not set");
    }
    if (existing && !store_file_exists(dir)) {
        return idem__err(IDEM_NOT_FOUND, "%s is not an idemrpc store (no data.mdb): nothing opened",
                         dir);
    }
    if (!ro && !existing && mkdir(dir, 0700) != 0 && errno != EEXIST) {
        return idem__err(IDEM_UNAVAILABLE, "mkdir %s: %s", dir, strerror(errno));
    }
    return IDEM_OK;
}

idem_code idem_store_open_lmdb(idem_store **out, const char *dir, size_t map_size, unsigned flags)
{
    lmdb_store *st;
    bool ro = (flags & IDEM_STORE_READONLY) != 0, existing = (flags & IDEM_STORE_EXISTING) != 0;
    idem_code code = store_dir_ready(dir, ro, existing);
    *out = NULL;
    if (code != IDEM_OK) {
        return code;
    }
    if ((st = calloc(1, sizeof(*st))) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    if ((code = open_list_claim(st, dir)) != IDEM_OK) {
        free(st);
        return code;
    }
    if ((code = open_env(st, dir, map_size, flags)) != IDEM_OK) {
        goto out;
    }
    int dead;
    mdb_reader_check(st->env, &dead); /* clear reader slots of crashed processes */
    idem_wal *wal = NULL;
    if ((code = open_databases(st, dir, ro, existing)) != IDEM_OK) {
        goto out_env;
    }
    /* A read-write open replays the log before any write, whatever its flags (wal.h: the
     * databases' open wrote nothing on a store that had one); a read-only one does not. */
    const MDB_dbi dbis[6] = {st->records, st->tokens, st->expiry,
                             st->meta,    st->tombs,  st->tomb_buckets};
    if ((!ro && (code = idem__wal_replay(&wal, dir, st->env, dbis)) != IDEM_OK) ||
        (code = format_ensure(st, dir)) != IDEM_OK) {
        goto out_env;
    }
    /* A read-only store writes nothing: no writer thread (a write fails on its own). */
    bool gc_on = !ro && !(flags & IDEM_STORE_NO_GROUP_COMMIT);
    if ((code = idem__gc_init(&st->gc, st->env, gc_on, GROUP_COMMIT_BATCH)) != IDEM_OK) {
        goto out_env;
    }
    if ((code = wal_keep(st, dir, flags, wal, dbis)) != IDEM_OK) {
        idem__gc_fini(&st->gc);
        mdb_env_close(st->env);
        goto out;
    }
    if (st->has_meta && !ro) { /* before the first write: read by the writer thread */
        st->gc.rewrite = sync_mark_put;
        st->gc.rewrite_ctx = st;
    }
    pthread_mutex_init(&st->rpool_mu, NULL);
    pthread_mutex_init(&st->db_mu, NULL);
    st->base.ops = &idem__lmdb_ops;
    *out = &st->base;
    return IDEM_OK;
out_env:
    idem__wal_close(wal);
    mdb_env_close(st->env);
out:
    open_list_leave(st);
    free(st);
    return code;
}

static void lmdb_close(idem_store *base)
{
    lmdb_store *st = (lmdb_store *)base;
    if (st != NULL) {
        idem__gc_fini(&st->gc); /* runs what is queued, then stops the writer thread */
        idem__wal_close(st->gc.wal);
        for (size_t i = 0; i < st->rpool_n; i++) {
            mdb_txn_abort(st->rpool[i]);
        }
        pthread_mutex_destroy(&st->rpool_mu);
        pthread_mutex_destroy(&st->db_mu);
        mdb_env_close(st->env);
        open_list_leave(st);
        free(st);
    }
}

const idem_store_ops idem__lmdb_ops = {
    .name = "lmdb",
    .caps = IDEM__STORE_CAP_TXN | IDEM__STORE_CAP_NONBLOCKING_READ,
    .claim = idem__lmdb_claim,
    .complete = idem__lmdb_complete,
    .release = idem__lmdb_release,
    .renew = idem__lmdb_renew,
    .get = idem__lmdb_get,
    .get_borrowed = idem__lmdb_get_borrowed,
    .del = idem__lmdb_delete,
    .sweep = idem__lmdb_sweep,
    .tomb_keep = idem__lmdb_tomb_keep,
    .tomb_get = idem__lmdb_tomb_get,
    .tomb_del = idem__lmdb_tomb_del,
    .tomb_foreach = idem__lmdb_tomb_foreach,
    .token_put = idem__lmdb_token_put,
    .token_consume = idem__lmdb_token_consume,
    .stats = idem__lmdb_stats,
    .foreach = idem__lmdb_foreach,
    .close = lmdb_close,
    .txn_begin = idem__lmdb_txn_begin,
    .txn_abort = idem__lmdb_txn_abort,
    .txn_commit = idem__lmdb_txn_commit,
    .txn_complete_commit = idem__lmdb_txn_complete_commit,
    .txn_get = idem__lmdb_txn_get,
    .txn_put = idem__lmdb_txn_put,
    .txn_del = idem__lmdb_txn_del,
    .app_get = idem__lmdb_app_get,
    .app_next = idem__lmdb_app_next,
    .txn_record = idem__lmdb_txn_record,
    .txn_claim = idem__lmdb_txn_claim,
    .claim_shared = idem__lmdb_claim_shared,
    .claim_shared_async = idem__lmdb_claim_shared_async,
    .complete_async = idem__lmdb_complete_async,
    .ticket_drop = idem__lmdb_ticket_drop,
    .ticket_wait = idem__lmdb_ticket_wait,
};

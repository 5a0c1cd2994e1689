/* The write-ahead log: open, replay, close (wal.h says what it is).
 *
 * Replay reads the header's epoch, then the entries after it while each is whole (its
 * length fits, its crc32 holds) and of that epoch. LMDB's newest meta page on disk names
 * the txnid R it recovered; entries up to R are in data.mdb already, and from there only
 * an unbroken chain R + 1, R + 2, ... is applied, in one txn, which is synced before the
 * log starts a new epoch. Each entry holds final states (a key's value, or its absence),
 * so a replay run again over a store it already reached leaves it as it was. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "supplemental.h"
#include "wal_priv.h"

/* The whole file in *buf (*len bytes). An errno. */
static int read_all(int fd, uint8_t **buf, size_t *len)
{
    struct stat sb;
    *buf = NULL;
    *len = 0;
    if (fstat(fd, &sb) != 0) {
        return errno;
    }
    if ((*buf = malloc((size_t)sb.st_size + 1)) == NULL) {
        return ENOMEM;
    }
    while (*len < (size_t)sb.st_size) {
        ssize_t n = pread(fd, *buf + *len, (size_t)sb.st_size - *len, (off_t)*len);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return n < 0 ? errno : 0; /* shorter than fstat said: what was read */
        }
        *len += (size_t)n;
    }
    return 0;
}

/* Applies one entry's records in txn; an LMDB rc, MDB_CORRUPTED when they overrun. */
static int apply_entry(MDB_txn *txn, const MDB_dbi dbis[WAL_DBS], const uint8_t *p, size_t n)
{
    for (size_t at = 0; at < n;) {
        if (n - at < 8) {
            return MDB_CORRUPTED;
        }
        uint8_t op = p[at], db = p[at + 1];
        size_t klen = (size_t)p[at + 2] << 8 | p[at + 3], vlen = idem__get_be32(p + at + 4);
        if (db >= WAL_DBS || (op != REC_PUT && op != REC_DEL) || n - at - 8 < klen ||
            n - at - 8 - klen < vlen) {
            return MDB_CORRUPTED;
        }
        MDB_val k = {klen, (void *)(p + at + 8)}, v = {vlen, (void *)(p + at + 8 + klen)};
        int rc =
            op == REC_PUT ? mdb_put(txn, dbis[db], &k, &v, 0) : mdb_del(txn, dbis[db], &k, NULL);
        if (rc != 0 && !(op == REC_DEL && rc == MDB_NOTFOUND)) {
            return rc;
        }
        at += 8 + klen + vlen;
    }
    return 0;
}

/* Applies the chain of entries past txnid r in txn, when the store names the log's epoch
 * (else the log is not this store's: a data.mdb put in place of the one it was written
 * beside, from a backup or another store, whose txnids may chain with it all the same). */
static int replay_chain(MDB_txn *txn, const MDB_dbi dbis[WAL_DBS], const uint8_t *buf, size_t len,
                        uint64_t r)
{
    uint64_t epoch = idem__get_be64(buf + 8);
    MDB_val k = {sizeof(WAL_EPOCH_KEY) - 1, WAL_EPOCH_KEY}, v;
    int rc = mdb_get(txn, dbis[WAL_META], &k, &v);
    if (rc != 0 || v.mv_size != 8 || idem__get_be64(v.mv_data) != epoch) {
        return rc == MDB_NOTFOUND || rc == 0 ? 0 : rc;
    }
    for (size_t at = WAL_HEAD; len - at >= WAL_ENTRY_HDR;) {
        size_t n = idem__get_be32(buf + at); /* epoch ‖ txnid ‖ records */
        if (n < 16 || len - at - 8 < n ||
            idem__get_be32(buf + at + 4) != idem__wal_crc32(buf + at + 8, n) ||
            idem__get_be64(buf + at + 8) != epoch) {
            break; /* a torn or unwritten tail, or an older epoch's entry */
        }
        uint64_t txnid = idem__get_be64(buf + at + 16);
        if (txnid > r + 1) {
            break; /* a commit the log does not hold comes between */
        }
        if (txnid == r + 1) {
            if ((rc = apply_entry(txn, dbis, buf + at + WAL_ENTRY_HDR, n - 16)) != 0) {
                return rc;
            }
            r = txnid;
        }
        at += 8 + n;
    }
    return 0;
}

/* Commits txn, then syncs env (forced): every commit so far on disk (an open runs alone).
 * An LMDB rc. */
static int commit_synced(MDB_txn *txn, void *env)
{
    int rc = mdb_txn_commit(txn);
    return rc == 0 ? mdb_env_sync(env, 1) : rc;
}

/* A new epoch at an open. A store too full for the epoch's commit (MDB_MAP_FULL) opens
 * without a log (w->epoch stays 0): every commit so far synced, the header zeroed and
 * flushed so that no entry of the old epoch is applied again over later writes. A full
 * store still serves its reads and replays, and refuses new keys RESOURCE_EXHAUSTED, as
 * before it had a log. An LMDB rc or errno. */
static int open_epoch(idem_wal *w)
{
    static const uint8_t zeros[WAL_HEAD];
    int rc = idem__wal_new_epoch(w, commit_synced, w->env);
    if (rc == MDB_MAP_FULL && (rc = mdb_env_sync(w->env, 1)) == 0 &&
        (rc = idem__wal_pwrite(w->fd, zeros, sizeof(zeros), 0)) == 0 && fdatasync(w->fd) != 0) {
        rc = errno;
    }
    return rc;
}

/* Replays the log into w->env, then starts a new epoch (which syncs it), so that no entry
 * of this one is ever applied again over later writes; nothing when the file is not a
 * log (another program's, or an empty one). An LMDB rc or errno. */
static int replay(idem_wal *w)
{
    uint8_t *buf;
    size_t len;
    MDB_envinfo info;
    MDB_txn *txn;
    int rc = read_all(w->fd, &buf, &len);
    bool ours = rc == 0 && len >= WAL_HEAD && memcmp(buf, WAL_MAGIC, 8) == 0 &&
                idem__get_be32(buf + 16) == idem__wal_crc32(buf, 16);
    if (ours && (rc = mdb_env_info(w->env, &info)) == 0 &&
        (rc = mdb_txn_begin(w->env, NULL, 0, &txn)) == 0) {
        rc = replay_chain(txn, w->dbis, buf, len, (uint64_t)info.me_last_txnid);
        if (rc != 0) {
            mdb_txn_abort(txn);
        } else {
            rc = mdb_txn_commit(txn);
        }
    }
    free(buf);
    return rc == 0 && ours ? open_epoch(w) : rc;
}

/* Writes zeros to WAL_SIZE when the file is shorter: entries then overwrite blocks the
 * file has, and their flushes journal no size change. An errno. */
static int presize(int fd)
{
    struct stat sb;
    static const uint8_t zeros[65536];
    if (fstat(fd, &sb) != 0) {
        return errno;
    }
    for (off_t at = sb.st_size; at < WAL_SIZE; at += (off_t)sizeof(zeros)) {
        int rc = idem__wal_pwrite(fd, zeros, sizeof(zeros), at);
        if (rc != 0) {
            return rc;
        }
    }
    return sb.st_size < WAL_SIZE && fsync(fd) != 0 ? errno : 0;
}

/* A log object for env's databases, its file not opened yet. */
static idem_wal *wal_new(MDB_env *env, const MDB_dbi dbis[WAL_DBS])
{
    idem_wal *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        return NULL;
    }
    w->env = env;
    memcpy(w->dbis, dbis, sizeof(w->dbis));
    w->fd = -1;
#ifdef IDEM_TEST_HOOKS /* never in a release: a library built for that test only */
    const char *bug = getenv("IDEMRPC_TEST_ANSWER_AT_COMMIT");
    w->no_flush = bug != NULL && strcmp(bug, "1") == 0;
#endif
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    return w;
}

/* Opens path (flags: O_CREAT or 0) and takes its flock: 0, ENOENT (none, and not
 * created), EWOULDBLOCK (another process holds it), or another errno. */
static int wal_lock(idem_wal *w, const char *path, int flags)
{
    if ((w->fd = open(path, O_RDWR | O_CLOEXEC | flags, 0600)) < 0) {
        return errno;
    }
    return flock(w->fd, LOCK_EX | LOCK_NB) == 0 ? 0 : errno;
}

static idem_code wal_path(char path[PATH_MAX], const char *dir)
{
    if (snprintf(path, PATH_MAX, "%s/wal.log", dir) >= PATH_MAX) {
        return idem__err(IDEM_INVALID_ARGUMENT, "store directory too long: %s", dir);
    }
    return IDEM_OK;
}

idem_code idem__wal_replay(idem_wal **out, const char *dir, MDB_env *env, const MDB_dbi dbis[6])
{
    char path[PATH_MAX];
    idem_code code = wal_path(path, dir);
    idem_wal *w = code == IDEM_OK ? wal_new(env, dbis) : NULL;
    *out = NULL;
    if (code != IDEM_OK || w == NULL) {
        return code != IDEM_OK ? code : idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    int rc = wal_lock(w, path, 0);
    if (rc == 0 && (rc = replay(w)) == 0) {
        *out = w; /* locked: this process's log, if it keeps one */
        return IDEM_OK;
    }
    idem__wal_close(w);
    if (rc == ENOENT || rc == EWOULDBLOCK) {
        return IDEM_OK; /* none; or another process's, which replayed it at its open */
    }
    return idem__err(IDEM_UNAVAILABLE, "replay of %s: %s", path, mdb_strerror(rc));
}

/* fsync of dir: a log the open created has its name on disk before it holds entries. */
static int sync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        return errno;
    }
    int rc = fsync(fd) == 0 ? 0 : errno;
    close(fd);
    return rc;
}

idem_code idem__wal_start(idem_wal **wal, const char *dir, MDB_env *env, const MDB_dbi dbis[6])
{
    char path[PATH_MAX];
    idem_code code = wal_path(path, dir);
    idem_wal *w = *wal;
    int rc = 0;
    *wal = NULL;
    if (code != IDEM_OK) {
        idem__wal_close(w);
        return code;
    }
    bool created = w == NULL;
    if (created && (w = wal_new(env, dbis)) == NULL) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (created && (rc = wal_lock(w, path, O_CREAT)) != 0) {
        idem__wal_close(w);
        return rc == EWOULDBLOCK ? IDEM_OK /* another process's: this one writes without */
                                 : idem__err(IDEM_UNAVAILABLE, "open %s: %s", path, strerror(rc));
    }
    /* w->epoch: the replay's new epoch (nothing written since), else one started now */
    if ((rc = presize(w->fd)) != 0 || (created && (rc = sync_dir(dir)) != 0) ||
        (w->epoch == 0 && (rc = open_epoch(w)) != 0) ||
        (w->epoch != 0 && (rc = pthread_create(&w->thread, NULL, idem__wal_thread, w)) != 0)) {
        idem__wal_close(w);
        return idem__err(IDEM_UNAVAILABLE, "write-ahead log %s: %s", path, mdb_strerror(rc));
    }
    if (w->epoch == 0) {
        idem__wal_close(w); /* a full store: it writes without its log */
        return IDEM_OK;
    }
    w->started = true;
    *wal = w;
    return IDEM_OK;
}

void idem__wal_close(idem_wal *w)
{
    if (w == NULL) {
        return;
    }
    if (w->started) {
        (void)mdb_env_sync(w->env, 1); /* failed: the log keeps what a replay needs */
        pthread_mutex_lock(&w->mu);
        w->stopping = true;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
    }
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    if (w->fd >= 0) {
        close(w->fd); /* and its flock */
    }
    free(w->notes);
    free(w->keys);
    free(w->buf);
    free(w);
}

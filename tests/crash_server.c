/* A server for crash tests: kills itself with SIGKILL at a chosen point of one call, the
 * way a power cut or kill -9 would, so the test can restart it on the same store and
 * check what survived.
 *
 *   crash_server --listen URL --db DIR [--pg CONNINFO] [--lease-ms N] [--crash-at POINT]
 *   POINT: before_claim | after_claim | after_effect | after_commit
 * With --pg the store is PostgreSQL (DIR holds only the effects file).
 *
 *   crash.Ledger/Credit   transactional: balance += payload, in the record's txn
 *   crash.Ledger/Balance  plain: the balance
 *   crash.File/Append     claim mode: appends a line to DIR/effects (outside the store)
 *   crash.File/Count      plain: lines in DIR/effects
 *   crash.Order/Submit    claim mode, token required, its claim on disk before it runs
 *                         (its fence): its first run in a process answers UNAVAILABLE (a
 *                         downstream still starting), the next ones "ok" */
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>

static const char *crash_at = "";
static char effects_path[4096];
static idem_store *store;

static void maybe_crash(const char *point)
{
    if (strcmp(crash_at, point) == 0) {
        raise(SIGKILL);
    }
}

static long long payload_number(idem_call *call)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    char buf[32] = {0};
    memcpy(buf, p, n < sizeof(buf) - 1 ? n : sizeof(buf) - 1);
    return atoll(buf);
}

static idem_code reply_ll(idem_call *call, long long v)
{
    char out[32];
    int n = snprintf(out, sizeof(out), "%lld", v);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static idem_code credit(idem_call *call, void *arg)
{
    (void)arg;
    idem_txn *t = idem_call_txn(call);
    const void *v;
    size_t vlen;
    long long balance = 0;
    maybe_crash("after_claim");
    if (idem_txn_get(t, "ledger", "balance", 7, &v, &vlen) == IDEM_OK && vlen == sizeof(balance)) {
        memcpy(&balance, v, sizeof(balance));
    }
    balance += payload_number(call);
    idem_code code = idem_txn_put(t, "ledger", "balance", 7, &balance, sizeof(balance));
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    maybe_crash("after_effect");
    return reply_ll(call, balance);
}

static idem_code balance(idem_call *call, void *arg)
{
    (void)arg;
    void *v;
    size_t vlen;
    long long b = 0;
    if (idem_store_app_get(store, "ledger", "balance", 7, &v, &vlen) == IDEM_OK) {
        if (vlen == sizeof(b)) {
            memcpy(&b, v, sizeof(b));
        }
        free(v);
    }
    return reply_ll(call, b);
}

static idem_code append(idem_call *call, void *arg)
{
    (void)arg;
    maybe_crash("after_claim");
    int fd = open(effects_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd < 0 || write(fd, "effect\n", 7) != 7 || fsync(fd) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return idem_call_fail(call, IDEM_UNAVAILABLE, "effects file");
    }
    close(fd);
    maybe_crash("after_effect");
    return idem_call_reply(call, IDEM_OK, "appended", 8);
}

static idem_code count(idem_call *call, void *arg)
{
    (void)arg;
    FILE *f = fopen(effects_path, "r");
    long long lines = 0;
    for (int c; f != NULL && (c = fgetc(f)) != EOF;) {
        lines += c == '\n';
    }
    if (f != NULL) {
        fclose(f);
    }
    return reply_ll(call, lines);
}

static idem_code submit(idem_call *call, void *arg)
{
    (void)arg;
    static atomic_int runs;
    if (idem_call_fence(call) == 0) { /* the claim on disk (LMDB may share its commit) */
        return idem_call_fail(call, IDEM_UNAVAILABLE, "no fence");
    }
    maybe_crash("after_claim");
    if (atomic_fetch_add(&runs, 1) == 0) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "downstream starting");
    }
    return idem_call_reply(call, IDEM_OK, "ok", 2);
}

/* Around result_cache: "before" is before the claim, "after" is after the record
 * committed and before the reply leaves. */
static idem_code crash_points(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    bool effectful = strstr(idem_call_method(call), "Credit") != NULL ||
                     strstr(idem_call_method(call), "Append") != NULL;
    if (effectful) {
        maybe_crash("before_claim");
    }
    idem_code code = idem_call_next(call, next);
    if (effectful) {
        maybe_crash("after_commit");
    }
    return code;
}

int main(int argc, char **argv)
{
    const char *listen = NULL, *db = NULL, *pg = NULL;
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.default_chain = false;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--listen") == 0) {
            listen = argv[i + 1];
        } else if (strcmp(argv[i], "--db") == 0) {
            db = argv[i + 1];
        } else if (strcmp(argv[i], "--pg") == 0) {
            pg = argv[i + 1];
        } else if (strcmp(argv[i], "--lease-ms") == 0) {
            o.lease_ms = strtoull(argv[i + 1], NULL, 10);
        } else if (strcmp(argv[i], "--crash-at") == 0) {
            crash_at = argv[i + 1];
        }
    }
    if (listen == NULL || db == NULL) {
        fprintf(stderr, "usage: crash_server --listen URL --db DIR [--pg CONNINFO] "
                        "[--lease-ms N] [--crash-at POINT]\n");
        return 2;
    }
    snprintf(effects_path, sizeof(effects_path), "%s/effects", db);
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);

    o.db_path = db;
    idem_store *pg_store = NULL;
    if (pg != NULL && idem_store_open_postgres(&pg_store, pg, 4) != IDEM_OK) {
        fprintf(stderr, "crash_server: %s\n", idem_errmsg());
        return 1;
    }
    o.store = pg_store;
    idem_server *srv;
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts claim = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts order = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_TOKEN_REQUIRED};
    if (idem_server_create(&srv, &o) != IDEM_OK ||
        idem_server_use_builtin(srv, IDEM_BUILTIN_REQUEST_ID) != IDEM_OK ||
        idem_server_use(srv, "crash_points", crash_points, NULL) != IDEM_OK ||
        idem_server_use_builtin(srv, IDEM_BUILTIN_TOKEN) != IDEM_OK ||
        idem_server_use_builtin(srv, IDEM_BUILTIN_RESULT_CACHE) != IDEM_OK ||
        idem_server_register(srv, "crash.Ledger/Credit", credit, NULL, &tx) != IDEM_OK ||
        idem_server_register(srv, "crash.Ledger/Balance", balance, NULL, NULL) != IDEM_OK ||
        idem_server_register(srv, "crash.File/Append", append, NULL, &claim) != IDEM_OK ||
        idem_server_register(srv, "crash.File/Count", count, NULL, NULL) != IDEM_OK ||
        idem_server_register(srv, "crash.Order/Submit", submit, NULL, &order) != IDEM_OK ||
        idem_server_listen(srv, listen) != IDEM_OK) {
        fprintf(stderr, "crash_server: %s\n", idem_errmsg());
        return 1;
    }
    store = idem_server_store(srv);
    printf("ready\n");
    fflush(stdout);
    int sig;
    sigwait(&stop, &sig);
    idem_server_destroy(srv);
    idem_store_close(pg_store);
    return 0;
}

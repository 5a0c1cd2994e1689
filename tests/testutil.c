#include "testutil.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <lmdb.h>
#include <ftw.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

char *tu_tempdir(const char *tag)
{
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char *path;
    cr_assert(asprintf(&path, "%s/idemrpc-%s-XXXXXX", base, tag) > 0);
    cr_assert_not_null(mkdtemp(path), "mkdtemp %s", path);
    return path;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

void tu_rmtree(char *dir)
{
    if (dir != NULL) {
        nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        free(dir);
    }
}

void tu_server_create(tu_server *ts, idem_server_opts *opts)
{
    idem_server_opts local;
    memset(ts, 0, sizeof(*ts));
    if (opts == NULL) {
        idem_server_opts_init(&local);
        opts = &local;
    }
    if (opts->store == NULL) {
        ts->dir = tu_tempdir("srv");
        opts->db_path = ts->dir;
    }
    idem_code code = idem_server_create(&ts->srv, opts);
    cr_assert_eq(code, IDEM_OK, "idem_server_create: %s", idem_errmsg());
}

void tu_server_listen(tu_server *ts)
{
    idem_code code = idem_server_listen(ts->srv, "tcp://127.0.0.1:0");
    cr_assert_eq(code, IDEM_OK, "listen: %s", idem_errmsg());
    cr_assert_gt(idem_server_port(ts->srv), 0);
    snprintf(ts->url, sizeof(ts->url), "tcp://127.0.0.1:%d", idem_server_port(ts->srv));
}

void tu_server_destroy(tu_server *ts, bool keep_dir)
{
    idem_server_destroy(ts->srv);
    ts->srv = NULL;
    if (!keep_dir) {
        tu_rmtree(ts->dir);
        ts->dir = NULL;
    }
}

idem_store *tu_store_open(const char *tag, char **dir)
{
    idem_store *st;
    *dir = tu_tempdir(tag);
    /* NOSYNC: tests never crash the machine, and thousands of fsyncs would only be slow. */
    cr_assert_eq(idem_store_open_lmdb(&st, *dir, 0, IDEM_STORE_NOSYNC), IDEM_OK, "%s",
                 idem_errmsg());
    return st;
}

bool tu_lmdb_has_key(const char *dir, const char *key)
{
    MDB_env *e;
    MDB_txn *txn;
    MDB_dbi dbi;
    MDB_val k = {strlen(key), (void *)key}, v;
    cr_assert_eq(mdb_env_create(&e), 0);
    cr_assert_eq(mdb_env_set_maxdbs(e, 16), 0);
    cr_assert_eq(mdb_env_set_mapsize(e, 64u << 20), 0);
    cr_assert_eq(mdb_env_open(e, dir, MDB_RDONLY, 0600), 0);
    cr_assert_eq(mdb_txn_begin(e, NULL, MDB_RDONLY, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    int rc = mdb_get(txn, dbi, &k, &v);
    mdb_txn_abort(txn);
    mdb_env_close(e);
    return rc == 0;
}

bool tu_pg_pooler(void)
{
    const char *p = getenv("IDEMRPC_TEST_PG_POOLER");
    return p != NULL && *p != '\0' && strcmp(p, "0") != 0;
}

idem_code tu_pg_open(idem_store **out, const char *conninfo, size_t pool)
{
    idem_pg_opts o = {.pool_size = pool, .pooler = tu_pg_pooler()};
    return idem_store_open_postgres_ex(out, conninfo, &o);
}

#if TU_HAVE_PG
#include <libpq-fe.h>

static void quiet(void *arg, const char *message)
{
    (void)arg, (void)message;
}

void tu_pg_exec(const char *conninfo, const char *sql)
{
    PGconn *c = PQconnectdb(conninfo);
    cr_assert_eq(PQstatus(c), CONNECTION_OK, "%s", PQerrorMessage(c));
    PQsetNoticeProcessor(c, quiet, NULL); /* "drop cascades to ..." */
    PGresult *r = PQexec(c, sql);
    cr_assert_eq(PQresultStatus(r), PGRES_COMMAND_OK, "%s: %s", sql, PQresultErrorMessage(r));
    PQclear(r);
    PQfinish(c);
}

static void pg_admin(const char *sql)
{
    tu_pg_exec(getenv("IDEMRPC_TEST_PG"), sql);
}

char *tu_pg_schema_create(char schema[32])
{
    const char *pg = getenv("IDEMRPC_TEST_PG");
    char sql[96], *conninfo;
    if (pg == NULL) {
        cr_skip_test("IDEMRPC_TEST_PG not set (bash scripts/services.sh start sets it)");
    }
    static int seq;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    snprintf(schema, 32, "tu_%d_%lx_%d", (int)getpid(), (unsigned long)ts.tv_nsec, seq++);
    if (tu_pg_pooler()) { /* the pooler maps any database name to the server's */
        snprintf(sql, sizeof(sql), "CREATE DATABASE %s", schema);
        pg_admin(sql);
        cr_assert_gt(asprintf(&conninfo, "%s dbname=%s", pg, schema), 0);
        return conninfo;
    }
    snprintf(sql, sizeof(sql), "CREATE SCHEMA %s", schema);
    pg_admin(sql);
    cr_assert_gt(asprintf(&conninfo, "%s options='-csearch_path=%s'", pg, schema), 0);
    return conninfo;
}

void tu_pg_schema_drop(const char *schema)
{
    char sql[96];
    snprintf(sql, sizeof(sql),
             tu_pg_pooler() ? "DROP DATABASE %s WITH (FORCE)" : "DROP SCHEMA %s CASCADE", schema);
    pg_admin(sql);
}

#else
char *tu_pg_schema_create(char schema[32])
{
    (void)schema;
    cr_skip_test("built without PostgreSQL");
    return NULL;
}

void tu_pg_schema_drop(const char *schema)
{
    (void)schema;
}

void tu_pg_exec(const char *conninfo, const char *sql)
{
    (void)conninfo, (void)sql;
    cr_skip_test("built without PostgreSQL");
}
#endif

const char *tu_app_value(idem_store *st, const char *db, const char *key)
{
    static char buf[256];
    void *v;
    size_t n;
    buf[0] = '\0';
    if (idem_store_app_get(st, db, key, strlen(key), &v, &n) == IDEM_OK) {
        snprintf(buf, sizeof(buf), "%.*s", (int)n, (const char *)v);
        free(v);
    }
    return buf;
}

bool tu_backend_is_pg(void)
{
    const char *b = getenv("IDEMRPC_TEST_BACKEND");
    return b != NULL && strcmp(b, "postgres") == 0;
}

idem_store *tu_backend_open(tu_backend *b, const char *tag)
{
    memset(b, 0, sizeof(*b));
    if (!tu_backend_is_pg()) {
        return b->st = tu_store_open(tag, &b->dir);
    }
    b->conninfo = tu_pg_schema_create(b->schema);
    cr_assert_eq(tu_pg_open(&b->st, b->conninfo, 8), IDEM_OK, "%s", idem_errmsg());
    return b->st;
}

void tu_backend_close(tu_backend *b)
{
    idem_store_close(b->st);
    if (b->dir != NULL) {
        tu_rmtree(b->dir);
    }
    if (b->schema[0] != '\0') {
        tu_pg_schema_drop(b->schema);
    }
    free(b->conninfo);
    memset(b, 0, sizeof(*b));
}

void tu_spawn(tu_child *c, const char *const *argv)
{
    int fds[2];
    cr_assert_not_null(argv[0], "no program to start");
    cr_assert_eq(pipe(fds), 0);
    c->pid = fork();
    cr_assert_geq(c->pid, 0);
    if (c->pid == 0) {
        dup2(fds[1], STDOUT_FILENO);
        close_range(3, ~0U, 0); /* nothing of the test's (its stores' files, pipes) */
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    c->out = fdopen(fds[0], "r");
    char line[64] = {0};
    cr_assert_not_null(fgets(line, sizeof(line), c->out), "%s did not start", argv[0]);
    cr_assert_str_eq(line, "ready\n");
}

bool tu_child_is(int argc, char **argv, const char *name)
{
    if (argc < 4 || strcmp(argv[1], "--tu-child") != 0 || strcmp(argv[2], name) != 0) {
        return false;
    }
    /* A test that fails before it reaps this child must not leave it running: killed when
     * the thread that started it ends, and not started when that is already gone. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != (pid_t)atol(argv[3])) {
        _exit(126);
    }
    return true;
}

void tu_spawn_child(tu_child *c, const char *name, const char *const *args)
{
    char parent[24];
    snprintf(parent, sizeof(parent), "%ld", (long)getpid());
    const char *argv[16] = {"/proc/self/exe", "--tu-child", name, parent};
    size_t n = 4;
    for (; args[n - 4] != NULL; n++) {
        cr_assert_lt(n, sizeof(argv) / sizeof(argv[0]) - 1, "too many arguments for %s", name);
        argv[n] = args[n - 4];
    }
    argv[n] = NULL;
    tu_spawn(c, argv);
}

int tu_reap(tu_child *c)
{
    int status;
    pid_t pid = c->pid;
    c->pid = -1;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    fclose(c->out);
    return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}

idem_client *tu_client_attempts(const char *url, unsigned attempt_timeout_ms, uint32_t attempts)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = attempt_timeout_ms;
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 20;
    o.retry.max_period_ms = 100;
    idem_code code = idem_client_open(&c, &url, 1, &o);
    cr_assert_eq(code, IDEM_OK, "client open: %s", idem_errmsg());
    return c;
}

idem_client *tu_client(const char *url, unsigned attempt_timeout_ms)
{
    return tu_client_attempts(url, attempt_timeout_ms, 0);
}

#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>

#include "idemrpc.pb-c.h"

static Idem__V1__Response *raw_call(const char *url, const void *frame, size_t len,
                                    unsigned timeout_ms, bool server_must_be_up)
{
    nng_socket s;
    nng_msg *m;
    Idem__V1__Response *r = NULL;
    cr_assert_eq(nng_req0_open(&s), 0);
    cr_assert_eq(nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, (nng_duration)timeout_ms), 0);
    cr_assert_eq(nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, (nng_duration)timeout_ms), 0);
    cr_assert_eq(nng_socket_set_size(s, NNG_OPT_RECVMAXSZ, 0), 0);
    int rv = nng_dial(s, url, NULL, 0);
    cr_assert(rv == 0 || !server_must_be_up, "dial %s: %s", url, nng_strerror(rv));
    if (rv != 0) {
        nng_close(s);
        return NULL;
    }
    cr_assert_eq(nng_msg_alloc(&m, 0), 0);
    cr_assert_eq(nng_msg_append(m, frame, len), 0);
    if (nng_sendmsg(s, m, 0) != 0) {
        nng_msg_free(m);
    } else if (nng_recvmsg(s, &m, 0) == 0) {
        r = idem__v1__response__unpack(NULL, nng_msg_len(m), nng_msg_body(m));
        cr_assert_not_null(r, "reply is not an idem.v1.Response");
        nng_msg_free(m);
    }
    nng_close(s);
    return r;
}

Idem__V1__Response *tu_raw_call(const char *url, const void *frame, size_t len, unsigned timeout_ms)
{
    return raw_call(url, frame, len, timeout_ms, true);
}

Idem__V1__Response *tu_raw_call_try(const char *url, const void *frame, size_t len,
                                    unsigned timeout_ms)
{
    return raw_call(url, frame, len, timeout_ms, false);
}

void tu_response_free(Idem__V1__Response *r)
{
    if (r != NULL) {
        idem__v1__response__free_unpacked(r, NULL);
    }
}

void *tu_pack_request(const char *method, const char *key, const char *caller, const char *payload,
                      size_t *len)
{
    Idem__V1__Request q = IDEM__V1__REQUEST__INIT;
    q.method = (char *)(method ? method : "");
    q.idempotency_key = (char *)(key ? key : "");
    q.caller = (char *)(caller ? caller : "");
    q.payload.data = (uint8_t *)payload;
    q.payload.len = payload ? strlen(payload) : 0;
    q.attempt = 1;
    *len = idem__v1__request__get_packed_size(&q);
    void *buf = malloc(*len ? *len : 1);
    cr_assert_not_null(buf);
    idem__v1__request__pack(&q, buf);
    return buf;
}

int tu_run_captured(const char *const *argv, char *out, size_t cap)
{
    int fd[2];
    size_t got = 0;
    cr_assert_eq(pipe(fd), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int in = open("/dev/null", O_RDONLY);
        dup2(in, 0);
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close_range(3, ~0U, 0);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fd[1]);
    for (ssize_t r; got + 1 < cap && (r = read(fd[0], out + got, cap - 1 - got)) > 0;) {
        got += (size_t)r;
    }
    out[got] = '\0';
    close(fd[0]);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

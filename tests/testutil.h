/* Shared test helpers: throwaway LMDB directories and servers on free ports. */
#ifndef IDEMRPC_TESTUTIL_H
#define IDEMRPC_TESTUTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>

/* mkdtemp under $TMPDIR (or /tmp); returns a malloc'd path. Aborts on failure. */
char *tu_tempdir(const char *tag);
/* Removes dir and everything in it, then frees the path. */
void tu_rmtree(char *dir);

/* A server on tcp://127.0.0.1:<free port>, store in a fresh temp dir. */
typedef struct tu_server {
    idem_server *srv;
    char *dir;
    char url[64];
} tu_server;

/* opts may be NULL; db_path is set by the helper unless opts->store is given. The server
 * is not listening yet: register methods, then call tu_server_listen(). */
void tu_server_create(tu_server *ts, idem_server_opts *opts);
void tu_server_listen(tu_server *ts);
/* Destroys the server; keeps the directory when keep_dir (for restart tests). */
void tu_server_destroy(tu_server *ts, bool keep_dir);

/* A fresh NOSYNC LMDB store in a temp dir (*dir, for tu_rmtree). */
idem_store *tu_store_open(const char *tag, char **dir);
/* True when key is in the main (unnamed) db of the LMDB store at dir, read by a read-only
 * environment of its own: what a cut left on disk, past the store's own code. */
bool tu_lmdb_has_key(const char *dir, const char *key);

/* A fresh store of the backend $IDEMRPC_TEST_BACKEND names: "lmdb" (the default, as
 * tu_store_open) or "postgres" (a schema of its own in $IDEMRPC_TEST_PG, dropped by
 * tu_backend_close; the test is skipped when that is unset). */
typedef struct tu_backend {
    idem_store *st;
    char *dir;      /* lmdb */
    char *conninfo; /* postgres: $IDEMRPC_TEST_PG with the schema as search_path */
    char schema[32];
} tu_backend;
idem_store *tu_backend_open(tu_backend *b, const char *tag);
void tu_backend_close(tu_backend *b);
/* True when tu_backend_open opens PostgreSQL stores. */
bool tu_backend_is_pg(void);
/* The business value db/key of st as a string ("" when absent), read outside any txn;
 * a static buffer, valid until the next call. */
const char *tu_app_value(idem_store *st, const char *db, const char *key);
/* A fresh schema in $IDEMRPC_TEST_PG (skips the test when unset): returns the conninfo
 * that makes it the search_path (malloc'd); drop it with tu_pg_schema_drop. */
char *tu_pg_schema_create(char schema[32]);
void tu_pg_schema_drop(const char *schema);
/* True when the tests run through a pooler in transaction mode (tests/pooled.sh sets
 * IDEMRPC_TEST_PG_POOLER): stores are opened with idem_pg_opts.pooler, and a "schema"
 * is a database of its own (a pooler passes no search_path). */
bool tu_pg_pooler(void);
/* idem_store_open_postgres_ex with pool connections, and pooler as tu_pg_pooler says. */
idem_code tu_pg_open(idem_store **out, const char *conninfo, size_t pool);
/* Runs sql (statements returning no rows) on a connection of its own. */
void tu_pg_exec(const char *conninfo, const char *sql);

/* A server process whose stdout is a pipe. */
typedef struct tu_child {
    pid_t pid;
    FILE *out;
} tu_child;
/* Starts argv (NULL-terminated; no fd of this process but stdin, its stdout a pipe to
 * c->out, stderr) and waits for its "ready" line. */
void tu_spawn(tu_child *c, const char *const *argv);
/* Waits for the child; the signal that ended it, or 0 for a normal exit. */
int tu_reap(tu_child *c);

/* A child process running a function of the test program itself, started by exec: its
 * TU_CHILD_MAIN(name) runs from a constructor, before criterion's main, and the process
 * ends with its return value (stdio flushed, no atexit handler run). A child forked
 * without exec would inherit the test process's state: under GCC 12's ASan, which has no
 * fork handler, a fork while criterion's nanomsg thread held the allocator's lock left
 * the child waiting for that lock forever (CI saw test_wal hang so). Two children of one
 * name in one program fail to link. */
#define TU_CHILD_MAIN(name)                                                                        \
    int tu_child_main_##name(int argc, char **argv);                                               \
    __attribute__((constructor)) static void tu_child_start_##name(int argc, char **argv)          \
    {                                                                                              \
        if (tu_child_is(argc, argv, #name)) {                                                      \
            int rc_ = tu_child_main_##name(argc - 4, argv + 4);                                    \
            fflush(NULL);                                                                          \
            _exit(rc_);                                                                            \
        }                                                                                          \
    }                                                                                              \
    int tu_child_main_##name(int argc, char **argv)
/* True when this process was started by tu_spawn_child(.., name, ..). */
bool tu_child_is(int argc, char **argv, const char *name);
/* tu_spawn of this program's TU_CHILD_MAIN(name) with args (NULL-terminated): the child
 * prints "ready" first. It is killed when the thread that started it ends. */
void tu_spawn_child(tu_child *c, const char *name, const char *const *args);

/* A client to url with fast retries for tests. */
idem_client *tu_client(const char *url, unsigned attempt_timeout_ms);
/* The same with at most attempts attempts (0: the client's default). */
idem_client *tu_client_attempts(const char *url, unsigned attempt_timeout_ms, uint32_t attempts);

/* Runs argv[0] (NULL-terminated argv, stdin /dev/null) to its end: its exit status (-1
 * when a signal ended it); out gets its stdout and stderr, NUL-terminated, cut at cap. */
int tu_run_captured(const char *const *argv, char *out, size_t cap);

/* Sends one raw frame on a fresh req0 socket and returns the reply frame decoded as an
 * idem.v1.Response (free with tu_response_free), or NULL when no reply arrived within
 * timeout_ms. */
struct Idem__V1__Response;
struct Idem__V1__Response *tu_raw_call(const char *url, const void *frame, size_t len,
                                       unsigned timeout_ms);
/* The same, but a server that is down (or dies) is not a failure: NULL. */
struct Idem__V1__Response *tu_raw_call_try(const char *url, const void *frame, size_t len,
                                           unsigned timeout_ms);
void tu_response_free(struct Idem__V1__Response *r);
/* Packs a Request with the given fields (NULL = unset) into a malloc'd frame. */
void *tu_pack_request(const char *method, const char *key, const char *caller, const char *payload,
                      size_t *len);

#endif

/* ---- HTTP over a raw TCP socket to 127.0.0.1 (so a test controls every header line) ---- */
typedef struct tu_http {
    int status; /* 0 when no response arrived */
    char *head; /* status line and header lines, NUL-terminated */
    char *body; /* NUL-terminated */
    size_t body_len;
} tu_http;

/* POST path with the given header lines ("Name: value"; a name may repeat) and body. */
void tu_http_post(tu_http *out, int port, const char *path, const char *const *headers,
                  size_t n_headers, const void *body, size_t len);
/* GET path. */
void tu_http_get(tu_http *out, int port, const char *path);
/* The value of response header name (case-insensitive), copied into buf; NULL if absent. */
const char *tu_http_header(const tu_http *r, const char *name, char *buf, size_t cap);
void tu_http_free(tu_http *r);

/* A TCP connection to 127.0.0.1:port whose reads give up after bound_s seconds. */
int tu_dial(int port, int bound_s);
/* Sends all of p, or stops where the server closed (it may refuse before reading all). */
void tu_send_all(int fd, const void *p, size_t len);

/* A temp dir (for tu_rmtree) with TLS material made by openssl for this run (nothing
 * committed can expire): CAs sca and cca (.crt, .key), server.pem (certificate for
 * localhost and 127.0.0.1 signed by sca, then its key) and client.crt, client.key
 * (CN client-a, signed by cca). */
char *tu_make_certs(const char *tag);

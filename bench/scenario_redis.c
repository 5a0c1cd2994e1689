/* Scenarios r–u, the peer a user would pick instead of idemrpc: a plain Redis
 * idempotency layer behind the same nng hop. No idemrpc code runs. The client is a raw
 * req0 socket (as in a) sending [key length][key][payload]; the server is a rep0 socket
 * with one thread per context, each with its own hiredis connection, and per request
 *
 *   SET idem:<key> P NX PX <lease> GET   nil: the key is ours; run the handler (echo),
 *   SET idem:<key> D<result> PX <ttl>      store the result, answer N<result>
 *                                        "D<result>": a replay, answer R<result>
 *                                        "P": in progress, answer B (an error here)
 *
 * so a new key costs two Redis round trips and a replay one (SET ... NX GET, Redis
 * 7.0, does nothing but GET when the key exists). r and t are new keys, s and u
 * replays; r and s run with appendonly yes + appendfsync always (Redis fsyncs the AOF
 * before it answers a write: the durability of c), t and u with appendfsync everysec
 * (about a second may be lost: closer to d). A replay writes nothing, so s and u should
 * measure the same: a check on the run, not a second result.
 *
 * The bench sets appendonly/appendfsync with CONFIG SET on the Redis of
 * $IDEMRPC_BENCH_REDIS (redis://HOST[:PORT]), waits for the AOF rewrite that turning it
 * on starts, and after the cell deletes the cell's keys (SCAN + UNLINK) and puts back
 * the settings it found: give it a throwaway Redis (scripts/services.sh starts one).
 *
 * What the layer leaves out, being the plain one: no fingerprint of the request (a key
 * reused with another payload replays the first result), no caller namespace, no
 * lease renewal or take-over (an "in progress" answer is final). redis-server is
 * another process: its CPU comes from INFO cpu at the gates (peer_cpu_us), and is not
 * in the bench's own cpu_us. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>

#include "bench.h"

#define REDIS_ENV "IDEMRPC_BENCH_REDIS"
#define LEASE_MS 30000        /* an in-progress claim */
#define RESULT_TTL_MS 3600000 /* a stored result; the cell deletes its keys anyway */
#define CONNECT_TIMEOUT_MS 2000
#define AOF_WAIT_POLLS 400      /* x 25 ms: the AOF rewrite of CONFIG SET appendonly yes */
#define SCAN_MAX_ROUNDS 1000000 /* SCAN ... COUNT 1000: far more keys than a cell makes */
#define KEY_PREFIX "idem:"

/* One server context and the thread that serves it: recv, Redis, send, until the
 * socket closes. */
typedef struct redis_worker {
    nng_ctx ctx;
    nng_aio *aio; /* no callback: the thread waits on it; no timeout (RECVTIMEO: none) */
    redisContext *rc;
    pthread_t tid;
    bool running;
} redis_worker;

typedef struct redis_peer {
    char host[128];
    int port;
    redisContext *admin; /* main thread only: CONFIG, INFO, SCAN */
    char saved_aof[16], saved_fsync[16];
    bool config_changed;
    nng_socket sock;
    bool sock_open;
    redis_worker *workers;
    size_t n; /* workers with an aio */
} redis_peer;

/* ---- the Redis of $IDEMRPC_BENCH_REDIS ---- */

static bool parse_redis_url(redis_peer *p, const char *url)
{
    p->port = 6379;
    return url != NULL && sscanf(url, "redis://%127[^:/]:%d", p->host, &p->port) >= 1 &&
           p->port > 0 && p->port <= 65535;
}

static redisContext *redis_connect(const redis_peer *p)
{
    struct timeval connect_tv = {CONNECT_TIMEOUT_MS / 1000, (CONNECT_TIMEOUT_MS % 1000) * 1000};
    struct timeval io_tv = {CALL_TIMEOUT_MS / 1000, (CALL_TIMEOUT_MS % 1000) * 1000};
    redisContext *rc = redisConnectWithTimeout(p->host, p->port, connect_tv);
    if (rc != NULL && (rc->err || redisSetTimeout(rc, io_tv) != REDIS_OK)) {
        redisFree(rc);
        rc = NULL;
    }
    return rc;
}

/* An admin command's reply, or NULL after cell_fail (what failed and why). */
static redisReply *admin_cmd(redis_peer *p, cell_stats *out, const char *what, int want_type,
                             redisReply *r)
{
    if (r == NULL) {
        cell_fail(out, "redis %s: %s", what, p->admin->errstr);
    } else if (r->type != want_type) {
        cell_fail(out, "redis %s: %s", what, r->type == REDIS_REPLY_ERROR ? r->str : "odd reply");
        freeReplyObject(r);
        r = NULL;
    }
    return r;
}

/* The value of "name:" in an INFO reply, into buf; false when absent. */
static bool info_field(const char *info, const char *name, char *buf, size_t cap)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\n%s:", name);
    const char *v = strstr(info, pat);
    if (v == NULL || cap == 0) {
        return false;
    }
    v += strlen(pat);
    size_t n = strcspn(v, "\r\n");
    snprintf(buf, cap, "%.*s", (int)(n < cap ? n : cap - 1), v);
    return true;
}

/* INFO section into a reply the caller frees; NULL on failure. */
static redisReply *admin_info(redis_peer *p, cell_stats *out, const char *section)
{
    return admin_cmd(p, out, "INFO", REDIS_REPLY_STRING,
                     redisCommand(p->admin, "INFO %s", section));
}

/* CONFIG GET name into buf. */
static int config_get(redis_peer *p, cell_stats *out, const char *name, char *buf, size_t cap)
{
    redisReply *r = admin_cmd(p, out, "CONFIG GET", REDIS_REPLY_ARRAY,
                              redisCommand(p->admin, "CONFIG GET %s", name));
    if (r == NULL) {
        return -1;
    }
    bool ok = r->elements == 2 && r->element[1]->type == REDIS_REPLY_STRING;
    snprintf(buf, cap, "%s", ok ? r->element[1]->str : "");
    freeReplyObject(r);
    return ok ? 0 : cell_fail(out, "redis CONFIG GET %s: no value", name);
}

static int config_set(redis_peer *p, cell_stats *out, const char *name, const char *value)
{
    redisReply *r = admin_cmd(p, out, "CONFIG SET", REDIS_REPLY_STATUS,
                              redisCommand(p->admin, "CONFIG SET %s %s", name, value));
    if (r == NULL) {
        return -1;
    }
    freeReplyObject(r);
    return 0;
}

/* Until no AOF rewrite is running or scheduled: turning appendonly on starts one, and
 * until it ends writes are not yet fsynced as configured. */
static int aof_wait_ready(redis_peer *p, cell_stats *out)
{
    for (int i = 0; i < AOF_WAIT_POLLS; i++) {
        char running[8] = "", scheduled[8] = "";
        redisReply *r = admin_info(p, out, "persistence");
        if (r == NULL) {
            return -1;
        }
        info_field(r->str, "aof_rewrite_in_progress", running, sizeof(running));
        info_field(r->str, "aof_rewrite_scheduled", scheduled, sizeof(scheduled));
        freeReplyObject(r);
        if (strcmp(running, "0") == 0 && strcmp(scheduled, "0") == 0) {
            return 0;
        }
        usleep(25000);
    }
    return cell_fail(out, "redis: the AOF rewrite did not end within %d ms", AOF_WAIT_POLLS * 25);
}

/* Redis 7.0 or later (SET ... NX GET); then appendonly yes with the scenario's fsync,
 * remembering what was there. */
static int redis_configure(redis_peer *p, const scenario *sc, cell_stats *out)
{
    char version[32] = "";
    redisReply *r = admin_info(p, out, "server");
    if (r == NULL) {
        return -1;
    }
    info_field(r->str, "redis_version", version, sizeof(version));
    freeReplyObject(r);
    if (atoi(version) < 7) {
        return cell_fail(out, "redis %s: SET ... NX GET needs Redis 7.0 or later", version);
    }
    if (config_get(p, out, "appendonly", p->saved_aof, sizeof(p->saved_aof)) != 0 ||
        config_get(p, out, "appendfsync", p->saved_fsync, sizeof(p->saved_fsync)) != 0) {
        return -1;
    }
    p->config_changed = true;
    if (config_set(p, out, "appendfsync", sc->appendfsync) != 0 ||
        config_set(p, out, "appendonly", "yes") != 0) {
        return -1;
    }
    return aof_wait_ready(p, out);
}

/* UNLINK of the keys in a SCAN reply's array, in one command. A failure leaves keys,
 * each with its TTL. */
static void unlink_keys(redis_peer *p, const redisReply *keys)
{
    if (keys->type != REDIS_REPLY_ARRAY || keys->elements == 0) {
        return;
    }
    const char **argv = malloc((keys->elements + 1) * sizeof(*argv));
    size_t *argvlen = malloc((keys->elements + 1) * sizeof(*argvlen));
    if (argv != NULL && argvlen != NULL) {
        argv[0] = "UNLINK", argvlen[0] = 6;
        for (size_t i = 0; i < keys->elements; i++) {
            argv[i + 1] = keys->element[i]->str;
            argvlen[i + 1] = (size_t)keys->element[i]->len;
        }
        freeReplyObject(redisCommandArgv(p->admin, (int)keys->elements + 1, argv, argvlen));
    }
    free(argv);
    free(argvlen);
}

/* UNLINKs every key of cell c; bounded by SCAN_MAX_ROUNDS. */
static void redis_delete_cell_keys(redis_peer *p, const cell *c)
{
    char match[96];
    int len = snprintf(match, sizeof(match), KEY_PREFIX);
    len += cell_key_prefix(c, match + len, sizeof(match) - (size_t)len);
    snprintf(match + len, sizeof(match) - (size_t)len, "*");
    char cursor[32] = "0";
    for (long round = 0; round < SCAN_MAX_ROUNDS; round++) {
        redisReply *r = redisCommand(p->admin, "SCAN %s MATCH %s COUNT 1000", cursor, match);
        if (r == NULL || r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
            r->element[0]->type != REDIS_REPLY_STRING) {
            fprintf(stderr, "idemrpc-bench: redis SCAN %s failed: keys are left\n", match);
            freeReplyObject(r);
            return;
        }
        snprintf(cursor, sizeof(cursor), "%s", r->element[0]->str);
        unlink_keys(p, r->element[1]);
        freeReplyObject(r);
        if (strcmp(cursor, "0") == 0) {
            return;
        }
    }
}

/* The settings found before the cell, back. */
static void redis_restore(redis_peer *p)
{
    cell_stats ignored = {.ok = 0};
    if (p->config_changed && (config_set(p, &ignored, "appendonly", p->saved_aof) != 0 ||
                              config_set(p, &ignored, "appendfsync", p->saved_fsync) != 0)) {
        fprintf(stderr, "idemrpc-bench: could not restore the Redis settings: %s\n", ignored.error);
    }
}

/* used_cpu_sys + used_cpu_user of redis-server, all its threads, in µs. */
static double redis_cpu_us(const cell *c)
{
    redis_peer *p = c->peer;
    cell_stats ignored = {.ok = 0};
    char sys[32] = "", user[32] = "";
    redisReply *r = admin_info(p, &ignored, "cpu");
    if (r == NULL) {
        return NAN;
    }
    bool ok = info_field(r->str, "used_cpu_sys", sys, sizeof(sys)) &&
              info_field(r->str, "used_cpu_user", user, sizeof(user));
    freeReplyObject(r);
    return ok ? (strtod(sys, NULL) + strtod(user, NULL)) * 1e6 : NAN;
}

void redis_preamble(void)
{
    const char *url = getenv(REDIS_ENV);
    redis_peer p = {.admin = NULL};
    cell_stats out = {.ok = 0};
    char version[32] = "?", dir[256] = "?";
    struct statfs sf;
    if (url == NULL || !parse_redis_url(&p, url)) {
        printf("r-u: set %s to redis://HOST[:PORT] of a throwaway Redis 7\n", REDIS_ENV);
        return;
    }
    if ((p.admin = redis_connect(&p)) == NULL) {
        printf("r-u: %s: cannot connect\n", url);
        return;
    }
    redisReply *r = admin_info(&p, &out, "server");
    if (r != NULL) {
        info_field(r->str, "redis_version", version, sizeof(version));
        freeReplyObject(r);
    }
    config_get(&p, &out, "dir", dir, sizeof(dir));
    redisFree(p.admin);
    printf("r-u: redis %s at %s, AOF in %s (%s as seen from here); raw req0 clients as a; "
           "server: one thread + hiredis connection per context\n",
           version, url, dir, statfs(dir, &sf) == 0 ? fs_type_name((long)sf.f_type) : "?");
}

/* ---- the server: one thread per context ---- */

/* m := tag + n bytes of data; nng's error when m could not grow. */
static int reply_set(nng_msg *m, const char *tag, const void *data, size_t n)
{
    int rv;
    nng_msg_clear(m);
    if ((rv = nng_msg_append(m, tag, 1)) != 0 || (rv = nng_msg_append(m, data, n)) != 0) {
        return rv;
    }
    return 0;
}

/* The answer to a claim that succeeded: the handler echoes the payload, its result is
 * stored, and m (the request) becomes N + the result in place. */
static int serve_new(redis_worker *w, nng_msg *m, const char *key, size_t klen)
{
    const char *payload = key + klen;
    size_t plen = nng_msg_len(m) - 1 - klen;
    redisReply *r = redisCommand(w->rc, "SET " KEY_PREFIX "%b D%b PX %d", key, klen, payload, plen,
                                 RESULT_TTL_MS);
    int rv;
    if (r == NULL || r->type != REDIS_REPLY_STATUS) {
        const char *why = r == NULL ? w->rc->errstr : r->type == REDIS_REPLY_ERROR ? r->str : "?";
        rv = reply_set(m, "E", why, strlen(why));
    } else if ((rv = nng_msg_trim(m, 1 + klen)) == 0) {
        rv = nng_msg_insert(m, "N", 1);
    }
    freeReplyObject(r); /* NULL-safe */
    return rv;
}

/* The answer to request m ([key length][key][payload]), in m: N or R + the result, B
 * (in progress) or E + why; nng's error when m could not be built. */
static int serve(redis_worker *w, nng_msg *m)
{
    const unsigned char *body = nng_msg_body(m);
    size_t len = nng_msg_len(m);
    size_t klen = len > 0 ? body[0] : 0;
    if (klen == 0 || len < 1 + klen) {
        return reply_set(m, "E", "bad request", 11);
    }
    const char *key = (const char *)body + 1;
    redisReply *r = redisCommand(w->rc, "SET " KEY_PREFIX "%b P NX PX %d GET", key, klen, LEASE_MS);
    int rv;
    if (r != NULL && r->type == REDIS_REPLY_NIL) {
        rv = serve_new(w, m, key, klen); /* the key is ours */
    } else if (r == NULL) {
        rv = reply_set(m, "E", w->rc->errstr, strlen(w->rc->errstr));
    } else if (r->type == REDIS_REPLY_STRING && r->len >= 1 && r->str[0] == 'D') {
        rv = reply_set(m, "R", r->str + 1, (size_t)r->len - 1);
    } else if (r->type == REDIS_REPLY_STRING) {
        rv = reply_set(m, "B", "", 0);
    } else {
        const char *why = r->type == REDIS_REPLY_ERROR ? r->str : "odd reply";
        rv = reply_set(m, "E", why, strlen(why));
    }
    freeReplyObject(r);
    return rv;
}

/* Until the socket closes: every wait ends with a message or NNG_ECLOSED. */
static void *worker_main(void *arg)
{
    redis_worker *w = arg;
    int rv;
    for (;;) {
        nng_ctx_recv(w->ctx, w->aio);
        nng_aio_wait(w->aio);
        if ((rv = nng_aio_result(w->aio)) == NNG_ECLOSED || rv == NNG_ECANCELED) {
            return NULL;
        } else if (rv != 0) {
            continue; /* a receive that failed takes no message with it */
        }
        nng_msg *m = nng_aio_get_msg(w->aio);
        if (serve(w, m) != 0) {
            nng_msg_clear(m); /* out of memory: an empty answer, the client's error */
        }
        nng_aio_set_msg(w->aio, m);
        nng_ctx_send(w->ctx, w->aio);
        nng_aio_wait(w->aio);
        if ((rv = nng_aio_result(w->aio)) != 0) {
            nng_msg_free(m); /* a failed send leaves us the message */
            if (rv == NNG_ECLOSED || rv == NNG_ECANCELED) {
                return NULL;
            }
        }
    }
}

/* Also undoes a partial start: closing the socket ends every worker's wait. */
static void redis_server_stop(redis_peer *p)
{
    if (p->sock_open) {
        nng_close(p->sock);
    }
    for (size_t i = 0; i < p->n; i++) {
        redis_worker *w = &p->workers[i];
        if (w->running) {
            pthread_join(w->tid, NULL);
        }
        nng_aio_free(w->aio);
        if (w->rc != NULL) {
            redisFree(w->rc);
        }
    }
    free(p->workers);
}

/* One worker: its aio, context and Redis connection. */
static int worker_open(redis_peer *p, redis_worker *w, cell_stats *out)
{
    int rv;
    if ((rv = nng_aio_alloc(&w->aio, NULL, NULL)) != 0) {
        return cell_fail(out, "nng_aio_alloc: %s", nng_strerror(rv));
    }
    if ((rv = nng_ctx_open(&w->ctx, p->sock)) != 0) {
        return cell_fail(out, "nng_ctx_open: %s", nng_strerror(rv));
    }
    if ((w->rc = redis_connect(p)) == NULL) {
        return cell_fail(out, "redis connect %s:%d failed", p->host, p->port);
    }
    return 0;
}

static int redis_server_start(redis_peer *p, cell *c, cell_stats *out)
{
    size_t n = server_contexts(c->clients);
    char url[160];
    nng_listener l;
    int rv, port = 0;

    if ((rv = nng_rep0_open(&p->sock)) != 0) {
        return cell_fail(out, "nng_rep0_open: %s", nng_strerror(rv));
    }
    p->sock_open = true;
    if ((rv = nng_socket_set_size(p->sock, NNG_OPT_RECVMAXSZ, 0)) != 0) {
        return cell_fail(out, "redis peer NNG_OPT_RECVMAXSZ: %s", nng_strerror(rv));
    }
    if ((p->workers = calloc(n, sizeof(*p->workers))) == NULL) {
        return cell_fail(out, "out of memory");
    }
    for (; p->n < n; p->n++) {
        if (worker_open(p, &p->workers[p->n], out) != 0) {
            p->n++; /* its aio and connection are freed by redis_server_stop */
            return -1;
        }
    }
    listen_url(c, 0, url, sizeof(url));
    if ((rv = nng_listener_create(&l, p->sock, url)) != 0 || (rv = nng_listener_start(l, 0)) != 0) {
        return cell_fail(out, "redis peer listen %s: %s", url, nng_strerror(rv));
    }
    if (strcmp(c->transport, "tcp") == 0 &&
        (rv = nng_listener_get_int(l, NNG_OPT_TCP_BOUND_PORT, &port)) != 0) {
        return cell_fail(out, "redis peer NNG_OPT_TCP_BOUND_PORT: %s", nng_strerror(rv));
    }
    set_dial_url(c, url, port);
    for (size_t i = 0; i < p->n; i++) {
        redis_worker *w = &p->workers[i];
        if (pthread_create(&w->tid, NULL, worker_main, w) != 0) {
            return cell_fail(out, "could not start %zu server threads", n);
        }
        w->running = true;
    }
    return 0;
}

/* ---- the client: a raw req0 socket (scenario_echo.c's) ---- */

static int redis_call(bench_thread *t)
{
    const cell *c = t->cell;
    char key[64];
    bool want_replayed = next_call_key(t, key, sizeof(key));
    size_t klen = strlen(key), len = c->payload_len;
    nng_msg *m;
    int rv;
    if ((rv = nng_msg_alloc(&m, 1 + klen + len)) != 0) {
        return thread_fail(t, "nng_msg_alloc: %s", nng_strerror(rv));
    }
    unsigned char *body = nng_msg_body(m);
    body[0] = (unsigned char)klen;
    memcpy(body + 1, key, klen);
    memcpy(body + 1 + klen, c->payload, len);
    if ((rv = nng_sendmsg(t->conn.sock, m, 0)) != 0) {
        nng_msg_free(m); /* still ours when the send fails */
        return thread_fail(t, "nng_sendmsg: %s", nng_strerror(rv));
    }
    if ((rv = nng_recvmsg(t->conn.sock, &m, 0)) != 0) {
        return thread_fail(t, "nng_recvmsg: %s", nng_strerror(rv));
    }
    const char *reply = nng_msg_body(m);
    size_t rlen = nng_msg_len(m);
    char want = want_replayed ? 'R' : 'N';
    rv = 0;
    if (rlen == 0 || reply[0] != want) {
        rv = thread_fail(t, "redis peer answered '%.*s' (want %c)", rlen > 80 ? 80 : (int)rlen,
                         reply, want);
    } else if (rlen - 1 != len || memcmp(reply + 1, c->payload, len) != 0) {
        rv = thread_fail(t, "redis peer: the result differs from the payload");
    }
    nng_msg_free(m);
    return rv;
}

static const client_ops redis_ops = {
    .open = req_open, .call = redis_call, .close = req_close, .peer_cpu_us = redis_cpu_us};

int run_redis(const scenario *sc, cell *c, cell_stats *out)
{
    redis_peer p = {.admin = NULL};
    const char *url = getenv(REDIS_ENV);
    int rv = -1;
    if (url == NULL || !parse_redis_url(&p, url)) {
        return cell_fail(out, "set %s to redis://HOST[:PORT]", REDIS_ENV);
    }
    if ((p.admin = redis_connect(&p)) == NULL) {
        return cell_fail(out, "redis connect %s failed", url);
    }
    c->peer = &p;
    if (redis_configure(&p, sc, out) == 0 && redis_server_start(&p, c, out) == 0) {
        c->warmup = sc->keys == KEYS_REPLAY ? REPLAY_KEYS : WARMUP_CALLS;
        rv = run_clients(&redis_ops, c, out);
    }
    redis_server_stop(&p);
    redis_delete_cell_keys(&p, c);
    redis_restore(&p);
    redisFree(p.admin);
    c->peer = NULL;
    return rv;
}

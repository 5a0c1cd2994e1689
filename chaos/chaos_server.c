/* The server under test: `idemrpc-chaos --serve ...`, started twice by the campaign on
 * one store (one LMDB directory, or one PostgreSQL database with Redis debounce).
 *
 *   chaos.Ledger/Transfer  transactional: "FROM TO AMOUNT" moves money between accounts
 *                          acct-00..07 (absent = 1000) and counts the execution in app
 *                          db "applied" under its key, all in the record's transaction.
 *                          Too little money: FAILED_PRECONDITION.
 *   chaos.Order/Submit     token required, transactional: counts in app db "orders"
 *                          under the key (the token).
 *   chaos.Counter/Add      claim mode (cached, key required): one line in the effect log.
 *   chaos.Trip/Book        journaled steps (IDEM_METHOD_STEPS, key required): step "hold",
 *                          10-60 ms (a slow provider; for one key in 20 that is not
 *                          declined, 4 leases: a run whose lease must be renewed across
 *                          a fault), step
 *                          "pay"; each step's function
 *                          writes one effect line naming the step and returns the output
 *                          "STEP.PID.FENCE"; the answer names both outputs (hold=, pay=),
 *                          so a replayed step is recognisable. A step that ran then
 *                          writes a note line: NOTE = recorded, or unrecorded:CODE.
 *                          Payload "decline N": the card is declined after "hold" (a
 *                          final FAILED_PRECONDITION "card declined caller=… key=…"), so
 *                          the compensation runs hold's undo, which writes an effect
 *                          line "undo" (see hold_undo: transient failures, a crash).
 *
 * Every answer names the process, the fence, the caller and the key of the execution
 * that produced it, so two executions never give equal answers and a caller can tell
 * whose result it got. Effect log line (one write(2) on an O_APPEND fd, then fdatasync):
 *   METHOD CALLER KEY PID FENCE MONOTONIC_MS [STEP [NOTE]]
 * With --http URL a server serves the same chain on the HTTP front too, with the
 * campaign's bounds (CHAOS_HTTP_*), for the slow_http fault (chaos_faults_http.c), and
 * with --grpc URL on the gRPC front (CHAOS_GRPC_*, the slow_grpc fault and the
 * workload's gRPC calls).
 * The servers run the re-driver (--redrive-ms, idem_server_opts.redrive_interval_ms):
 * a Book whose owner died between its steps and whose client gave up is finished by it. */
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>

#include "chaos.h"
#include "cli.h"

static int effects_fd = -1;
static uint64_t lease_ms; /* the servers' lease (--lease-ms) */
/* A crash during a compensation (chaos_faults_undo.c): the campaign arms it by creating
 * EFFECTS.undo-crash; the undo that removes it writes its pid to EFFECTS.undo-crash.pid. */
static char undo_crash[640], undo_crash_pid[660];

static idem_code reply_execution(idem_call *call, idem_code code, const char *extra)
{
    char out[512];
    int n = snprintf(out, sizeof(out), "pid=%d fence=%" PRIu64 " caller=%s key=%s%s", (int)getpid(),
                     idem_call_fence(call), idem_call_caller(call), idem_call_key(call), extra);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", out);
    }
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* One line of the effect log (tail: "" or " STEP" or " STEP NOTE"), synced unless it
 * is only a note; *written: the line is in the file (even if its fdatasync then failed). */
static bool effect_write(idem_call *call, const char *tail, bool *written)
{
    bool note = strchr(tail + (tail[0] == ' '), ' ') != NULL;
    char line[700];
    int n = snprintf(line, sizeof(line), "%s %s %s %d %" PRIu64 " %" PRIu64 "%s\n",
                     idem_call_method(call), idem_call_caller(call), idem_call_key(call),
                     (int)getpid(), idem_call_fence(call), chaos_now_ms(), tail);
    bool ok = n > 0 && (size_t)n < sizeof(line) && write(effects_fd, line, (size_t)n) == n;
    if (written != NULL) {
        *written = ok;
    }
    return ok && (note || fdatasync(effects_fd) == 0);
}

/* The durable effect of a claim-mode method: a line per execution. */
static idem_code effect_log(idem_call *call)
{
    if (!effect_write(call, "", NULL)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "effect log write failed");
    }
    return IDEM_OK;
}

static long long read_ll(idem_txn *t, const char *db, const char *key, long long absent)
{
    const void *v;
    size_t n;
    long long x = absent;
    if (idem_txn_get(t, db, key, strlen(key), &v, &n) == IDEM_OK && n == sizeof(x)) {
        memcpy(&x, v, sizeof(x));
    }
    return x;
}

static idem_code write_ll(idem_txn *t, const char *db, const char *key, long long x)
{
    return idem_txn_put(t, db, key, strlen(key), &x, sizeof(x));
}

/* One more execution of this key, in app db `db` (the checker reads the counts). */
static idem_code count_execution(idem_txn *t, const char *db, const char *key)
{
    return write_ll(t, db, key, read_ll(t, db, key, 0) + 1);
}

static idem_code transfer(idem_call *call, void *arg)
{
    (void)arg;
    idem_txn *t = idem_call_txn(call);
    size_t n;
    const char *p = idem_call_payload(call, &n);
    char buf[64] = {0}, from[16], to[16];
    int a, b;
    long long amount;
    memcpy(buf, p, n < sizeof(buf) - 1 ? n : sizeof(buf) - 1);
    if (sscanf(buf, "%d %d %lld", &a, &b, &amount) != 3 || a < 0 || b < 0 || a >= CHAOS_ACCOUNTS ||
        b >= CHAOS_ACCOUNTS || a == b || amount <= 0) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "bad transfer '%s'", buf);
    }
    snprintf(from, sizeof(from), "acct-%02d", a);
    snprintf(to, sizeof(to), "acct-%02d", b);
    /* Read (on PostgreSQL: lock) the lower account first, so that two opposite
     * transfers never wait for each other in a cycle. */
    long long lo = read_ll(t, "ledger", a < b ? from : to, CHAOS_INITIAL_BALANCE);
    long long hi = read_ll(t, "ledger", a < b ? to : from, CHAOS_INITIAL_BALANCE);
    long long fb = a < b ? lo : hi, tb = a < b ? hi : lo;
    if (fb < amount) {
        return reply_execution(call, IDEM_FAILED_PRECONDITION, " insufficient funds");
    }
    idem_code code;
    if ((code = write_ll(t, "ledger", from, fb - amount)) != IDEM_OK ||
        (code = write_ll(t, "ledger", to, tb + amount)) != IDEM_OK ||
        (code = count_execution(t, "applied", idem_call_key(call))) != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    char extra[48];
    snprintf(extra, sizeof(extra), " from_balance=%lld", fb - amount);
    return reply_execution(call, IDEM_OK, extra);
}

static idem_code order(idem_call *call, void *arg)
{
    (void)arg;
    idem_code code = count_execution(idem_call_txn(call), "orders", idem_call_key(call));
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "order effect failed");
    }
    return reply_execution(call, IDEM_OK, "");
}

static idem_code add(idem_call *call, void *arg)
{
    (void)arg;
    idem_code code = effect_log(call);
    return code != IDEM_OK ? code : reply_execution(call, IDEM_OK, "");
}

/* A step of chaos.Trip/Book. ran: its function wrote its effect line in this run. */
typedef struct book_step {
    const char *name;
    bool ran;
} book_step;

static idem_code book_step_fn(idem_call *call, void *arg, idem_step_result *out)
{
    book_step *s = arg;
    char tail[80], output[96];
    snprintf(tail, sizeof(tail), " %s", s->name);
    if (!effect_write(call, tail, &s->ran)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "effect log write failed");
    }
    int n = snprintf(output, sizeof(output), "%s.%d.%" PRIu64, s->name, (int)getpid(),
                     idem_call_fence(call));
    if ((out->data = malloc((size_t)n)) == NULL) {
        return idem_call_fail(call, IDEM_RESOURCE_EXHAUSTED, "out of memory");
    }
    memcpy(out->data, output, (size_t)n);
    out->len = (size_t)n;
    return IDEM_OK;
}

/* Armed: writes this pid where the campaign waits for it, then waits (≤ 10 s) for the
 * SIGKILL that lands after the undo's effect and before its record. */
static void crash_if_armed(void)
{
    char tmp[700], pid[24];
    if (unlink(undo_crash) != 0) {
        return; /* not armed, or the other server took it */
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp", undo_crash_pid);
    int n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    bool told = fd >= 0 && write(fd, pid, (size_t)n) == n;
    if (fd >= 0) {
        close(fd);
    }
    if (!told || rename(tmp, undo_crash_pid) != 0) {
        return;
    }
    for (int i = 0; i < 100; i++) {
        chaos_sleep_ms(100);
    }
}

/* The undo of "hold" (its compensation): an effect line "undo=hold.PID.FENCE", naming
 * the hold it undoes by the output the store recorded for it (done), so that the checker
 * counts the undos of each hold whether or not its "hold recorded" note was written. One
 * key in three meets a provider that is down half the time (200 ms slots): the undo
 * fails transiently before its effect (a note "undo transient"), the call is released
 * with its journal, and a retry or the re-driver finishes the compensation. arg: NULL
 * (never the handler's). */
static idem_code hold_undo(idem_call *call, const char *step, const idem_step_result *done,
                           void *arg)
{
    (void)step, (void)arg;
    const char *key = idem_call_key(call);
    char tail[128];
    if (chaos_digest(key, strlen(key)) % 3 == 0 && chaos_now_ms() / 200 % 2 == 0) {
        effect_write(call, " undo transient", NULL); /* a note, best effort */
        return idem_call_fail(call, IDEM_UNAVAILABLE, "undo: the provider is unavailable");
    }
    int len = done != NULL && done->len < 96 ? (int)done->len : 0;
    snprintf(tail, sizeof(tail), " undo=%.*s", len, len > 0 ? (const char *)done->data : "");
    if (!effect_write(call, tail, NULL)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "effect log write failed");
    }
    crash_if_armed();
    return IDEM_OK;
}

/* Runs (or replays) step s and notes how its record ended when it ran: "recorded" (its
 * effect must never show again: a recorded step replays) or "unrecorded:CODE" (the
 * checker's evidence of why its effect may show twice). */
static idem_code book_step_run(idem_call *call, book_step *s, idem_step_result *out)
{
    idem_step_opts undo = {.undo = hold_undo};
    idem_code code = idem_call_step_with(call, s->name, book_step_fn, s,
                                         strcmp(s->name, "hold") == 0 ? &undo : NULL, out);
    if (code == IDEM_OK) {
        if (s->ran) {
            char tail[80];
            snprintf(tail, sizeof(tail), " %s recorded", s->name);
            effect_write(call, tail, NULL); /* best effort: a missing note excuses nothing */
        }
        return IDEM_OK;
    }
    char why[256], tail[96];
    snprintf(why, sizeof(why), "%s", idem_errmsg());
    if (s->ran) {
        snprintf(tail, sizeof(tail), " %s unrecorded:%s", s->name, idem_code_name(code));
        effect_write(call, tail, NULL); /* best effort: a missing note excuses nothing */
    }
    return idem_call_fail(call, code, "step %s: %s", s->name, why);
}

static idem_code book(idem_call *call, void *arg)
{
    (void)arg;
    book_step hold = {"hold", false}, pay = {"pay", false};
    idem_step_result h = {0}, p = {0};
    const char *key = idem_call_key(call);
    size_t n;
    const char *payload = idem_call_payload(call, &n);
    bool declined = n >= 7 && memcmp(payload, "decline", 7) == 0;
    idem_code code = book_step_run(call, &hold, &h);
    if (code == IDEM_OK) {
        /* A slow provider, now and then slower: not for a declined call, which is released
         * when undone, so that a retry after the client's 1 s attempt timeout would run
         * it afresh, again and again, and never learn its outcome (as documented). */
        uint64_t d = chaos_digest(key, strlen(key));
        chaos_sleep_ms(d % 20 == 0 && !declined ? 4 * lease_ms : 10 + d % 51);
        code = declined
                   ? idem_call_fail(call, IDEM_FAILED_PRECONDITION,
                                    "card declined caller=%s key=%s", idem_call_caller(call), key)
                   : book_step_run(call, &pay, &p);
    }
    if (code == IDEM_OK) {
        char extra[256];
        snprintf(extra, sizeof(extra), " hold=%.*s pay=%.*s", (int)h.len, (const char *)h.data,
                 (int)p.len, (const char *)p.data);
        code = reply_execution(call, IDEM_OK, extra);
    }
    idem_step_result_clear(&h);
    idem_step_result_clear(&p);
    return code;
}

typedef struct serve_opts {
    const char *listen, *http, *grpc, *db, *pg, *redis, *effects;
    uint64_t lease_ms, map_size, redrive_ms;
} serve_opts;

static int serve_usage(void)
{
    fprintf(stderr,
            "usage: idemrpc-chaos --serve --listen URL --effects FILE "
            "(--db DIR [--map-size BYTES] | --pg CONNINFO [--redis URL])\n"
            "                     [--lease-ms N] [--redrive-ms N] [--http URL] [--grpc URL]\n");
    return CLI_USAGE_ERROR;
}

/* Where the value of the text option c goes (NULL: c takes no text). */
static const char **serve_text(serve_opts *so, int c)
{
    switch (c) {
    case 'l':
        return &so->listen;
    case 'h':
        return &so->http;
    case 'g':
        return &so->grpc;
    case 'd':
        return &so->db;
    case 'p':
        return &so->pg;
    case 'r':
        return &so->redis;
    case 'e':
        return &so->effects;
    default:
        return NULL;
    }
}

static bool serve_parse(int argc, char **argv, serve_opts *so)
{
    static const struct option longs[] = {{"serve", no_argument, NULL, 'S'},
                                          {"listen", required_argument, NULL, 'l'},
                                          {"http", required_argument, NULL, 'h'},
                                          {"grpc", required_argument, NULL, 'g'},
                                          {"db", required_argument, NULL, 'd'},
                                          {"pg", required_argument, NULL, 'p'},
                                          {"redis", required_argument, NULL, 'r'},
                                          {"effects", required_argument, NULL, 'e'},
                                          {"lease-ms", required_argument, NULL, 'L'},
                                          {"map-size", required_argument, NULL, 'm'},
                                          {"redrive-ms", required_argument, NULL, 'R'},
                                          {NULL, 0, NULL, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
        const char **text = serve_text(so, c);
        if (text != NULL) {
            *text = optarg;
            continue;
        }
        switch (c) {
        case 'S':
            break;
        case 'L':
            if (!cli_parse_u64("idemrpc-chaos", "--lease-ms", optarg, 1, 600000, &so->lease_ms)) {
                return false;
            }
            break;
        case 'm':
            if (!cli_parse_u64("idemrpc-chaos", "--map-size", optarg, 1 << 20, 1ull << 40,
                               &so->map_size)) {
                return false;
            }
            break;
        case 'R':
            if (!cli_parse_u64("idemrpc-chaos", "--redrive-ms", optarg, 0, 600000,
                               &so->redrive_ms)) {
                return false;
            }
            break;
        default:
            return false;
        }
    }
    return so->listen != NULL && so->effects != NULL && (so->db != NULL) != (so->pg != NULL);
}

static idem_code serve_register(idem_server *srv, bool lmdb)
{
    unsigned window = lmdb ? 0 : IDEM_METHOD_DEBOUNCE;
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts token = {.flags =
                                  IDEM_METHOD_TOKEN_REQUIRED | window | IDEM_METHOD_TRANSACTIONAL};
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED | window};
    idem_method_opts steps = {.flags = IDEM_METHOD_STEPS | window}; /* a claim, a key */
    idem_code code;
    if ((code = idem_server_register(srv, CHAOS_METHOD_TRANSFER, transfer, NULL, &tx)) != IDEM_OK) {
        return code;
    }
    if ((code = idem_server_register(srv, CHAOS_METHOD_ORDER, order, NULL, &token)) != IDEM_OK) {
        return code;
    }
    if ((code = idem_server_register(srv, CHAOS_METHOD_ADD, add, NULL, &cached)) != IDEM_OK) {
        return code;
    }
    return idem_server_register(srv, CHAOS_METHOD_BOOK, book, NULL, &steps);
}

int chaos_serve(int argc, char **argv)
{
    serve_opts so = {0};
    idem_server_opts o;
    idem_server *srv = NULL;
    idem_store *pg = NULL;
    idem_debounce *window = NULL;
    if (!serve_parse(argc, argv, &so)) {
        return serve_usage();
    }
    snprintf(undo_crash, sizeof(undo_crash), "%s.undo-crash", so.effects);
    snprintf(undo_crash_pid, sizeof(undo_crash_pid), "%s.undo-crash.pid", so.effects);
    if ((effects_fd = open(so.effects, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600)) < 0) {
        perror(so.effects);
        return 1;
    }
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &term, NULL);

    idem_server_opts_init(&o);
    o.lease_ms = lease_ms = so.lease_ms;
    o.workers = 8;
    o.sweep_interval_ms = 3600 * 1000; /* the checker reads every record the run wrote */
    o.db_path = so.db;
    o.map_size = (size_t)so.map_size;      /* the agent's too: its full is ours */
    o.redrive_interval_ms = so.redrive_ms; /* the lease stays the campaign's */
    if (so.pg != NULL &&
        (idem_store_open_postgres(&pg, so.pg, 8) != IDEM_OK ||
         (so.redis != NULL && idem_debounce_create(&window, so.redis, 200) != IDEM_OK))) {
        fprintf(stderr, "chaos server: %s\n", idem_errmsg());
        return 1;
    }
    o.store = pg;
    o.debounce = window;
    o.http_request_timeout_ms = CHAOS_HTTP_REQUEST_TIMEOUT_MS;
    o.http_max_conns = CHAOS_HTTP_MAX_CONNS;
    o.grpc_request_timeout_ms = CHAOS_GRPC_REQUEST_TIMEOUT_MS;
    if (idem_server_create(&srv, &o) != IDEM_OK || serve_register(srv, pg == NULL) != IDEM_OK ||
        idem_server_listen(srv, so.listen) != IDEM_OK ||
        (so.http != NULL && idem_server_listen_http(srv, so.http) != IDEM_OK) ||
        (so.grpc != NULL && idem_server_listen_grpc(srv, so.grpc) != IDEM_OK)) {
        fprintf(stderr, "chaos server: %s\n", idem_errmsg());
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    int sig;
    sigwait(&term, &sig);
    idem_server_destroy(srv);
    idem_debounce_destroy(window);
    if (pg != NULL) {
        idem_store_close(pg);
    }
    close(effects_fd);
    return 0;
}

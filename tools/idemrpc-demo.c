/* idemrpc-demo: a server whose Counter/Add is deliberately NOT idempotent (it adds to
 * an in-memory total), so that the result cache is the only thing standing between a
 * retried call and a double add.
 *
 *   demo.Counter/Add     payload "N" → new total; cached, key required; metadata "fence"
 *   demo.Counter/Get     → total; plain (read-only: nothing to dedupe)
 *   demo.Order/Submit    → "ORD-000001"...; needs a token from idem.Token/Issue
 *   demo.Pay/Notify      payload "out_trade_no=T&amount=N&sign=S" → adds N to the total;
 *                        key = out_trade_no, fingerprint = out_trade_no + amount (a
 *                        re-signed redelivery replays, another amount is key reuse) */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <idemrpc/idemrpc.h>

typedef struct demo {
    pthread_mutex_t mu;
    long long total;
    unsigned long orders;
    long delay_ms;      /* --delay-ms: makes Add slow, to show duplicates waiting */
    long flaky;         /* --flaky: this many executions answer UNAVAILABLE first */
} demo;

/* --flaky N: the first N executions (of any method) fail transiently. */
static bool flaky_now(demo *d)
{
    pthread_mutex_lock(&d->mu);
    bool fail = d->flaky > 0;
    d->flaky -= fail;
    pthread_mutex_unlock(&d->mu);
    return fail;
}

static bool parse_ll(const void *p, size_t n, long long *out)
{
    char buf[32];
    if (n == 0 || n >= sizeof(buf)) {
        return false;
    }
    memcpy(buf, p, n);
    buf[n] = '\0';
    char *end;
    errno = 0;
    *out = strtoll(buf, &end, 10);
    return errno == 0 && *end == '\0';
}

static idem_code reply_number(idem_call *call, long long v)
{
    char out[32];
    int n = snprintf(out, sizeof(out), "%lld", v);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static idem_code add_to_total(idem_call *call, demo *d, long long delta)
{
    char fence[24];
    if (flaky_now(d)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "flaky: try again");
    }
    if (d->delay_ms > 0) {
        struct timespec ts = {d->delay_ms / 1000, (d->delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&d->mu);
    long long total = d->total += delta;
    pthread_mutex_unlock(&d->mu);
    snprintf(fence, sizeof(fence), "%" PRIu64, idem_call_fence(call));
    idem_call_set_response_metadata(call, "fence", fence);
    return reply_number(call, total);
}

static idem_code counter_add(idem_call *call, void *arg)
{
    size_t n;
    const void *p = idem_call_payload(call, &n);
    long long delta;
    if (!parse_ll(p, n, &delta)) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload must be a decimal integer");
    }
    return add_to_total(call, arg, delta);
}

/* The value of field name in an "a=1&b=2" payload into out (cap bytes); false if absent. */
static bool form_field(const idem_call *call, const char *name, char *out, size_t cap)
{
    size_t n, nl = strlen(name);
    const char *p = idem_call_payload(call, &n), *end = p + n;
    while (p < end) {
        const char *amp = memchr(p, '&', (size_t)(end - p));
        const char *stop = amp != NULL ? amp : end;
        if ((size_t)(stop - p) > nl && memcmp(p, name, nl) == 0 && p[nl] == '=') {
            size_t vl = (size_t)(stop - p) - nl - 1;
            if (vl == 0 || vl >= cap) {
                return false;
            }
            memcpy(out, p + nl + 1, vl);
            out[vl] = '\0';
            return true;
        }
        p = stop + 1;
    }
    return false;
}

static bool notify_key(const idem_call *call, char *buf, size_t cap, void *arg)
{
    (void)arg;
    return form_field(call, "out_trade_no", buf, cap);
}

/* out_trade_no and amount make two notifications the same; sign and the rest do not. */
static bool notify_fingerprint(const idem_call *call, void *buf, size_t cap, size_t *len,
                               void *arg)
{
    (void)arg;
    char trade_no[256], amount[32];
    if (!form_field(call, "out_trade_no", trade_no, sizeof(trade_no)) ||
        !form_field(call, "amount", amount, sizeof(amount))) {
        return false;
    }
    int n = snprintf(buf, cap, "%s|%s", trade_no, amount);
    *len = (size_t)n;
    return n > 0 && (size_t)n < cap;
}

static idem_code pay_notify(idem_call *call, void *arg)
{
    char amount[32];
    long long cents;
    if (!form_field(call, "amount", amount, sizeof(amount)) ||
        !parse_ll(amount, strlen(amount), &cents)) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "amount must be a decimal integer");
    }
    return add_to_total(call, arg, cents);
}

static idem_code counter_get(idem_call *call, void *arg)
{
    demo *d = arg;
    pthread_mutex_lock(&d->mu);
    long long total = d->total;
    pthread_mutex_unlock(&d->mu);
    return reply_number(call, total);
}

static idem_code order_submit(idem_call *call, void *arg)
{
    demo *d = arg;
    char out[32];
    if (flaky_now(d)) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "flaky: try again");
    }
    pthread_mutex_lock(&d->mu);
    unsigned long no = ++d->orders;
    pthread_mutex_unlock(&d->mu);
    int n = snprintf(out, sizeof(out), "ORD-%06lu", no);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static int usage(void)
{
    fprintf(stderr, "usage: idemrpc-demo [--listen URL] [--http URL] [--db DIR | --store URL]\n"
                    "                    [--debounce URL] [--delay-ms N] [--flaky N]\n"
                    "                    [--log-level off|error|info] [--result-ttl-ms N]\n"
                    "                    [--max-wait-ms N] [--lease-ms N] [--max-run-ms N]\n"
                    "  --listen URL   nng URL to serve (default tcp://127.0.0.1:7700)\n"
                    "  --http URL     also serve HTTP, e.g. http://127.0.0.1:7780\n"
                    "  --db DIR       LMDB directory (default ./idemrpc-data)\n"
                    "  --store URL    share records in PostgreSQL (postgres://...) instead\n"
                    "  --debounce URL redis://HOST:PORT: 2 s double-submit window for Submit\n"
                    "  --delay-ms N   make Counter/Add and Pay/Notify take N ms\n"
                    "  --flaky N      the first N executions answer UNAVAILABLE\n"
                    "  --log-level L  one line per call at info (default error)\n"
                    "  --result-ttl-ms N, --max-wait-ms N, --lease-ms N, --max-run-ms N\n"
                    "                 override the server defaults\n");
    return 2;
}

static bool parse_level(const char *s, idem_log_level *out)
{
    static const char *const names[] = {"off", "error", "info"};
    for (int i = 0; i < 3; i++) {
        if (strcmp(s, names[i]) == 0) {
            *out = (idem_log_level)i;
            return true;
        }
    }
    return false;
}

int main(int argc, char **argv)
{
    const char *listen = "tcp://127.0.0.1:7700", *db = "./idemrpc-data", *http = NULL;
    const char *store_url = NULL, *debounce_url = NULL;
    idem_log_level level = IDEM_LOG_ERROR;
    idem_server_opts opts;
    idem_server_opts_init(&opts);
    demo d = {.mu = PTHREAD_MUTEX_INITIALIZER};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--listen") == 0 && i + 1 < argc) {
            listen = argv[++i];
        } else if (strcmp(argv[i], "--db") == 0 && i + 1 < argc) {
            db = argv[++i];
        } else if (strcmp(argv[i], "--delay-ms") == 0 && i + 1 < argc) {
            d.delay_ms = strtol(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--store") == 0 && i + 1 < argc) {
            store_url = argv[++i];
        } else if (strcmp(argv[i], "--debounce") == 0 && i + 1 < argc) {
            debounce_url = argv[++i];
        } else if (strcmp(argv[i], "--http") == 0 && i + 1 < argc) {
            http = argv[++i];
        } else if (strcmp(argv[i], "--result-ttl-ms") == 0 && i + 1 < argc) {
            opts.result_ttl_ms = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--max-wait-ms") == 0 && i + 1 < argc) {
            opts.max_wait_ms = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--lease-ms") == 0 && i + 1 < argc) {
            opts.lease_ms = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--max-run-ms") == 0 && i + 1 < argc) {
            opts.max_run_ms = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--flaky") == 0 && i + 1 < argc) {
            d.flaky = strtol(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--log-level") == 0 && i + 1 < argc) {
            if (!parse_level(argv[++i], &level)) {
                return usage();
            }
        } else {
            return usage();
        }
    }

    /* Block the stop signals before any thread starts; main waits for them below. */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);

    opts.db_path = db;
    opts.log_level = level;
    idem_store *shared = NULL;
    idem_debounce *debounce = NULL;
    if (store_url != NULL &&
        idem_store_open_postgres(&shared, store_url, opts.workers ? opts.workers : 16) != IDEM_OK) {
        fprintf(stderr, "idemrpc-demo: %s\n", idem_errmsg());
        return 1;
    }
    if (debounce_url != NULL && idem_debounce_create(&debounce, debounce_url, 2000) != IDEM_OK) {
        fprintf(stderr, "idemrpc-demo: %s\n", idem_errmsg());
        return 1;
    }
    opts.store = shared;
    opts.debounce = debounce;
    idem_server *srv;
    idem_method_opts add = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    idem_method_opts submit = {.flags = IDEM_METHOD_TOKEN_REQUIRED | IDEM_METHOD_DEBOUNCE};
    idem_method_opts notify = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED,
                               .extractor = notify_key,
                               .fingerprint = notify_fingerprint};
    if (idem_server_create(&srv, &opts) != IDEM_OK ||
        idem_server_register(srv, "demo.Counter/Add", counter_add, &d, &add) != IDEM_OK ||
        idem_server_register(srv, "demo.Counter/Get", counter_get, &d, NULL) != IDEM_OK ||
        idem_server_register(srv, "demo.Order/Submit", order_submit, &d, &submit) != IDEM_OK ||
        idem_server_register(srv, "demo.Pay/Notify", pay_notify, &d, &notify) != IDEM_OK ||
        idem_server_listen(srv, listen) != IDEM_OK ||
        (http != NULL && idem_server_listen_http(srv, http) != IDEM_OK)) {
        fprintf(stderr, "idemrpc-demo: %s\n", idem_errmsg());
        return 1;
    }
    if (http != NULL) {
        printf("idemrpc-demo http on port %d\n", idem_server_http_port(srv));
    }
    printf("idemrpc-demo listening on %s (store %s%s)\n", listen, shared != NULL ? "postgres" : db,
           debounce != NULL ? ", redis debounce 2 s" : "");
    fflush(stdout);

    int sig;
    sigwait(&stop, &sig);
    fprintf(stderr, "idemrpc-demo: signal %d, shutting down\n", sig);
    idem_server_destroy(srv);
    idem_store_close(shared);
    idem_debounce_destroy(debounce);
    return 0;
}

/* idemrpc-demo: a server whose Counter/Add is deliberately NOT idempotent (it adds to
 * an in-memory total), so that the result cache is the only thing standing between a
 * retried call and a double add. The methods are in demo_methods.c; this file is the
 * command line, the stores and the server's life. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <idemrpc/idemrpc.h>

#include "cli.h"
#include "demo.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: idemrpc-demo [--listen URL] [--http URL] [--grpc URL]\n"
               "                    [--db DIR | --store URL]\n"
               "                    [--debounce URL] [--nats URL] [--delay-ms N] [--flaky N]\n"
               "                    [--log-level off|error|info] [--result-ttl-ms N]\n"
               "                    [--max-wait-ms N] [--lease-ms N] [--max-run-ms N]\n"
               "                    [--caller-secrets FILE] [--ipc-uid UID=CALLER]...\n"
               "                    [--require-verified-caller]\n"
               "                    [--tls URL | --https URL] [--tls-cert FILE]\n"
               "                    [--tls-client-ca FILE] [--tls-caller NAME]\n"
               "  --listen URL   nng URL to serve (default tcp://127.0.0.1:7700)\n"
               "  --http URL     also serve HTTP, e.g. http://127.0.0.1:7780\n"
               "  --grpc URL     also serve gRPC (h2c), e.g. tcp://127.0.0.1:7790\n"
               "  --db DIR       LMDB directory (default ./idemrpc-data)\n"
               "  --store URL    share records in PostgreSQL (postgres://...) instead\n"
               "  --debounce URL redis://HOST:PORT: 2 s double-submit window for Submit\n"
               "  --nats URL     a consumer of stream DEMO and the outbox relay (nats://...),\n"
               "                 their counts on /metrics\n"
               "  --delay-ms N   make Counter/Add and Pay/Notify take N ms\n"
               "  --flaky N      the first N executions answer UNAVAILABLE\n"
               "  --log-level L  one line per call at info (default error)\n"
               "  --result-ttl-ms N, --max-wait-ms N, --lease-ms N, --max-run-ms N,\n"
               "  --http-request-timeout-ms N, --sweep-interval-ms N\n"
               "                 override the server defaults\n"
               "  --caller-secrets FILE  lines \"CALLER SECRET\" (\"CALLER SECRET proxy\" for a\n"
               "                 proxy that signs for others; # comments): verify signed calls\n"
               "  --ipc-uid UID=CALLER   an ipc:// peer with this uid is CALLER (repeatable)\n"
               "  --require-verified-caller  refuse calls whose caller is not verified\n"
               "  --tls URL      also serve tls+tcp://HOST:PORT, requiring client certificates\n"
               "  --https URL    serve HTTP over TLS (instead of --http), the same way\n"
               "  --tls-cert FILE       the server's certificate and key (PEM)\n"
               "  --tls-client-ca FILE  the CA whose clients may connect (PEM)\n"
               "  --tls-caller NAME     the caller every such client is\n"
               "  Without these, callers are taken as they name themselves: trusted network\n"
               "  only (docs/security.md).\n"
               "  --version      print the version and exit\n");
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

/* The command line's strings and level; the numbers go straight into opts and d. */
typedef struct demo_args {
    const char *listen, *db, *http, *grpc, *store_url, *debounce_url, *nats_url;
    idem_log_level level;
    idem_caller_secret *secrets; /* --caller-secrets, malloc'd */
    size_t n_secrets;
    idem_ipc_caller uids[16]; /* --ipc-uid */
    size_t n_uids;
    const char *tls_url, *https_url; /* --tls, --https */
    idem_tls_listener tls;           /* --tls-cert, --tls-client-ca, --tls-caller */
} demo_args;

/* --caller-secrets FILE: "CALLER SECRET [proxy]" per line; the server checks bounds. */
static bool load_secrets(const char *path, demo_args *a)
{
    FILE *f = fopen(path, "r");
    char line[512];
    unsigned no = 0;
    if (f == NULL) {
        fprintf(stderr, "idemrpc-demo: --caller-secrets: %s: %s\n", path, strerror(errno));
        return false;
    }
    while (fgets(line, sizeof(line), f) != NULL) {
        char caller[256], secret[300], flag[16] = "";
        no++;
        if (line[strspn(line, " \t\r\n")] == '\0' || line[strspn(line, " \t")] == '#') {
            continue;
        }
        int n = sscanf(line, "%255s %299s %15s", caller, secret, flag);
        idem_caller_secret *grown = realloc(a->secrets, (a->n_secrets + 1) * sizeof(*grown));
        if (n < 2 || (n == 3 && strcmp(flag, "proxy") != 0) || grown == NULL ||
            a->n_secrets >= IDEM_MAX_CALLER_SECRETS) {
            fprintf(stderr, "idemrpc-demo: %s:%u: expected \"CALLER SECRET [proxy]\"\n", path, no);
            fclose(f);
            free(grown);
            return false;
        }
        a->secrets = grown;
        a->secrets[a->n_secrets++] = (idem_caller_secret){
            .caller = strdup(caller), .secret = strdup(secret), .proxy = n == 3};
    }
    fclose(f);
    return true;
}

/* --ipc-uid UID=CALLER */
static bool parse_uid(const char *v, demo_args *a)
{
    const char *eq = strchr(v, '=');
    char num[24];
    uint64_t uid;
    if (eq == NULL || eq == v || (size_t)(eq - v) >= sizeof(num) || eq[1] == '\0' ||
        a->n_uids >= (sizeof(a->uids) / sizeof(a->uids[0]))) {
        fprintf(stderr, "idemrpc-demo: --ipc-uid: '%s' is not UID=CALLER (at most %zu)\n", v,
                (sizeof(a->uids) / sizeof(a->uids[0])));
        return false;
    }
    memcpy(num, v, (size_t)(eq - v));
    num[eq - v] = '\0';
    if (!cli_parse_u64("idemrpc-demo", "--ipc-uid", num, 0, UINT32_MAX, &uid)) {
        return false;
    }
    a->uids[a->n_uids++] = (idem_ipc_caller){.uid = uid, .caller = eq + 1};
    return true;
}

/* The value v of a number option into *out; false, after naming the option, when it
 * is bad. */
static bool number(const char *opt, const char *v, uint64_t *out)
{
    return cli_parse_u64("idemrpc-demo", opt, v, 0, UINT64_MAX, out);
}

/* A number option for a long field of demo. */
static bool number_long(const char *opt, const char *v, long *out)
{
    uint64_t n;
    if (!cli_parse_u64("idemrpc-demo", opt, v, 0, LONG_MAX, &n)) {
        return false;
    }
    *out = (long)n;
    return true;
}

/* One option about who may call and how (caller secrets, uids, TLS, the log level) and
 * its value v; false on a bad value or an unknown option. */
static bool parse_caller_option(int opt, const char *v, demo_args *a, idem_server_opts *o)
{
    switch (opt) {
    case 'S':
        return load_secrets(v, a);
    case 'U':
        return parse_uid(v, a);
    case 'V':
        o->require_verified_caller = true;
        return true;
    case 't':
        a->tls_url = v;
        return true;
    case 'T':
        a->https_url = v;
        return true;
    case 'C':
        a->tls.cert_key_file = v;
        return true;
    case 'A':
        a->tls.client_ca_file = v;
        return true;
    case 'N':
        a->tls.caller = v;
        return true;
    case 'v':
        if (!parse_level(v, &a->level)) {
            fprintf(stderr, "idemrpc-demo: --log-level: '%s' is not off, error or info\n", v);
            return false;
        }
        return true;
    default:
        return false; /* getopt_long said which option */
    }
}

/* One option (getopt_long's opt) and its value v; false on a bad value. */
static bool parse_option(int opt, const char *v, demo_args *a, idem_server_opts *o, demo *d)
{
    switch (opt) {
    case 'l':
        a->listen = v;
        return true;
    case 'd':
        a->db = v;
        return true;
    case 's':
        a->store_url = v;
        return true;
    case 'b':
        a->debounce_url = v;
        return true;
    case 'n':
        a->nats_url = v;
        return true;
    case 'H':
        a->http = v;
        return true;
    case 'G':
        a->grpc = v;
        return true;
    case 'D':
        return number_long("--delay-ms", v, &d->delay_ms);
    case 'f':
        return number_long("--flaky", v, &d->flaky);
    case 'r':
        return number("--result-ttl-ms", v, &o->result_ttl_ms);
    case 'w':
        return number("--max-wait-ms", v, &o->max_wait_ms);
    case 'L':
        return number("--lease-ms", v, &o->lease_ms);
    case 'R':
        return number("--max-run-ms", v, &o->max_run_ms);
    case 'Q':
        return number("--http-request-timeout-ms", v, &o->http_request_timeout_ms);
    case 'I':
        return number("--sweep-interval-ms", v, &o->sweep_interval_ms);
    default:
        return parse_caller_option(opt, v, a, o);
    }
}

/* True to run; false with *status the exit status (0 after --help, 2 after a usage
 * error). */
static bool parse(int argc, char **argv, demo_args *a, idem_server_opts *o, demo *d, int *status)
{
    static const struct option longs[] = {{"listen", required_argument, NULL, 'l'},
                                          {"db", required_argument, NULL, 'd'},
                                          {"store", required_argument, NULL, 's'},
                                          {"debounce", required_argument, NULL, 'b'},
                                          {"nats", required_argument, NULL, 'n'},
                                          {"http", required_argument, NULL, 'H'},
                                          {"grpc", required_argument, NULL, 'G'},
                                          {"delay-ms", required_argument, NULL, 'D'},
                                          {"flaky", required_argument, NULL, 'f'},
                                          {"result-ttl-ms", required_argument, NULL, 'r'},
                                          {"max-wait-ms", required_argument, NULL, 'w'},
                                          {"lease-ms", required_argument, NULL, 'L'},
                                          {"max-run-ms", required_argument, NULL, 'R'},
                                          {"http-request-timeout-ms", required_argument, NULL, 'Q'},
                                          {"sweep-interval-ms", required_argument, NULL, 'I'},
                                          {"log-level", required_argument, NULL, 'v'},
                                          {"caller-secrets", required_argument, NULL, 'S'},
                                          {"ipc-uid", required_argument, NULL, 'U'},
                                          {"require-verified-caller", no_argument, NULL, 'V'},
                                          {"tls", required_argument, NULL, 't'},
                                          {"https", required_argument, NULL, 'T'},
                                          {"tls-cert", required_argument, NULL, 'C'},
                                          {"tls-client-ca", required_argument, NULL, 'A'},
                                          {"tls-caller", required_argument, NULL, 'N'},
                                          {"help", no_argument, NULL, 'h'},
                                          {"version", no_argument, NULL, CLI_OPT_VERSION},
                                          {NULL, 0, NULL, 0}};
    int opt;

    *status = CLI_USAGE_ERROR;
    while ((opt = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        if (opt == 'h' || opt == CLI_OPT_VERSION) {
            opt == 'h' ? usage(stdout) : cli_print_version("idemrpc-demo");
            *status = 0;
            return false;
        }
        if (!parse_option(opt, optarg, a, o, d)) {
            usage(stderr);
            return false;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "idemrpc-demo: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return false;
    }
    return true;
}

/* The shared stores the options name (PostgreSQL, Redis debounce), set into opts;
 * false (after saying why) when one does not open. */
static bool open_stores(const demo_args *a, idem_server_opts *opts, idem_store **shared,
                        idem_debounce **debounce)
{
    if (a->store_url != NULL &&
        idem_store_open_postgres(shared, a->store_url, opts->workers ? opts->workers : 16) !=
            IDEM_OK) {
        fprintf(stderr, "idemrpc-demo: %s\n", idem_errmsg());
        return false;
    }
    if (a->debounce_url != NULL &&
        idem_debounce_create(debounce, a->debounce_url, 2000) != IDEM_OK) {
        fprintf(stderr, "idemrpc-demo: %s\n", idem_errmsg());
        return false;
    }
    opts->store = *shared;
    opts->debounce = *debounce;
    return true;
}

/* The server with the demo's four methods, listening where the options say; false
 * (after saying why) on any failure. */
static bool start_server(idem_server **srv, const demo_args *a, const idem_server_opts *opts,
                         demo *d)
{
    if (idem_server_create(srv, opts) != IDEM_OK || demo_register(*srv, d) != IDEM_OK ||
        idem_server_listen(*srv, a->listen) != IDEM_OK ||
        (a->tls_url != NULL && idem_server_listen_tls(*srv, a->tls_url, &a->tls) != IDEM_OK) ||
        (a->https_url != NULL &&
         idem_server_listen_https(*srv, a->https_url, &a->tls) != IDEM_OK) ||
        (a->http != NULL && idem_server_listen_http(*srv, a->http) != IDEM_OK) ||
        (a->grpc != NULL && idem_server_listen_grpc(*srv, a->grpc) != IDEM_OK)) {
        fprintf(stderr, "idemrpc-demo: %s\n", idem_errmsg());
        return false;
    }
    return true;
}

/* The lines a script waits for: the HTTP port, then where it listens and for whom. */
static void print_banner(idem_server *srv, const demo_args *a, const idem_server_opts *opts)
{
    if (a->http != NULL || a->https_url != NULL) {
        printf("idemrpc-demo http on port %d\n", idem_server_http_port(srv));
    }
    if (a->grpc != NULL) {
        printf("idemrpc-demo grpc on port %d\n", idem_server_grpc_port(srv));
    }
    printf("idemrpc-demo listening on %s (store %s%s; callers %s)\n", a->listen,
           opts->store != NULL ? "postgres" : a->db,
           opts->debounce != NULL ? ", redis debounce 2 s" : "",
           opts->require_verified_caller ? "verified only"
           : a->n_secrets > 0 || a->n_uids > 0 || a->tls_url != NULL || a->https_url != NULL
               ? "verified when signed, mapped or over TLS"
               : "self-declared, trusted network only");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    demo_args a = {
        .listen = "tcp://127.0.0.1:7700", .db = "./idemrpc-data", .level = IDEM_LOG_ERROR};
    idem_server_opts opts;
    idem_server_opts_init(&opts);
    demo d = {.mu = PTHREAD_MUTEX_INITIALIZER};
    int status;
    if (!parse(argc, argv, &a, &opts, &d, &status)) {
        return status;
    }

    /* Block the stop signals before any thread starts; main waits for them below. */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);

    opts.db_path = a.db;
    opts.log_level = a.level;
    opts.caller_secrets = a.secrets;
    opts.n_caller_secrets = a.n_secrets;
    opts.ipc_callers = a.uids;
    opts.n_ipc_callers = a.n_uids;
    idem_store *shared = NULL;
    idem_debounce *debounce = NULL;
    idem_server *srv;
    demo_nats nats = {0};
    if (!open_stores(&a, &opts, &shared, &debounce) || !start_server(&srv, &a, &opts, &d) ||
        (a.nats_url != NULL && !demo_nats_start(&nats, srv, a.nats_url))) {
        return 1;
    }
    print_banner(srv, &a, &opts);

    int sig;
    sigwait(&stop, &sig);
    fprintf(stderr, "idemrpc-demo: signal %d, shutting down\n", sig);
    demo_nats_stop(&nats, srv);
    idem_server_destroy(srv);
    for (size_t i = 0; i < a.n_secrets; i++) {
        free((char *)a.secrets[i].caller);
        free((char *)a.secrets[i].secret);
    }
    free(a.secrets);
    idem_store_close(shared);
    idem_debounce_destroy(debounce);
    return 0;
}

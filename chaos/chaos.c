/* idemrpc-chaos: a bounded fault campaign and its checker (see chaos.h for the parts).
 *
 *   idemrpc-chaos --topology lmdb|pg --seconds N --seed S [--history FILE]
 *                 [--clients K] [--lease-ms L] [--map-mib M] [--dir DIR]
 *                 [--redrive-ms R]
 *   idemrpc-chaos --check --topology lmdb|pg --dir DIR   (checks a finished run again)
 *
 * The run: two servers (this binary, --serve) on ipc:// under DIR; K client threads and
 * the seeded fault schedule for N seconds; then the faults are healed, every undecided
 * operation is retried until decided (the settle pass), the servers stop on SIGTERM
 * and the checker reads the history, the effect log and the store. The closing line
 * is `chaos: N calls, F faults, V violations`; the exit status is 1 on any violation.
 * DIR (default a fresh /tmp/idemrpc-chaos-XXXXXX) and the history stay for inspection.
 * The seed fixes the fault schedule and the workload's choices; thread scheduling still
 * varies between runs. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef CHAOS_HAVE_PG
#include <libpq-fe.h>
#endif

#include "chaos.h"
#include "cli.h"

static const char usage[] =
    "usage: idemrpc-chaos --topology lmdb|pg|nats --seconds N --seed S [--history FILE]\n"
    "                     [--clients K] [--lease-ms L] [--map-mib M] [--dir DIR]\n"
    "                     [--redrive-ms R] [--slow-http-pct P] [--slow-grpc-pct G]\n"
    "       idemrpc-chaos --check --topology lmdb|pg|nats --dir DIR  (check a finished run again)\n"
    "  lmdb: two server processes on one LMDB directory; pg: two on one PostgreSQL\n"
    "  (IDEMRPC_TEST_PG) with Redis debounce (IDEMRPC_TEST_REDIS), faults through\n"
    "  IDEMRPC_SERVICES (scripts/services.sh). Defaults: 16 clients, 500 ms lease,\n"
    "  lmdb map of 32 MiB + 1 MiB per second of load, the servers' re-driver every\n"
    "  100 ms (--redrive-ms 0: off, to see the checker's liveness check fail);\n"
    "  --slow-http-pct P: P in 100 faults are slow_http (lmdb, pg; 0: the usual mix);\n"
    "  --slow-grpc-pct G: G in 100 are slow_grpc (a build with the gRPC front).\n"
    "  nats (a build with libnats): a nats-server -js of its own (nats-server on PATH),\n"
    "  two payment servers with outbox relays, two consumers on one durable; consumer\n"
    "  kill and stop, relay kill, broker restart; 4 clients unless --clients says.\n";

static int usage_error(const char *what)
{
    if (what != NULL) {
        fprintf(stderr, "idemrpc-chaos: %s\n", what);
    }
    fputs(usage, stderr);
    return CLI_USAGE_ERROR;
}

static bool parse_topology(const char *arg, chaos_topology *out)
{
    static const char *const names[] = {"lmdb", "pg", "nats"};
    static const chaos_topology topologies[] = {CHAOS_LMDB, CHAOS_PG, CHAOS_NATS};
    for (size_t i = 0; i < 3; i++) {
        if (strcmp(arg, names[i]) == 0) {
            *out = topologies[i];
            return true;
        }
    }
    return false;
}

/* 0 = parsed, else the exit status (--help: 0 via *done). */
static int parse(int argc, char **argv, chaos_cfg *cfg, bool *done)
{
    static const struct option longs[] = {{"topology", required_argument, NULL, 't'},
                                          {"seconds", required_argument, NULL, 's'},
                                          {"seed", required_argument, NULL, 'S'},
                                          {"history", required_argument, NULL, 'H'},
                                          {"clients", required_argument, NULL, 'c'},
                                          {"lease-ms", required_argument, NULL, 'L'},
                                          {"dir", required_argument, NULL, 'd'},
                                          {"help", no_argument, NULL, 'h'},
                                          {"check", no_argument, NULL, 'C'},
                                          {"map-mib", required_argument, NULL, 'M'},
                                          {"redrive-ms", required_argument, NULL, 'R'},
                                          {"slow-http-pct", required_argument, NULL, 'P'},
                                          {"slow-grpc-pct", required_argument, NULL, 'G'},
                                          {NULL, 0, NULL, 0}};
    bool topo = false, secs = false, seed = false;
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
        const char *p = "idemrpc-chaos";
        switch (c) {
        case 't':
            if (!parse_topology(optarg, &cfg->topology)) {
                return usage_error("--topology: 'lmdb', 'pg' or 'nats'");
            }
            topo = true;
            break;
        case 's':
            if (!(secs = cli_parse_u64(p, "--seconds", optarg, 1, 86400, &cfg->seconds))) {
                return usage_error(NULL);
            }
            break;
        case 'S':
            if (!(seed = cli_parse_u64(p, "--seed", optarg, 0, UINT64_MAX, &cfg->seed))) {
                return usage_error(NULL);
            }
            break;
        case 'c':
            if (!cli_parse_u64(p, "--clients", optarg, 1, 256, &cfg->clients)) {
                return usage_error(NULL);
            }
            break;
        case 'L':
            if (!cli_parse_u64(p, "--lease-ms", optarg, 100, 60000, &cfg->lease_ms)) {
                return usage_error(NULL);
            }
            break;
        case 'M':
            if (!cli_parse_u64(p, "--map-mib", optarg, 32, 1 << 20, &cfg->map_mib)) {
                return usage_error(NULL);
            }
            break;
        case 'R':
            if (!cli_parse_u64(p, "--redrive-ms", optarg, 0, 60000, &cfg->redrive_ms)) {
                return usage_error(NULL);
            }
            break;
        case 'P':
            if (!cli_parse_u64(p, "--slow-http-pct", optarg, 0, 100, &cfg->slow_http_pct)) {
                return usage_error(NULL);
            }
            break;
        case 'G':
            if (!cli_parse_u64(p, "--slow-grpc-pct", optarg, 0, 100, &cfg->slow_grpc_pct)) {
                return usage_error(NULL);
            }
            break;
        case 'H':
            snprintf(cfg->history, sizeof(cfg->history), "%s", optarg);
            break;
        case 'd':
            snprintf(cfg->dir, sizeof(cfg->dir), "%s", optarg);
            break;
        case 'C':
            cfg->check_only = true;
            break;
        case 'h':
            fputs(usage, stdout);
            *done = true;
            return 0;
        default: {
            char msg[128];
            snprintf(msg, sizeof(msg), "unknown option or missing value: %s", argv[optind - 1]);
            return usage_error(msg);
        }
        }
    }
    if (optind < argc) {
        char msg[128];
        snprintf(msg, sizeof(msg), "unexpected argument: %s", argv[optind]);
        return usage_error(msg);
    }
    if (cfg->check_only && (!topo || cfg->dir[0] == '\0')) {
        return usage_error("--check needs --topology and the --dir of a finished run");
    }
    if (!cfg->check_only && (!topo || !secs || !seed)) {
        return usage_error("--topology, --seconds and --seed are required");
    }
    return 0;
}

/* --check: the run id, the lease and the re-driver's interval come from the history's
 * "begin" event. */
static int read_begin(chaos_cfg *cfg)
{
    char line[1024] = "", lease[24] = "", redrive[24] = "";
    FILE *f = fopen(cfg->history, "r");
    if (f == NULL || fgets(line, sizeof(line), f) == NULL ||
        !chaos_history_field(line, "run", cfg->run, sizeof(cfg->run)) ||
        !chaos_history_field(line, "lease_ms", lease, sizeof(lease))) {
        fprintf(stderr, "idemrpc-chaos: %s: no begin event\n", cfg->history);
        if (f != NULL) {
            fclose(f);
        }
        return 1;
    }
    fclose(f);
    cfg->lease_ms = strtoull(lease, NULL, 10);
    if (chaos_history_field(line, "redrive_ms", redrive, sizeof(redrive))) {
        cfg->redrive_ms = strtoull(redrive, NULL, 10);
    }
    return 0;
}

/* pg: the run's own schema (chaos_RUN, kept for inspection like the rest of the run):
 * accounts and counts of an earlier run on the same database must not be counted. */
static int pg_schema(chaos_cfg *cfg, const char *base)
{
#ifndef CHAOS_HAVE_PG
    (void)cfg, (void)base;
    fprintf(stderr, "idemrpc-chaos: built without libpq: no pg topology\n");
    return CLI_USAGE_ERROR;
#else
    char sql[96];
    snprintf(cfg->pg_conninfo, sizeof(cfg->pg_conninfo), "%s options='-csearch_path=chaos_%s'",
             base, cfg->run);
    cfg->pg = cfg->pg_conninfo;
    if (cfg->check_only) {
        return 0;
    }
    snprintf(sql, sizeof(sql), "CREATE SCHEMA IF NOT EXISTS chaos_%s", cfg->run);
    PGconn *c = PQconnectdb(base);
    PGresult *r = PQstatus(c) == CONNECTION_OK ? PQexec(c, sql) : NULL;
    bool ok = r != NULL && PQresultStatus(r) == PGRES_COMMAND_OK;
    if (!ok) {
        fprintf(stderr, "idemrpc-chaos: %s: %s", sql, PQerrorMessage(c));
    }
    PQclear(r);
    PQfinish(c);
    return ok ? 0 : 1;
#endif
}

/* The environment the pg topology needs; the work dir and file names. */
static int prepare(chaos_cfg *cfg)
{
    if (cfg->topology == CHAOS_PG) {
        cfg->pg = getenv("IDEMRPC_TEST_PG");
        cfg->redis = getenv("IDEMRPC_TEST_REDIS");
        cfg->services = getenv("IDEMRPC_SERVICES");
        if (cfg->pg == NULL || cfg->redis == NULL) {
            fprintf(stderr, "idemrpc-chaos: --topology pg needs IDEMRPC_TEST_PG and "
                            "IDEMRPC_TEST_REDIS (eval \"$(bash scripts/services.sh start)\")\n");
            return CLI_USAGE_ERROR;
        }
        if (cfg->services == NULL) {
            fprintf(stderr, "idemrpc-chaos: IDEMRPC_SERVICES is not set: no PostgreSQL or "
                            "Redis faults, only server faults\n");
        }
    }
    if (cfg->dir[0] == '\0') {
        snprintf(cfg->dir, sizeof(cfg->dir), "/tmp/idemrpc-chaos-XXXXXX");
        if (mkdtemp(cfg->dir) == NULL) {
            perror("mkdtemp");
            return 1;
        }
    } else if (mkdir(cfg->dir, 0700) != 0 && errno != EEXIST) {
        perror(cfg->dir);
        return 1;
    }
    if (cfg->history[0] == '\0') {
        snprintf(cfg->history, sizeof(cfg->history), "%s/history.jsonl", cfg->dir);
    }
    snprintf(cfg->effects, sizeof(cfg->effects), "%s/effects.log", cfg->dir);
    snprintf(cfg->agent_log, sizeof(cfg->agent_log), "%s/agent.jsonl", cfg->dir);
    if (cfg->map_mib == 0) {
        cfg->map_mib = 32 + cfg->seconds; /* a 600 s run stores about 250 MB */
    }
    snprintf(cfg->run, sizeof(cfg->run), "r%" PRIu64 "p%d", cfg->seed % 1000000, (int)getpid());
    int rv = cfg->check_only ? read_begin(cfg) : 0;
    if (rv == 0 && cfg->topology == CHAOS_PG) {
        rv = pg_schema(cfg, cfg->pg);
    }
    if (rv != 0 || cfg->check_only) {
        return rv;
    }
    if (!chaos_history_open(cfg->history)) {
        perror(cfg->history);
        return 1;
    }
    return 0;
}

static void record_begin(const chaos_cfg *cfg)
{
    char seed[24], lease[24], secs[24], redrive[24];
    snprintf(redrive, sizeof(redrive), "%" PRIu64, cfg->redrive_ms);
    snprintf(seed, sizeof(seed), "%" PRIu64, cfg->seed);
    snprintf(lease, sizeof(lease), "%" PRIu64, cfg->lease_ms);
    snprintf(secs, sizeof(secs), "%" PRIu64, cfg->seconds);
    const char *topology = cfg->topology == CHAOS_PG     ? "pg"
                           : cfg->topology == CHAOS_NATS ? "nats"
                                                         : "lmdb";
    const char *f[] = {"topology", topology, "seed",     seed,  "seconds",    secs,
                       "run",      cfg->run, "lease_ms", lease, "redrive_ms", redrive};
    chaos_history_event("begin", 6, f);
}

void *chaos_fault_thread_main(void *arg)
{
    chaos_fault_thread *ft = arg;
    ft->faults = ft->run(ft->cfg, ft->stop);
    return NULL;
}

typedef struct timer {
    uint64_t seconds;
    volatile bool *stop;
} timer;

static void *timer_main(void *arg)
{
    timer *t = arg;
    chaos_sleep_ms(t->seconds * 1000);
    *t->stop = true;
    return NULL;
}

static void run(const chaos_cfg *cfg)
{
    static volatile bool stop_clients, stop_faults;
    chaos_fault_thread ft = {chaos_faults_run, cfg, &stop_faults, 0};
    timer tm = {cfg->seconds, &stop_clients};
    pthread_t fth, tth;
    chaos_totals t;
    pthread_create(&fth, NULL, chaos_fault_thread_main, &ft);
    pthread_create(&tth, NULL, timer_main, &tm);
    chaos_workload_run(cfg, &stop_clients, &t);
    const char *f[] = {"phase", "end"};
    chaos_history_event("load", 1, f); /* the store is idle from here to the settle pass */
    pthread_join(tth, NULL);
    stop_faults = true;
    pthread_join(fth, NULL);
    printf("chaos: %" PRIu64 " operations, %" PRIu64 " calls, %" PRIu64 " faults; %" PRIu64
           " operations undecided, settling\n",
           t.ops, t.calls, ft.faults, t.undecided);
    fflush(stdout);
    chaos_faults_heal(cfg);
    chaos_sleep_ms(2 * cfg->lease_ms);
    f[1] = "begin";
    chaos_history_event("settle", 1, f);
    chaos_workload_settle(cfg, &t);
    chaos_servers_sample_rss();
    chaos_sleep_ms(2 * cfg->lease_ms);
    chaos_servers_stop();
    f[1] = "end";
    chaos_history_event("settle", 1, f);
    printf("chaos: settled, %" PRIu64 " operations still undecided (and %" PRIu64
           " abandoned Books, left to the re-driver)\n",
           t.undecided, t.abandoned);
    fflush(stdout);
}

/* The broker topology's process roles; -1: not one of them. */
static int nats_role(int argc, char **argv)
{
    bool producer = argc > 1 && strcmp(argv[1], "--nats-producer") == 0;
    bool consumer = argc > 1 && strcmp(argv[1], "--nats-consumer") == 0;
    if (!producer && !consumer) {
        return -1;
    }
#ifdef CHAOS_HAVE_NATS
    return producer ? chaos_nats_producer(argc, argv) : chaos_nats_consumer(argc, argv);
#else
    fprintf(stderr, "idemrpc-chaos: built without libnats (-Dnats): no broker topology\n");
    return CLI_USAGE_ERROR;
#endif
}

static int nats_run(const chaos_cfg *cfg)
{
#ifdef CHAOS_HAVE_NATS
    return chaos_nats_run(cfg);
#else
    (void)cfg;
    fprintf(stderr, "idemrpc-chaos: built without libnats (-Dnats): no broker topology\n");
    return CLI_USAGE_ERROR;
#endif
}

static uint64_t nats_check(const chaos_cfg *cfg)
{
#ifdef CHAOS_HAVE_NATS
    return chaos_nats_check(cfg);
#else
    return nats_run(cfg) == 0 ? 0 : 1;
#endif
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--serve") == 0) {
        return chaos_serve(argc, argv);
    }
    if (argc > 1 && strcmp(argv[1], "--agent") == 0) {
        return chaos_agent(argc, argv);
    }
    int rc = nats_role(argc, argv);
    if (rc >= 0) {
        return rc;
    }
    chaos_cfg cfg = {.lease_ms = 500, .redrive_ms = CHAOS_REDRIVE_MS};
    bool done = false;
    rc = parse(argc, argv, &cfg, &done);
    if (cfg.clients == 0) {
        cfg.clients = cfg.topology == CHAOS_NATS ? 4 : 16;
    }
    if (rc != 0 || done || (rc = prepare(&cfg)) != 0) {
        return rc;
    }
    if (cfg.check_only) {
        return (cfg.topology == CHAOS_NATS ? nats_check(&cfg) : chaos_check(&cfg)) == 0 ? 0 : 1;
    }
    record_begin(&cfg);
    if (cfg.topology == CHAOS_NATS) {
        printf("chaos: topology nats, %" PRIu64 " s, seed %" PRIu64 ", %" PRIu64
               " clients, history %s\n",
               cfg.seconds, cfg.seed, cfg.clients, cfg.history);
        fflush(stdout);
        return nats_run(&cfg);
    }
    printf("chaos: topology %s, %" PRIu64 " s, seed %" PRIu64 ", re-driver %s, history %s\n",
           cfg.topology == CHAOS_PG ? "pg" : "lmdb", cfg.seconds, cfg.seed,
           cfg.redrive_ms > 0 ? "on" : "OFF", cfg.history);
    fflush(stdout);
    if (!chaos_servers_start(&cfg)) {
        chaos_servers_stop();
        return 1;
    }
    run(&cfg);
    chaos_history_close();
    return chaos_check(&cfg) == 0 ? 0 : 1;
}

/* idemrpc-bench: throughput, latency and cost of idemrpc next to its two baselines,
 * the nng transport (a bare req/rep echo) and the storage (a raw LMDB put+commit loop).
 *
 *   idemrpc-bench [--clients 1,16,64] [--payload 64] [--transport tcp,ipc]
 *                 [--seconds 1.5 | --count N] [--scenarios a,b,c,d,e,f[,g,h,i,j][,r,s,t,u][,v]]
 *                 [--csv FILE] [--json FILE] [--switches] [--no-log]
 *
 *   a  echo     bare nng rep0 echo: contexts + aio, the reply sent from the aio callback
 *   b  gc-off   default chain, a new key per call, durable store, one commit per write
 *   c  gc-on    same, group commit on (the store's default)
 *   d  nosync   same, IDEM_STORE_NOSYNC
 *   e  replay   each client cycles over its own 100 keys, all called once before the
 *               start: every timed call is a cache hit
 *   f  lmdb     raw LMDB, one put per durable transaction, one thread, no transport
 *   v  fdatasync the disk itself: pwrite of the payload at offset 0 and fdatasync, one
 *               thread, a file in a temp dir (f and v are the limits of b, c and k)
 *   g  pg-new   as c, on the PostgreSQL store ($IDEMRPC_BENCH_PG, a libpq conninfo)
 *   h  pg-new2  as g, two server instances on the one database, clients dial both
 *   i  pg-replay as e, on PostgreSQL
 *   q  pg-rep-cached  as i, the store's replay cache on (idem_pg_opts
 *               replay_cache_entries 16384: every client's 100 keys fit at 64 clients;
 *               the other bounds their defaults; each key replayed once more in the
 *               warm-up, the read that fills the cache: q is the steady state)
 *   j  pg-wait  a duplicate on instance B of a call running on instance A: how long its
 *               answer lags A's, woken by LISTEN/NOTIFY and by re-reads (scenario_pg_wait.c)
 *   k  tx-lmdb  as c, the method transactional: its handler writes one idem_txn_put
 *               that commits with the record
 *   l  tx-pg    as k, on PostgreSQL (one instance)
 *   m  1-step   as c, the handler runs one journaled step (idem_call_step, 64 B out)
 *   n  3-steps  as m, three steps
 *   o  1-undo   as m, the step has an undo (registered; the call succeeds, no undo runs)
 *   p  compensated  as o, then the handler fails finally: the undo runs (journaled) and
 *               the key is released; every call answers FAILED_PRECONDITION
 *               "idem-compensated: all"
 *   x, y   as g, i on the HA topology (scripts/ha.sh: a synchronous standby) at
 *          $IDEMRPC_BENCH_PG_HA: "ha vs single" lines set them against g, i of the
 *          same run, the price of synchronous replication
 *   (g-n, q, x, y run only when asked for with --scenarios; "pg vs lmdb", "tx pg vs lmdb" and
 *   "steps vs cached" lines follow; o and p also run only when asked for)
 *   r  redis-new-always     the peer a user would pick instead: a plain Redis
 *                           idempotency layer behind the same nng hop (raw req0
 *                           clients), new keys, appendfsync always ($IDEMRPC_BENCH_REDIS,
 *                           redis://HOST[:PORT]; scenario_redis.c)
 *   s  redis-rep-always     as r, every timed call a replay (as e)
 *   t, u                    as r, s with appendfsync everysec
 *   (r-u run when asked for with --scenarios, or by default when $IDEMRPC_BENCH_REDIS
 *   is set; "c vs redis-new(always)" and "e vs redis-replay" lines follow)
 *   z  scale    cost against the store's size: new keys (random, and ordered as
 *               UUIDv7s are) and replays (of random stored keys) at 1 and 16 clients on
 *               stores preloaded with 10k, 1M and 10M records, kept in --scale-dir DIR
 *               between runs; bytes per record, page faults, RSS
 *               (scenario_scale.c; only by --scenarios; --scale-csv FILE for table.py)
 *   w  nats     messages/s through the JetStream consumer binding (idem_consume, ack
 *               after the commit) next to a bare consume-and-ack loop, at 1 and 8
 *               consumers ($IDEMRPC_BENCH_NATS; scenario_nats.c; only by --scenarios)
 *
 * The default run is two grids on tcp and ipc: a-f at 1, 16 and 64 clients with 64 B
 * payloads, and the payload sweep, a and e at 1 client with 4 KiB, 64 KiB and 1 MiB;
 * with $IDEMRPC_BENCH_REDIS set, r-u join the first and s the second.
 * --clients, --payload or --scenarios replace both with the one grid they describe
 * (the defaults filling in what they leave out). --no-log opens every LMDB store of the
 * chain scenarios without its write-ahead log (IDEM_STORE_NO_LOG): the same run against
 * one without it measures what the log gives.
 *
 * A cell is one (scenario, transport, payload, clients): a server and K client threads
 * in this process on loopback. Every thread connects and warms up untimed, then all
 * start together and stop by themselves after --seconds (or --count calls in all, at
 * most 60 s). ratio_vs_a is calls/s over (a)'s with the same transport, clients and
 * payload; for f, over (a) on the first transport with the fewest clients. Each row
 * also says what a call cost this process in the timed window: CPU, context switches,
 * read/write-family syscalls and allocations (usage.c and alloc_count.c say how each
 * is counted). Stores live in mkdtemp directories under /tmp, removed after each cell
 * (and at exit).
 *
 * This file is the driver: the options, the scenario table and the order of the cells.
 * bench.h says how the other files fit together. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"

bench_config cfg;

/* In the order of a (transport, payload, clients) group: a first, the others' ratio
 * needs it; f (no transport) runs once per payload, after all groups. */
static const scenario scenarios[N_SCENARIOS] = {
    {'a', "a:echo", run_echo, 0, KEYS_NONE, 0, NULL, 0},
    {'b', "b:gc-off", run_chain, IDEM_STORE_NO_GROUP_COMMIT, KEYS_NEW, 0, NULL, 0},
    {'c', "c:gc-on", run_chain, 0, KEYS_NEW, 0, NULL, 0},
    {'d', "d:nosync", run_chain, IDEM_STORE_NOSYNC, KEYS_NEW, 0, NULL, 0},
    {'e', "e:replay", run_chain, 0, KEYS_REPLAY, 0, NULL, 0},
    {'f', "f:lmdb", run_lmdb, 0, KEYS_NONE, 0, NULL, 0},
    {'g', "g:pg-new", run_pg, 0, KEYS_NEW, 1, NULL, 0},
    {'h', "h:pg-new2", run_pg, 0, KEYS_NEW, 2, NULL, 0},
    {'i', "i:pg-rep", run_pg, 0, KEYS_REPLAY, 1, NULL, 0},
    {'q', "q:pg-rep-cached", run_pg, 0, KEYS_REPLAY, 1, NULL, 0},
    {'x', "x:pg-ha-new", run_pg, 0, KEYS_NEW, 1, NULL, 0},
    {'y', "y:pg-ha-rep", run_pg, 0, KEYS_REPLAY, 1, NULL, 0},
    {'k', "k:tx-lmdb", run_chain, 0, KEYS_NEW, 0, NULL, -1},
    {'l', "l:tx-pg", run_pg, 0, KEYS_NEW, 1, NULL, -1},
    {'m', "m:1-step", run_chain, 0, KEYS_NEW, 0, NULL, 1},
    {'n', "n:3-steps", run_chain, 0, KEYS_NEW, 0, NULL, 3},
    {'o', "o:1-undo", run_chain, 0, KEYS_NEW, 0, NULL, HANDLER_UNDO},
    {'p', "p:compensated", run_chain, 0, KEYS_NEW, 0, NULL, HANDLER_COMPENSATED},
    {'r', "r:redis-new-always", run_redis, 0, KEYS_NEW, 0, "always", 0},
    {'s', "s:redis-rep-always", run_redis, 0, KEYS_REPLAY, 0, "always", 0},
    {'t', "t:redis-new-everysec", run_redis, 0, KEYS_NEW, 0, "everysec", 0},
    {'u', "u:redis-rep-everysec", run_redis, 0, KEYS_REPLAY, 0, "everysec", 0},
    {'v', "v:fdatasync", run_fsync, 0, KEYS_NONE, 0, NULL, 0},
};

static const scenario *scenario_of(char letter)
{
    for (int i = 0; i < N_SCENARIOS; i++) {
        if (scenarios[i].letter == letter) {
            return &scenarios[i];
        }
    }
    return NULL;
}

/* ---- command line ---- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: idemrpc-bench [--clients 1,16,64] [--payload 64[,4096]] "
            "[--transport tcp,ipc[,inproc]]\n"
            "                     [--seconds 1.5 | --count N] [--scenarios a,b,c,d,e,f] "
            "[--csv FILE] [--json FILE] [--switches] [--no-log]\n"
            "  a echo  b chain gc off  c chain gc on  d chain nosync  e replay  f raw lmdb\n"
            "  v pwrite + fdatasync (the disk)\n"
            "  g pg new keys  h pg two instances  i pg replay  j pg duplicate wait "
            "($IDEMRPC_BENCH_PG)\n"
            "  k transactional (lmdb)  l transactional (pg)  m 1 journaled step  n 3 steps\n"
            "  w nats consumer vs bare consume-and-ack, 1 and 8 consumers ($IDEMRPC_BENCH_NATS)\n"
            "  z the store's size: new keys (random, ordered) and replays at 1 and 16 clients on "
            "stores of 10k, 1M, 10M\n"
            "    records (--scale-dir DIR: where they are kept between runs, required; "
            "--scale-sizes N,..;\n"
            "    --scale-kinds new,replay,ordered,grown (grown: bytes per record, random and "
            "ascending keys);\n"
            "    --scale-rounds R: every size in turn, R times; --clients, default 1,16; "
            "--scale-csv FILE: its rows for bench/table.py)\n"
            "  o 1 step with an undo  p a compensated call (the undo runs, the key is released)\n"
            "  r redis peer new keys, appendfsync always  s its replay  t, u the same with "
            "everysec\n"
            "    ($IDEMRPC_BENCH_REDIS=redis://HOST[:PORT], a throwaway Redis 7: the bench sets "
            "its AOF)\n"
            "  default: a-f and v at 1,16,64 clients and 64 B, then a,e at 1 client and "
            "4096,65536,1048576 B\n"
            "    (and r-u, then s, when $IDEMRPC_BENCH_REDIS is set);\n"
            "  --clients, --payload or --scenarios run only the one grid they describe\n"
            "  --count N: N calls per cell, at most --seconds (default %.0f s then)\n",
            COUNT_TIME_CAP_S);
}

/* Parses "1,16,64" into out; false on a bad, out-of-range or too long list. */
static bool parse_longs(const char *s, long *out, int *n, long lo, long hi)
{
    char *end;
    for (*n = 0; *n < MAX_LIST; (*n)++) {
        out[*n] = strtol(s, &end, 10);
        if (end == s || out[*n] < lo || out[*n] > hi || (*end != ',' && *end != '\0')) {
            return false;
        }
        if (*end == '\0') {
            (*n)++;
            return true;
        }
        s = end + 1;
    }
    return false;
}

/* Keeps pointers into s (an argv string, cut at the commas). */
static bool parse_transports(char *s)
{
    cfg.n_transports = 0;
    for (char *tok = strtok(s, ","); tok != NULL; tok = strtok(NULL, ",")) {
        if (cfg.n_transports == MAX_LIST ||
            (strcmp(tok, "tcp") != 0 && strcmp(tok, "ipc") != 0 && strcmp(tok, "inproc") != 0)) {
            return false;
        }
        cfg.transports[cfg.n_transports++] = tok;
    }
    return cfg.n_transports > 0;
}

/* Letters of known scenarios, commas between them; j and w (own tables, no cells) too. */
static bool parse_scenarios(const char *s, bool *want)
{
    memset(want, 0, N_LETTERS * sizeof(*want));
    for (; *s != '\0'; s++) {
        if (scenario_of(*s) != NULL || *s == 'j' || *s == 'w' || *s == 'z') {
            want[*s - 'a'] = true;
        } else if (*s != ',') {
            return false;
        }
    }
    return true;
}

static bool parse_seconds(const char *s)
{
    char *end;
    cfg.seconds = strtod(s, &end);
    return end != s && *end == '\0' && cfg.seconds > 0 && cfg.seconds <= 3600;
}

static void grid_set(bench_grid *g, const char *clients, const char *payloads, const char *letters)
{
    parse_longs(clients, g->clients, &g->n_clients, 1, MAX_CLIENTS);
    parse_longs(payloads, g->payloads, &g->n_payloads, 0, MAX_PAYLOAD);
    parse_scenarios(letters, g->want);
}

/* The default run: the main grid, and the payload sweep of the transport (a) and the
 * replay (e) at one client, where the payload's own cost shows most; the Redis peer
 * when there is a Redis for it. */
static void set_defaults(void)
{
    static char default_transports[] = "tcp,ipc";
    const char *redis = getenv("IDEMRPC_BENCH_REDIS");
    bool peer = redis != NULL && redis[0] != '\0';
    grid_set(&cfg.grids[0], "1,16,64", "64", peer ? "abcdefrstuv" : "abcdefv");
    grid_set(&cfg.grids[1], "1", "4096,65536,1048576", peer ? "aes" : "ae");
    cfg.n_grids = 2;
    cfg.seconds = 1.5;
    cfg.scale_kinds = 15;
    cfg.scale_rounds = 1;
    parse_longs("10000,1000000,10000000", cfg.scale_sizes, &cfg.n_scale_sizes, 1, 100000000);
    parse_transports(default_transports);
}

/* The value v of option --name (opt) into cfg; false, after saying what is wrong, when
 * it is bad. A grid option makes the run that one grid. */
static bool parse_option(int opt, const char *name, char *v)
{
    bench_grid *g = &cfg.grids[0];
    const char *want = NULL;
    uint64_t count;
    long rounds = 1;
    int n = 0;
    if (opt == 'k' || opt == 'p' || opt == 'S') {
        cfg.n_grids = 1;
    }
    switch (opt) {
    case 'k':
        cfg.clients_given = true;
        want = parse_longs(v, g->clients, &g->n_clients, 1, MAX_CLIENTS)
                   ? NULL
                   : "a list of up to 16 client counts from 1 to 1024";
        break;
    case 'p':
        want = parse_longs(v, g->payloads, &g->n_payloads, 0, MAX_PAYLOAD)
                   ? NULL
                   : "a list of up to 16 payload sizes from 0 to 1048576";
        break;
    case 't':
        want = parse_transports(v) ? NULL : "a list of tcp, ipc, inproc";
        break;
    case 's':
        want = parse_seconds(v) ? NULL : "a number of seconds above 0, at most 3600";
        break;
    case 'n':
        if (!cli_parse_u64("idemrpc-bench", "--count", v, 1, UINT64_MAX, &count)) {
            return false;
        }
        cfg.count = count;
        break;
    case 'S':
        want = parse_scenarios(v, g->want) ? NULL : "a list of scenario letters a-p, r-z";
        break;
    case 'R':
        want = parse_longs(v, &rounds, &n, 1, 20) && n == 1 ? NULL : "a count from 1 to 20";
        cfg.scale_rounds = (int)rounds;
        break;
    case 'Z':
        want = parse_longs(v, cfg.scale_sizes, &cfg.n_scale_sizes, 1, 100000000)
                   ? NULL
                   : "a list of up to 16 record counts from 1 to 100000000";
        break;
    }
    if (want != NULL) {
        fprintf(stderr, "idemrpc-bench: --%s: '%s' is not %s\n", name, v, want);
        return false;
    }
    return true;
}

typedef enum { ARGS_RUN, ARGS_HELP, ARGS_BAD } args_result;

static args_result parse_args(int argc, char **argv)
{
    static const struct option longs[] = {{"clients", required_argument, NULL, 'k'},
                                          {"payload", required_argument, NULL, 'p'},
                                          {"transport", required_argument, NULL, 't'},
                                          {"seconds", required_argument, NULL, 's'},
                                          {"count", required_argument, NULL, 'n'},
                                          {"scenarios", required_argument, NULL, 'S'},
                                          {"csv", required_argument, NULL, 'c'},
                                          {"json", required_argument, NULL, 'j'},
                                          {"scale-dir", required_argument, NULL, 'D'},
                                          {"scale-sizes", required_argument, NULL, 'Z'},
                                          {"scale-csv", required_argument, NULL, 'C'},
                                          {"scale-kinds", required_argument, NULL, 'K'},
                                          {"scale-rounds", required_argument, NULL, 'R'},
                                          {"switches", no_argument, NULL, 'W'},
                                          {"no-log", no_argument, NULL, 'L'},
                                          {"help", no_argument, NULL, 'h'},
                                          {NULL, 0, NULL, 0}};
    bool seconds_given = false;
    int opt, index;

    set_defaults();
    while ((opt = getopt_long(argc, argv, "h", longs, &index)) != -1) {
        if (opt == 'h') {
            return ARGS_HELP;
        } else if (opt == '?') {
            return ARGS_BAD; /* getopt_long said which option */
        } else if (opt == 'c') {
            cfg.csv = optarg;
        } else if (opt == 'j') {
            cfg.json = optarg;
        } else if (opt == 'W') {
            cfg.switches = true;
        } else if (opt == 'L') {
            cfg.store_flags = IDEM_STORE_NO_LOG;
        } else if (opt == 'K') {
            cfg.scale_kinds = strstr(optarg, "new") ? 1 : 0;
            cfg.scale_kinds |= strstr(optarg, "replay") ? 2 : 0;
            cfg.scale_kinds |= strstr(optarg, "grown") ? 4 : 0;
            cfg.scale_kinds |= strstr(optarg, "ordered") ? 8 : 0;
        } else if (opt == 'D' || opt == 'C') {
            *(opt == 'D' ? &cfg.scale_dir : &cfg.scale_csv) = optarg;
        } else if (!parse_option(opt, longs[index].name, optarg)) {
            return ARGS_BAD;
        }
        seconds_given |= opt == 's';
    }
    if (optind < argc) {
        fprintf(stderr, "idemrpc-bench: unexpected argument '%s'\n", argv[optind]);
        return ARGS_BAD;
    }
    if (cfg.count > 0 && !seconds_given) {
        cfg.seconds = COUNT_TIME_CAP_S;
    }
    return ARGS_RUN;
}

/* ---- main ---- */

/* Runs one cell and reports it; false when it could not be measured. */
static bool run_cell(const scenario *sc, const char *transport, int clients, long payload,
                     const void *buf)
{
    static unsigned next_cell_id;
    cell c = {.sc = sc,
              .transport = transport,
              .clients = clients,
              .payload_len = (size_t)payload,
              .payload = buf,
              .id = next_cell_id++};
    cell_stats s = {.ok = 0};
    if (sc->run(sc, &c, &s) != 0) {
        report_failed(sc, transport, clients, (size_t)payload, &s);
        return false;
    }
    report_cell(sc, transport, clients, (size_t)payload, &s);
    return true;
}

/* Every wanted cell of grid g; (a) first in every (transport, payload, clients)
 * group: the others' ratio needs it. f and v need no transport and run last, once per
 * payload. */
static bool run_grid(const bench_grid *g, const void *buf)
{
    bool all_ok = true;
    for (int t = 0; t < cfg.n_transports; t++) {
        for (int p = 0; p < g->n_payloads; p++) {
            for (int k = 0; k < g->n_clients; k++) {
                for (int s = 0; s < N_SCENARIOS; s++) {
                    const scenario *sc = &scenarios[s];
                    if (g->want[sc->letter - 'a'] && !storage_baseline(sc)) {
                        all_ok &= run_cell(sc, cfg.transports[t], (int)g->clients[k],
                                           g->payloads[p], buf);
                    }
                }
            }
        }
    }
    for (int p = 0; p < g->n_payloads; p++) {
        for (const char *l = "fv"; *l != '\0'; l++) {
            if (g->want[*l - 'a']) {
                all_ok &= run_cell(scenario_of(*l), "-", 1, g->payloads[p], buf);
            }
        }
    }
    return all_ok;
}

static bool run_cells(void)
{
    static char buf[MAX_PAYLOAD];
    bool all_ok = true;
    memset(buf, 'p', sizeof(buf));
    for (int i = 0; i < cfg.n_grids; i++) {
        all_ok &= run_grid(&cfg.grids[i], buf);
    }
    return all_ok;
}

int main(int argc, char **argv)
{
    switch (parse_args(argc, argv)) {
    case ARGS_HELP:
        usage(stdout);
        return 0;
    case ARGS_BAD:
        usage(stderr);
        return CLI_USAGE_ERROR;
    case ARGS_RUN:
        break;
    }
    atexit(tmp_dir_remove);
    run_tag_init();
    report_preamble();
    bool all_ok = run_cells();
    report_peer_ratios();
    if (cfg.grids[0].want['j' - 'a']) { /* only ever by --scenarios: one grid */
        all_ok &= run_pg_wait() == 0;
    }
    if (cfg.grids[0].want['w' - 'a']) { /* only ever by --scenarios: one grid */
        all_ok &= run_nats() == 0;
    }
    if (cfg.grids[0].want['z' - 'a']) { /* only ever by --scenarios: one grid */
        all_ok &= run_scale() == 0;
    }
    if (cfg.csv != NULL && report_write_csv(cfg.csv) != 0) {
        fprintf(stderr, "idemrpc-bench: cannot write %s\n", cfg.csv);
        all_ok = false;
    }
    if (cfg.json != NULL && report_write_json(cfg.json) != 0) {
        fprintf(stderr, "idemrpc-bench: cannot write %s\n", cfg.json);
        all_ok = false;
    }
    return all_ok ? 0 : 1;
}

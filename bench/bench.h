/* idemrpc-bench internals: what a cell is, what a scenario plugs into the harness, and
 * what the report keeps of a measured cell.
 *
 * The call path of one cell: bench.c (driver) picks a scenario and calls its run();
 * the scenario file (scenario_echo.c, scenario_chain.c, scenario_lmdb.c) starts its
 * server, if any, and hands its client_ops to run_clients() (harness.c), which times K
 * threads and reads the process counters (usage.c) around the timed window; stats.c
 * turns the samples into percentiles and the cell into a table row.
 * Everything runs on the main thread except the client threads inside run_clients(). */
#ifndef IDEMRPC_BENCH_H
#define IDEMRPC_BENCH_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <lmdb.h>
#include <nng/nng.h>

#include <idemrpc/idemrpc.h>

#define MAX_LIST 16
#define MAX_GRIDS 2 /* the default run: the main grid and the payload sweep */
#define MAX_CLIENTS 1024
#define MAX_PAYLOAD (1 << 20)
#define MAX_FRAME (MAX_PAYLOAD + (64 << 10)) /* a payload and its envelope, both ways */
#define N_LETTERS 26                         /* scenarios are named by a letter a..z */
#define N_SCENARIOS 23                       /* a..i, k..v, x, y */
#define WARMUP_CALLS 8                       /* untimed calls per thread before the start */
#define REPLAY_KEYS 100                      /* e: keys per client, called once before the start */
#define LATENCY_BUDGET (1u << 21)            /* samples kept per cell over all threads (16 MiB) */
#define CALL_TIMEOUT_MS 10000                /* a call slower than this is an error, not a retry */
#define COUNT_TIME_CAP_S 60.0                /* --count alone is still bounded in time */
#define LMDB_MAP_SIZE ((size_t)1 << 30)      /* f */
#define STORE_MAP_SIZE ((size_t)8 << 30)     /* b-e: room for 1 MiB results (a sparse file) */
#define METHOD "bench.Echo/Echo"

/* Cells to run: every wanted scenario at every payload and client count, on every
 * transport of the run. */
typedef struct bench_grid {
    long clients[MAX_LIST], payloads[MAX_LIST];
    int n_clients, n_payloads;
    bool want[N_LETTERS]; /* by letter - 'a' */
} bench_grid;

/* The command line, set once by the driver before the first cell; read-only after. */
typedef struct bench_config {
    bench_grid grids[MAX_GRIDS];
    int n_grids;
    const char *transports[MAX_LIST];
    int n_transports;
    double seconds;
    unsigned long long count; /* 0 = bounded by time only */
    const char *csv, *json;
    /* z (scenario_scale.c): where the preloaded stores are kept, their sizes, its CSV */
    const char *scale_dir, *scale_csv;
    long scale_sizes[MAX_LIST];
    int n_scale_sizes;
    int scale_rounds;     /* z: every size in turn, this many times */
    int scale_kinds;      /* bits: 1 new keys, 2 replays, 4 the grown store */
    bool clients_given;   /* --clients: also z's client counts (default 1 and 16) */
    bool switches;        /* --switches: a line per cell of switches per call by thread kind */
    unsigned store_flags; /* --no-log: IDEM_STORE_NO_LOG on every LMDB store of b-e, k-p */
} bench_config;

extern bench_config cfg;

/* ---- cells and scenarios ---- */

typedef enum key_mode { KEYS_NONE, KEYS_NEW, KEYS_REPLAY } key_mode;

typedef struct cell cell;
typedef struct cell_stats cell_stats;
typedef struct scenario {
    char letter;
    const char *name; /* table label */
    int (*run)(const struct scenario *sc, cell *c, cell_stats *out);
    unsigned store_flags;    /* b–e */
    key_mode keys;           /* b–e, g–i */
    int instances;           /* g–i: servers on one PostgreSQL database */
    const char *appendfsync; /* r–u: Redis's fsync policy, "always" or "everysec" */
    /* b–e, g–i, k–p: the method's kind. 0 cached; -1 transactional (k, l: one
     * idem_txn_put with the record); 1..3 cached with N journaled steps (m, n);
     * HANDLER_UNDO one step with an undo (o), HANDLER_COMPENSATED the same, then a final
     * failure that runs the undo (p). */
    int handler;
} scenario;
#define HANDLER_UNDO 10
#define HANDLER_COMPENSATED 11

struct cell {
    const scenario *sc;
    const char *transport; /* "tcp", "ipc", "inproc"; "-" for f and v */
    int clients;
    size_t payload_len;
    const void *payload; /* payload_len bytes, read-only, shared by all threads */
    unsigned id;         /* unique in this process: keys and ipc paths */
    int warmup;          /* untimed calls per thread, set by the runner */
    char url[160];       /* what clients dial, set by the runner */
    char url2[160];      /* h: the second instance ("" when none) */
    const char *dir;     /* f, v: the LMDB directory, the file's */
    void *peer;          /* r–u: the scenario's own state, for its client_ops */
};

/* Counters of the whole process at one moment (usage.c): the server, its store, nng's
 * threads and the client threads all run in this process. NAN: not known here. */
typedef struct proc_usage {
    double cpu_us;      /* user + system CPU, getrusage(RUSAGE_SELF) */
    double vcsw, ivcsw; /* voluntary, involuntary context switches, the same */
    /* z: page faults without and with I/O, getrusage(RUSAGE_SELF) */
    double minflt, majflt;
    double rw_syscalls; /* /proc/self/io syscr + syscw: read/write-family calls only */
    double allocs;      /* malloc, calloc and realloc calls (alloc_count.c) */
    double peer_cpu_us; /* the CPU of a peer server process (redis-server), if any */
} proc_usage;

/* Context switches (voluntary + involuntary) of the process's live threads, summed by
 * kind: the thread's name (comm) without trailing digits (usage.c, --switches). */
#define MAX_THREAD_KINDS 16
typedef struct thread_switches {
    int n;
    char kind[MAX_THREAD_KINDS][16];
    double vcsw[MAX_THREAD_KINDS], ivcsw[MAX_THREAD_KINDS];
} thread_switches;

struct cell_stats {
    uint64_t ok, errors;
    double seconds; /* from the common start to the last thread's last reply */
    double p50_us, p99_us, p999_us;
    proc_usage cost;           /* spent from the common start until every thread's last reply */
    thread_switches by_thread; /* the same window's switches by thread kind (--switches) */
    char error[200];           /* the first error seen; "" when none */
};

/* A scenario's run(): 0 when the cell was measured (out filled), -1 with out->error
 * saying why not. Each undoes all it set up before returning. */
int run_echo(const scenario *sc, cell *c, cell_stats *out);  /* a, scenario_echo.c */
int run_chain(const scenario *sc, cell *c, cell_stats *out); /* b–e, scenario_chain.c */
int run_pg(const scenario *sc, cell *c, cell_stats *out);    /* g–i, l, q, x, y */
int run_lmdb(const scenario *sc, cell *c, cell_stats *out);  /* f, scenario_lmdb.c */
int run_fsync(const scenario *sc, cell *c, cell_stats *out); /* v, scenario_lmdb.c */
/* f and v: the disk's baselines, no transport; they run once per payload, last. */
static inline bool storage_baseline(const scenario *sc)
{
    return sc->letter == 'f' || sc->letter == 'v';
}
int run_redis(const scenario *sc, cell *c, cell_stats *out); /* r–u, scenario_redis.c */
int run_pg_wait(void); /* j, scenario_pg_wait.c: prints its own table; 0 when measured */
int run_nats(void);    /* w, scenario_nats.c: prints its own table; 0 when measured */
int run_scale(void);   /* z, scenario_scale.c: prints its own table; 0 when measured */
/* The preamble's line about $IDEMRPC_BENCH_REDIS (version, AOF directory), when any r–u
 * cell will run. */
void redis_preamble(void);

/* ---- the harness (harness.c) ---- */

/* Bounded, preallocated per thread; see latency_record(). */
typedef struct latency_sample {
    uint64_t *ns;
    size_t n, cap;
    uint64_t seen;
    uint64_t rng; /* xorshift64 state, nonzero */
} latency_sample;

typedef struct client_run client_run;

/* One client thread; conn is the scenario's, everything else the harness's. */
typedef struct bench_thread {
    client_run *run;
    const cell *cell;
    int id;
    uint64_t seq; /* calls made by this thread, warm-up included */
    union {
        nng_socket sock;     /* a */
        idem_client *client; /* b–e, g–i */
        struct {
            MDB_env *env;
            MDB_dbi dbi;
        } lmdb; /* f */
        int fd; /* v */
    } conn;
    latency_sample lat;
    uint64_t ok, errors, end_ns;
    bool setup_failed;
    char error[200]; /* the first error of this thread */
    pthread_t tid;
} bench_thread;

/* What a client thread does; the timing around it is run_clients()'s. call returns 0
 * for a correct reply, -1 otherwise (after thread_fail). close also undoes a partial
 * open. */
typedef struct client_ops {
    int (*open)(bench_thread *t);
    int (*call)(bench_thread *t);
    void (*close)(bench_thread *t);
    /* Optional, on the main thread at both gates: the CPU µs the peer server process
     * (another process: redis-server) has used so far; NAN when unknown. */
    double (*peer_cpu_us)(const cell *c);
} client_ops;

/* A raw req0 socket to t->cell->url in t->conn.sock (no resend, CALL_TIMEOUT_MS, no
 * size limit), for blocking nng_sendmsg/nng_recvmsg; scenario_echo.c. req_close also
 * undoes a failed req_open. */
int req_open(bench_thread *t);
void req_close(bench_thread *t);

/* Runs c->clients threads of ops against c->url and measures them. -1 when a thread
 * could not be started or set up (out->error says why). */
int run_clients(const client_ops *ops, const cell *c, cell_stats *out);

int cell_fail(cell_stats *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int thread_fail(bench_thread *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

uint64_t now_ns(void);

void run_tag_init(void); /* once, before the first cell */
/* The prefix of every key of cell c ("<run>-c<id>-"), as snprintf. */
int cell_key_prefix(const cell *c, char *buf, size_t cap);
/* The idempotency key of thread t's next call into buf, and whether that call must be a
 * replay. New keys: t->seq makes each unique. Replay: t->seq cycles over REPLAY_KEYS
 * keys; the first round (the warm-up) executes them, every later call must replay.
 * Advances t->seq. */
bool next_call_key(bench_thread *t, char *buf, size_t cap);
void proc_usage_now(proc_usage *u); /* usage.c; u->peer_cpu_us = NAN */
/* The number after name in /proc/self/<file> ("status", "io"), NAN when absent; reads
 * without allocating (usage.c). */
double proc_self_field(const char *file, const char *name);
double alloc_count(void); /* allocations so far, every thread; NAN when not counted */
void proc_usage_diff(const proc_usage *a, const proc_usage *b, proc_usage *d); /* d = b - a */
/* Every live thread's switches from /proc/self/task, by kind (usage.c). */
void thread_switches_now(thread_switches *t);
void thread_switches_diff(const thread_switches *a, const thread_switches *b, thread_switches *d);
size_t server_contexts(int clients);
void listen_url(const cell *c, int instance, char *buf, size_t cap);
void set_dial_url(cell *c, const char *listen, int port);

/* The store directory of the running cell, under /tmp. At most one exists at a time:
 * create removes the previous one; NULL when mkdtemp fails. */
const char *tmp_dir_create(void);
void tmp_dir_remove(void);

/* ---- statistics and output (stats.c) ---- */

void latency_record(latency_sample *s, uint64_t ns);
/* Sorts all[0..n) in place and sets out's percentiles from it. */
void latency_percentiles(uint64_t *all, size_t n, cell_stats *out);

void report_preamble(void); /* the machine, the method, the table header */
void report_cell(const scenario *sc, const char *transport, int clients, size_t payload,
                 const cell_stats *s);
void report_failed(const scenario *sc, const char *transport, int clients, size_t payload,
                   const cell_stats *s);
void report_peer_ratios(void);
const char *fs_type_name(long f_type); /* statfs's f_type: "ext4", "tmpfs", … */
int report_write_csv(const char *path);
int report_write_json(const char *path);

#endif

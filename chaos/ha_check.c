/* idemrpc-ha-check: the fault campaign on HA PostgreSQL (scripts/ha.sh: Patroni + etcd,
 * two nodes, synchronous replication).
 *
 * Two server instances in this process share the cluster through a multi-host conninfo
 * ($IDEMRPC_TEST_HA, target_session_attrs=read-write). Client threads charge fresh keys
 * (a transactional method: the effect row and the record commit together) on either
 * instance, retrying across faults. A fault thread cycles through the faults a cluster
 * meets (leader kill -9, leader SIGSTOP, planned switchover, standby loss) and measures
 * for each the longest any call waited past the fault before its OK: the time until
 * calls succeed again.
 *
 * Checked at the end, on whichever node leads then: every key a client was answered OK
 * for has exactly one effect row and a COMPLETED record (synchronous replication: no
 * acknowledged result is lost; the claim in the handler's transaction: no double
 * effect). Prints "ha: N calls, F faults, V violations" and the recovery times; exits 1
 * on a violation. */
#include <getopt.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <idemrpc/idemrpc.h>

#include "cli.h"

#define CLIENTS 4
#define MAX_OK 1000000 /* keys checked at the end (48 MB) */
#define MAX_FAULTS 64

static const char *faults[] = {"kill-leader", "pause-leader", "switchover", "stop-standby"};
#define N_KINDS 4

static struct {
    const char *conninfo, *script;
    char urls[2][64];
    atomic_bool stop;
    atomic_ulong calls, failed, oks;
    pthread_mutex_t mu;
    char (*ok)[48]; /* keys answered OK */
    size_t n_ok;
    uint64_t slowest[MAX_FAULTS], applied[MAX_FAULTS];
    int kind[MAX_FAULTS], n_faults;
    uint64_t seed, seed_given; /* --seed: each round's order of faults, their lengths */
    bool seeded;
} H = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static idem_code h_charge(idem_call *call, void *arg)
{
    (void)arg;
    PGconn *c = (PGconn *)idem_txn_pg_conn(idem_call_txn(call));
    const char *k = idem_call_key(call);
    PGresult *r =
        PQexecParams(c, "INSERT INTO ha_effects (k) VALUES ($1)", 1, NULL, &k, NULL, NULL, 0);
    bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
    PQclear(r);
    if (!ok) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "effect: %s", PQerrorMessage(c));
    }
    return idem_call_reply(call, IDEM_OK, k, strlen(k));
}

static void *client_main(void *arg)
{
    long id = (long)arg;
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.deadline_ms = 60000;
    o.attempt_timeout_ms = 3000;
    o.retry.max_attempts = 60;
    const char *urls[] = {H.urls[id % 2], H.urls[(id + 1) % 2]};
    if (idem_client_open(&c, urls, 2, &o) != IDEM_OK) {
        return NULL;
    }
    for (unsigned long seq = 0; !atomic_load(&H.stop); seq++) {
        char key[48];
        snprintf(key, sizeof(key), "c%ld-%lu", id, seq);
        uint64_t started = mono_ms();
        idem_request q = {.method = "ha.Pay/Charge", .idempotency_key = key};
        idem_result r;
        idem_code code = idem_client_call(c, &q, &r);
        idem_result_clear(&r);
        atomic_fetch_add(&H.calls, 1);
        if (code != IDEM_OK) {
            atomic_fetch_add(&H.failed, 1);
            continue;
        }
        atomic_fetch_add(&H.oks, 1);
        pthread_mutex_lock(&H.mu);
        if (H.n_ok < MAX_OK) {
            memcpy(H.ok[H.n_ok++], key, sizeof(key));
        }
        int last = H.n_faults - 1;
        uint64_t end = mono_ms(), from = last >= 0 ? H.applied[last] : 0;
        from = started > from ? started : from;
        if (last >= 0 && H.applied[last] != 0 && end >= from && end - from > H.slowest[last]) {
            H.slowest[last] = end - from; /* how long past the fault this call waited */
        }
        pthread_mutex_unlock(&H.mu);
    }
    idem_client_close(c);
    return NULL;
}

/* Runs scripts/ha.sh what; when fault, the moment it prints "applied" starts the wait
 * for the first OK after it. */
static int ha(const char *what, bool fault)
{
    char cmd[512], line[64];
    snprintf(cmd, sizeof(cmd), "%s %s 2>/dev/null", H.script, what);
    FILE *p = popen(cmd, "r");
    if (p == NULL) {
        return -1;
    }
    while (fgets(line, sizeof(line), p) != NULL) {
        if (fault && strncmp(line, "applied", 7) == 0) {
            pthread_mutex_lock(&H.mu);
            H.applied[H.n_faults - 1] = mono_ms();
            pthread_mutex_unlock(&H.mu);
        }
    }
    return pclose(p);
}

/* xorshift64* of H.seed (never 0): [lo, hi]. Only the fault thread draws. */
static unsigned draw(unsigned lo, unsigned hi)
{
    H.seed ^= H.seed >> 12;
    H.seed ^= H.seed << 25;
    H.seed ^= H.seed >> 27;
    return lo + (unsigned)((H.seed * 2685821657736338717ull) % (hi - lo + 1));
}

/* Each round meets every kind once: in the listed order, or with --seed in an order
 * drawn from it (a Fisher-Yates shuffle of the round). */
static void next_round(int order[N_KINDS])
{
    for (int k = 0; k < N_KINDS; k++) {
        order[k] = k;
    }
    for (int k = N_KINDS - 1; H.seeded && k > 0; k--) {
        int j = (int)draw(0, (unsigned)k), t = order[k];
        order[k] = order[j];
        order[j] = t;
    }
}

static void *fault_main(void *arg)
{
    uint64_t end = *(uint64_t *)arg;
    int order[N_KINDS];
    for (int i = 0; mono_ms() + 20000 < end && i < MAX_FAULTS && !atomic_load(&H.stop); i++) {
        if (i % N_KINDS == 0) {
            next_round(order);
        }
        int kind = order[i % N_KINDS];
        /* a pause ends before Patroni's 10 s TTL; the standby stays away 2-4 s */
        unsigned pause_s = H.seeded ? draw(6, 8) : 8, away_s = H.seeded ? draw(2, 4) : 3;
        char pause[32];
        snprintf(pause, sizeof(pause), "pause-leader %u", pause_s);
        pthread_mutex_lock(&H.mu);
        H.kind[H.n_faults] = kind;
        H.slowest[H.n_faults] = H.applied[H.n_faults] = 0;
        H.n_faults++;
        pthread_mutex_unlock(&H.mu);
        ha(kind == 1 ? pause : faults[kind], true);
        if (kind == 3) {
            struct timespec ts = {(time_t)away_s, 0};
            nanosleep(&ts, NULL); /* writes go on without the standby meanwhile */
            ha("start-standby", false);
        }
        ha("wait-sync", false); /* the cluster whole again before the next fault (60 s) */
    }
    return NULL;
}

/* The OK'd keys as one array literal (keys are [a-z0-9-], no quoting needed). */
static char *ok_array(void)
{
    char *a = malloc(H.n_ok * 48 + 3), *p = a;
    *p++ = '{';
    for (size_t i = 0; a != NULL && i < H.n_ok; i++) {
        p += sprintf(p, "%s%s", i ? "," : "", H.ok[i]);
    }
    if (a != NULL) {
        strcpy(p, "}");
    }
    return a;
}

/* Checks every OK'd key on the current leader, in one query (retried on a new
 * connection: the cluster may still be settling); the count of violations. */
static unsigned long check(void)
{
    char ci[1024], *keys = ok_array();
    snprintf(ci, sizeof(ci), "%s tcp_user_timeout=5000 options='-c statement_timeout=60000'",
             H.conninfo);
    for (int attempt = 0; keys != NULL && attempt < 10; attempt++) {
        PGconn *c = PQconnectdb(ci);
        const char *p[] = {keys};
        PGresult *r = PQexecParams(
            c,
            "SELECT u.k, coalesce(e.n, 0), coalesce(r.n, 0) FROM unnest($1::text[]) AS u(k)"
            " LEFT JOIN (SELECT k, count(*) n FROM ha_effects GROUP BY k) e USING (k)"
            " LEFT JOIN (SELECT key AS k, count(*) n FROM idem_records WHERE state = 2"
            " GROUP BY key) r USING (k) WHERE coalesce(e.n, 0) <> 1 OR coalesce(r.n, 0) <> 1",
            1, NULL, p, NULL, NULL, 0);
        if (PQresultStatus(r) == PGRES_TUPLES_OK) {
            unsigned long bad = (unsigned long)PQntuples(r);
            for (int i = 0; i < PQntuples(r); i++) {
                fprintf(stderr, "ha: violation: key %s answered OK, effects %s, records %s\n",
                        PQgetvalue(r, i, 0), PQgetvalue(r, i, 1), PQgetvalue(r, i, 2));
            }
            PQclear(r);
            PQfinish(c);
            free(keys);
            return bad;
        }
        fprintf(stderr, "ha: check: %s", PQerrorMessage(c));
        PQclear(r);
        PQfinish(c);
        struct timespec ts = {2, 0};
        nanosleep(&ts, NULL); /* a leader may be electing */
    }
    free(keys);
    fprintf(stderr, "ha: the check could not run\n");
    return 1;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void report(unsigned long violations)
{
    uint64_t sorted[MAX_FAULTS];
    int n = 0;
    printf("ha: per fault, the longest any call waited past it before its OK:\n");
    for (int i = 0; i < H.n_faults; i++) {
        if (H.applied[i] == 0) {
            printf("ha:   %-13s not applied (no leader to apply it to)\n", faults[H.kind[i]]);
            continue;
        }
        printf("ha:   %-13s %6llu ms\n", faults[H.kind[i]], (unsigned long long)H.slowest[i]);
        sorted[n++] = H.slowest[i];
    }
    qsort(sorted, (size_t)n, sizeof(sorted[0]), cmp_u64);
    if (n > 0) {
        printf("ha: time until calls succeed again: p50 %llu ms, p99 %llu ms, max %llu ms\n",
               (unsigned long long)sorted[n / 2], (unsigned long long)sorted[(n * 99) / 100],
               (unsigned long long)sorted[n - 1]);
    }
    printf("ha: %lu calls (%lu ok, %zu of them checked; %lu failed after all retries), %d faults,"
           " %lu violations\n",
           atomic_load(&H.calls), atomic_load(&H.oks), H.n_ok, atomic_load(&H.failed), H.n_faults,
           violations);
}

static int setup_schema(void)
{
    PGconn *c = PQconnectdb(H.conninfo);
    PGresult *r = PQexec(c, "DROP TABLE IF EXISTS ha_effects; CREATE TABLE ha_effects (k text);"
                            " DROP TABLE IF EXISTS idem_records");
    int rc = PQresultStatus(r) == PGRES_COMMAND_OK ? 0 : 1;
    if (rc != 0) {
        fprintf(stderr, "ha: setup: %s", PQerrorMessage(c));
    }
    PQclear(r);
    PQfinish(c);
    return rc;
}

static int start_instances(idem_store *st[2], idem_server *srv[2])
{
    for (int i = 0; i < 2; i++) {
        idem_pg_opts po = {.pool_size = 8, .reconnect_ms = 20000};
        idem_server_opts o;
        idem_server_opts_init(&o);
        o.contexts = 8;
        o.log_level = IDEM_LOG_OFF;
        idem_method_opts m = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
        if (idem_store_open_postgres_ex(&st[i], H.conninfo, &po) != IDEM_OK ||
            (o.store = st[i], idem_server_create(&srv[i], &o)) != IDEM_OK ||
            idem_server_register(srv[i], "ha.Pay/Charge", h_charge, NULL, &m) != IDEM_OK ||
            idem_server_listen(srv[i], "tcp://127.0.0.1:0") != IDEM_OK) {
            fprintf(stderr, "ha: instance %d: %s\n", i, idem_errmsg());
            return 1;
        }
        snprintf(H.urls[i], sizeof(H.urls[i]), "tcp://127.0.0.1:%d", idem_server_port(srv[i]));
    }
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: idemrpc-ha-check [--seconds N] [--seed S]\n"
               "  the fault campaign on HA PostgreSQL; needs IDEMRPC_TEST_HA and IDEMRPC_HA:\n"
               "  eval \"$(bash scripts/ha.sh start)\"\n"
               "  --seconds N   how long the run lasts (default 60; faults start until 20 s\n"
               "                before its end)\n"
               "  --seed S      draw the order of each round of faults and their lengths\n"
               "                from S (default: the listed order, fixed lengths)\n");
}

/* True to run; false with *status the exit status (0 after --help, 2 after a usage
 * error, which getopt_long or cli_parse_u64 has named). */
static bool parse(int argc, char **argv, unsigned *seconds, int *status)
{
    static const struct option longs[] = {{"seconds", required_argument, NULL, 's'},
                                          {"seed", required_argument, NULL, 'S'},
                                          {"help", no_argument, NULL, 'h'},
                                          {NULL, 0, NULL, 0}};
    int opt;
    uint64_t v;
    *status = CLI_USAGE_ERROR;
    while ((opt = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        if (opt == 'h') {
            usage(stdout);
            *status = 0;
            return false;
        }
        if (opt == 'S' && cli_parse_u64("idemrpc-ha-check", "--seed", optarg, 0, UINT64_MAX, &v)) {
            H.seed = (v * 2654435761u) | 1; /* xorshift's state is never 0 */
            H.seed_given = v;
            H.seeded = true;
            continue;
        }
        if (opt != 's' || !cli_parse_u64("idemrpc-ha-check", "--seconds", optarg, 1, 86400, &v)) {
            usage(stderr);
            return false;
        }
        *seconds = (unsigned)v;
    }
    if (optind < argc) {
        fprintf(stderr, "idemrpc-ha-check: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return false;
    }
    return true;
}

int main(int argc, char **argv)
{
    unsigned seconds = 60;
    int status;
    if (!parse(argc, argv, &seconds, &status)) {
        return status;
    }
    H.conninfo = getenv("IDEMRPC_TEST_HA");
    H.script = getenv("IDEMRPC_HA");
    if (H.conninfo == NULL || H.script == NULL) {
        fprintf(stderr, "ha: IDEMRPC_TEST_HA and IDEMRPC_HA not set (bash scripts/ha.sh start)\n");
        return 2;
    }
    if (H.seeded) {
        printf("ha: seed %llu, %u s (replay: idemrpc-ha-check --seconds %u --seed %llu)\n",
               (unsigned long long)H.seed_given, seconds, seconds,
               (unsigned long long)H.seed_given);
    }
    idem_store *st[2] = {0};
    idem_server *srv[2] = {0};
    if ((H.ok = calloc(MAX_OK, sizeof(*H.ok))) == NULL || setup_schema() != 0 ||
        start_instances(st, srv) != 0) {
        return 1;
    }
    uint64_t end = mono_ms() + seconds * 1000ull;
    pthread_t t[CLIENTS], f;
    for (long i = 0; i < CLIENTS; i++) {
        pthread_create(&t[i], NULL, client_main, (void *)i);
    }
    pthread_create(&f, NULL, fault_main, &end);
    pthread_join(f, NULL);
    while (mono_ms() < end) {
        struct timespec ts = {0, 100000000L};
        nanosleep(&ts, NULL); /* the run's length, not a synchronisation */
    }
    atomic_store(&H.stop, true);
    for (int i = 0; i < CLIENTS; i++) {
        pthread_join(t[i], NULL);
    }
    for (int i = 0; i < 2; i++) {
        idem_server_destroy(srv[i]);
        idem_store_close(st[i]);
    }
    unsigned long v = check();
    report(v);
    free(H.ok);
    return v == 0 ? 0 : 1;
}

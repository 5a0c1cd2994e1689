/* j: the wait of a cross-instance duplicate on PostgreSQL ($IDEMRPC_BENCH_PG).
 *
 * Two server instances on the one database. A transactional handler on instance A
 * holds its transaction for HOLD_MS; a duplicate with the same key is sent to instance
 * B as soon as A's handler has started. B's duplicate waits (parked) for A's commit and
 * then replays. The lag measured is B's answer minus A's answer, both seen by the
 * clients: how long after the first call was answered the duplicate still waited.
 * Measured twice in one run, with completion announcements (LISTEN/NOTIFY, the
 * default) and without (idem_pg_opts.no_notify: the duplicate re-reads every
 * 20..200 ms), TRIALS calls each, and printed side by side. */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

#define TRIALS 40
#define HOLD_MS 30
#define WAIT_METHOD "bench.Wait/Hold"

typedef struct wait_run {
    atomic_int entered; /* A's handler started (this trial) */
    idem_server *srv[2];
    idem_store *st[2];
    char url[2][160];
} wait_run;

static idem_code hold_handler(idem_call *call, void *arg)
{
    wait_run *w = arg;
    atomic_fetch_add(&w->entered, 1);
    struct timespec ts = {0, HOLD_MS * 1000000L};
    nanosleep(&ts, NULL); /* the work the duplicate waits for */
    return idem_call_reply(call, IDEM_OK, "held", 4);
}

static int wait_start(wait_run *w, const char *conninfo, bool notify)
{
    for (int i = 0; i < 2; i++) {
        idem_pg_opts po = {.pool_size = 4, .no_notify = !notify};
        idem_server_opts o;
        idem_method_opts m = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
        if (idem_store_open_postgres_ex(&w->st[i], conninfo, &po) != IDEM_OK) {
            fprintf(stderr, "j: idem_store_open_postgres_ex: %s\n", idem_errmsg());
            return -1;
        }
        idem_server_opts_init(&o);
        o.store = w->st[i];
        o.contexts = 4;
        if (idem_server_create(&w->srv[i], &o) != IDEM_OK ||
            idem_server_register(w->srv[i], WAIT_METHOD, hold_handler, w, &m) != IDEM_OK ||
            idem_server_listen(w->srv[i], "tcp://127.0.0.1:0") != IDEM_OK) {
            fprintf(stderr, "j: server: %s\n", idem_errmsg());
            return -1;
        }
        snprintf(w->url[i], sizeof(w->url[i]), "tcp://127.0.0.1:%d", idem_server_port(w->srv[i]));
    }
    return 0;
}

static void wait_stop(wait_run *w)
{
    for (int i = 0; i < 2; i++) {
        idem_server_destroy(w->srv[i]);
        if (w->st[i] != NULL) {
            idem_store_close(w->st[i]);
        }
    }
    memset(w, 0, sizeof(*w));
}

typedef struct first_call {
    idem_client *client;
    const char *key;
    uint64_t answered_ns;
    idem_code code;
} first_call;

static idem_code call_key(idem_client *c, const char *key)
{
    idem_request q = {.method = WAIT_METHOD, .idempotency_key = key};
    idem_result r;
    idem_code code = idem_client_call(c, &q, &r);
    idem_result_clear(&r);
    return code;
}

static void *first_main(void *arg)
{
    first_call *f = arg;
    f->code = call_key(f->client, f->key);
    f->answered_ns = now_ns();
    return NULL;
}

static idem_client *wait_client(const char *url)
{
    idem_client *c;
    idem_client_opts o;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 5000;
    o.retry.max_attempts = 1;
    return idem_client_open(&c, (const char *[]){url}, 1, &o) == IDEM_OK ? c : NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* TRIALS duplicates; lag_us sorted. 0, or -1 on a failed call. */
static int wait_trials(wait_run *w, const char *tag, uint64_t *lag_us)
{
    idem_client *a = wait_client(w->url[0]), *b = wait_client(w->url[1]);
    int rv = a != NULL && b != NULL ? 0 : -1;
    for (int i = 0; rv == 0 && i < TRIALS; i++) {
        char key[64];
        snprintf(key, sizeof(key), "wait-%s-%d-%d", tag, (int)getpid(), i);
        first_call f = {.client = a, .key = key};
        pthread_t t;
        int seen = atomic_load(&w->entered);
        pthread_create(&t, NULL, first_main, &f);
        for (int spin = 0; spin < 5000 && atomic_load(&w->entered) == seen; spin++) {
            struct timespec ts = {0, 100000L};
            nanosleep(&ts, NULL); /* until A's handler runs; bounded at 0.5 s */
        }
        idem_code dup = call_key(b, key);
        uint64_t b_ns = now_ns();
        pthread_join(t, NULL);
        if (f.code != IDEM_OK || dup != IDEM_OK) {
            fprintf(stderr, "j: trial %d: first %s, duplicate %s\n", i, idem_code_name(f.code),
                    idem_code_name(dup));
            rv = -1;
        }
        lag_us[i] = b_ns > f.answered_ns ? (b_ns - f.answered_ns) / 1000 : 0;
    }
    idem_client_close(a);
    idem_client_close(b);
    qsort(lag_us, TRIALS, sizeof(*lag_us), cmp_u64);
    return rv;
}

int run_pg_wait(void)
{
    const char *conninfo = getenv("IDEMRPC_BENCH_PG");
    uint64_t lag[2][TRIALS];
    const char *mode[2] = {"re-read (no_notify)", "LISTEN/NOTIFY"};
    if (conninfo == NULL) {
        fprintf(stderr, "j: set IDEMRPC_BENCH_PG to a libpq conninfo\n");
        return -1;
    }
    for (int notify = 0; notify < 2; notify++) {
        wait_run w = {0};
        int rv = wait_start(&w, conninfo, notify);
        if (rv == 0) {
            rv = wait_trials(&w, notify ? "n" : "p", lag[notify]);
        }
        wait_stop(&w);
        if (rv != 0) {
            return -1;
        }
    }
    printf("\nj: cross-instance duplicate on PostgreSQL, %d trials, handler holds its txn %d ms:\n"
           "   lag of the duplicate's answer (instance B) after the first call's (A), us\n",
           TRIALS, HOLD_MS);
    printf("   %-22s %8s %8s %8s\n", "waking", "p50", "p90", "max");
    for (int i = 0; i < 2; i++) {
        printf("   %-22s %8" PRIu64 " %8" PRIu64 " %8" PRIu64 "\n", mode[i], lag[i][TRIALS / 2],
               lag[i][TRIALS * 9 / 10], lag[i][TRIALS - 1]);
    }
    printf("   p50 ratio re-read / notify: %.1f\n",
           (double)lag[0][TRIALS / 2] / (double)(lag[1][TRIALS / 2] ? lag[1][TRIALS / 2] : 1));
    return 0;
}

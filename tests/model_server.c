/* The server of the key-life model test (test_key_life_model.c): one journaled method
 * whose step reserves at a downstream the test runs and counts, and control methods
 * for the events that are not requests. It kills itself with SIGKILL at the crash
 * point the test arms, so the test can restart it on the same store.
 *
 *   model_server --listen URL --db DIR --inv URL [--pg CONNINFO] [--lease-ms N]
 *                [--tombstone-ms N]
 *
 *   model.Order/Place    IDEM_METHOD_STEPS, key required: step "reserve" (inv.Stock/
 *                        Reserve under the step's derived key, undone by inv.Stock/
 *                        Release), then the outcome armed by model.Ctl/Set:
 *                          ok         reserve, answer OK
 *                          fail       a final error (FAILED_PRECONDITION), no step
 *                          transient  UNAVAILABLE, no step
 *                          refuse     reserve, then FAILED_PRECONDITION: the undo runs
 *                        Each run of the handler appends its key's line to DIR/runs;
 *                        the reservation's payload is the key, its answer "KEY R<n>".
 *   model.Ctl/Set        "OUTCOME POINT": the outcome, and where the next run of Place
 *                        dies (none | after_claim | after_effect | after_step |
 *                        after_commit; after_commit only when the handler ran)
 *   model.Ctl/Redrive    one whole pass of the re-driver (its timer is an hour away)
 *   model.Ctl/Sweep      the sweep as it runs once the result TTL has passed
 *   model.Ctl/Forget     payload KEY: as idemctl delete: the record, else the tombstone
 *   model.Ctl/Lease      payload KEY: "live" while a Place claim under KEY holds a
 *                        lease, else "free" */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>

#include "server_internal.h"

#define PLACE "model.Order/Place"
#define RESULT_TTL_MS 3600000ull

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char outcome[16] = "ok", crash_at[16] = "none";
static _Thread_local bool ran; /* this thread's call ran the handler */
static char runs_path[4096];
static idem_client *to_inv;
static idem_store *store;
static idem_server *srv;
static bool tombstones; /* a tombstone horizon: the store keeps them */

static bool armed(const char *point)
{
    pthread_mutex_lock(&mu);
    bool yes = strcmp(crash_at, point) == 0;
    pthread_mutex_unlock(&mu);
    return yes;
}

static void maybe_crash(const char *point)
{
    if (armed(point)) {
        raise(SIGKILL);
    }
}

static idem_code inv_call(idem_call *call, const char *method, const char *step,
                          const void *payload, size_t len, idem_step_result *out)
{
    idem_request q = {.method = method, .payload = payload, .payload_len = len};
    idem_result r;
    idem_code code = idem_call_downstream(call, to_inv, step, &q, &r);
    if (code == IDEM_OK && out != NULL) {
        out->data = r.payload;
        out->len = r.payload_len;
        r.payload = NULL;
    }
    idem_result_clear(&r);
    return code;
}

static idem_code reserve(idem_call *call, void *arg, idem_step_result *out)
{
    (void)arg;
    const char *k = idem_call_key(call); /* the test counts each key's effects */
    idem_code code = inv_call(call, "inv.Stock/Reserve", "reserve", k, strlen(k), out);
    maybe_crash("after_effect");
    return code;
}

static idem_code unreserve(idem_call *call, const char *step, const idem_step_result *done,
                           void *arg)
{
    (void)arg;
    return inv_call(call, "inv.Stock/Release", step, done->data, done->len, NULL);
}

static void count_run(const char *k)
{
    char line[80];
    int n = snprintf(line, sizeof(line), "%.64s\n", k);
    int fd = open(runs_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd < 0 || write(fd, line, (size_t)n) != n) {
        perror("model_server: runs file");
        abort(); /* a count the test cannot trust */
    }
    close(fd);
}

static idem_code place(idem_call *call, void *arg)
{
    char what[16];
    idem_step_opts undo = {.undo = unreserve};
    idem_step_result r = {0};
    (void)arg;
    ran = true;
    count_run(idem_call_key(call));
    if (idem_call_fence(call) == 0) { /* the claim on disk before anything else */
        return idem_call_fail(call, IDEM_UNAVAILABLE, "no fence");
    }
    maybe_crash("after_claim");
    pthread_mutex_lock(&mu);
    snprintf(what, sizeof(what), "%s", outcome);
    pthread_mutex_unlock(&mu);
    if (strcmp(what, "transient") == 0) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "model: transient");
    }
    if (strcmp(what, "fail") == 0) {
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "model: refused");
    }
    idem_code code = idem_call_step_with(call, "reserve", reserve, NULL, &undo, &r);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    maybe_crash("after_step");
    if (strcmp(what, "refuse") == 0) {
        code = idem_call_fail(call, IDEM_FAILED_PRECONDITION, "model: refused after its step");
    } else {
        code = idem_call_reply(call, IDEM_OK, r.data, r.len);
    }
    idem_step_result_clear(&r);
    return code;
}

/* Around result_cache: "after_commit" is after the outcome's commit, before the reply. */
static idem_code crash_points(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    ran = false;
    idem_code code = idem_call_next(call, next);
    if (ran) {
        maybe_crash("after_commit");
    }
    return code;
}

static idem_code ctl_set(idem_call *call, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    char buf[40] = {0}, o[16], c[16];
    (void)arg;
    memcpy(buf, p, n < sizeof(buf) - 1 ? n : sizeof(buf) - 1);
    if (sscanf(buf, "%15s %15s", o, c) != 2) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "want OUTCOME POINT");
    }
    pthread_mutex_lock(&mu);
    memcpy(outcome, o, sizeof(o));
    memcpy(crash_at, c, sizeof(c));
    pthread_mutex_unlock(&mu);
    return idem_call_reply(call, IDEM_OK, "set", 3);
}

static idem_code ctl_redrive(idem_call *call, void *arg)
{
    (void)arg;
    if (idem__server_redrive_now(srv) != IDEM_OK) {
        return idem_call_fail(call, IDEM_INTERNAL, "%s", idem_errmsg());
    }
    return idem_call_reply(call, IDEM_OK, "passed", 6);
}

static idem_code ctl_sweep(idem_call *call, void *arg)
{
    struct timespec ts;
    size_t deleted = 0;
    (void)arg;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    for (int i = 0; i < 100 && (i == 0 || deleted == 64); i++) {
        if (idem_store_sweep(store, now + RESULT_TTL_MS + 1000, 64, &deleted) != IDEM_OK) {
            return idem_call_fail(call, IDEM_INTERNAL, "sweep: %s", idem_errmsg());
        }
    }
    return idem_call_reply(call, IDEM_OK, "swept", 5);
}

static void key_of(idem_call *call, char *key, size_t cap, idem_key_ref *ref)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    snprintf(key, cap, "%.*s", (int)(n < cap ? n : cap - 1), p != NULL ? p : "");
    *ref = (idem_key_ref){.caller = "", .method = PLACE, .key = key};
}

static idem_code ctl_forget(idem_call *call, void *arg)
{
    char key[64];
    idem_key_ref ref;
    (void)arg;
    key_of(call, key, sizeof(key), &ref);
    idem_code code = idem_store_delete(store, &ref);
    if (code == IDEM_NOT_FOUND && tombstones) { /* its result expired: the tombstone goes */
        code = idem_store_tombstone_delete(store, &ref);
    }
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return idem_call_fail(call, IDEM_INTERNAL, "delete: %s", idem_errmsg());
    }
    return idem_call_reply(call, IDEM_OK, "forgot", 6);
}

static idem_code ctl_lease(idem_call *call, void *arg)
{
    char key[64];
    idem_key_ref ref;
    idem_record rec;
    struct timespec ts;
    (void)arg;
    key_of(call, key, sizeof(key), &ref);
    idem_code code = idem_store_get(store, &ref, &rec);
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return idem_call_fail(call, IDEM_INTERNAL, "get: %s", idem_errmsg());
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    now = code == IDEM_OK && rec.now_ms != 0 ? rec.now_ms : now;
    bool live = code == IDEM_OK && rec.state == IDEM_REC_IN_PROGRESS && rec.lease_until_ms > now;
    if (code == IDEM_OK) {
        idem_record_clear(&rec);
    }
    return idem_call_reply(call, IDEM_OK, live ? "live" : "free", 4);
}

static idem_code serve(const char *listen, idem_server_opts *o)
{
    idem_method_opts steps = {.flags = IDEM_METHOD_STEPS | IDEM_METHOD_KEY_REQUIRED};
    idem_code code;
    if ((code = idem_server_create(&srv, o)) != IDEM_OK ||
        (code = idem_server_use_builtin(srv, IDEM_BUILTIN_REQUEST_ID)) != IDEM_OK ||
        (code = idem_server_use(srv, "crash_points", crash_points, NULL)) != IDEM_OK ||
        (code = idem_server_use_builtin(srv, IDEM_BUILTIN_RESULT_CACHE)) != IDEM_OK ||
        (code = idem_server_register(srv, PLACE, place, NULL, &steps)) != IDEM_OK ||
        (code = idem_server_register(srv, "model.Ctl/Set", ctl_set, NULL, NULL)) != IDEM_OK ||
        (code = idem_server_register(srv, "model.Ctl/Redrive", ctl_redrive, NULL, NULL)) ||
        (code = idem_server_register(srv, "model.Ctl/Sweep", ctl_sweep, NULL, NULL)) ||
        (code = idem_server_register(srv, "model.Ctl/Forget", ctl_forget, NULL, NULL)) ||
        (code = idem_server_register(srv, "model.Ctl/Lease", ctl_lease, NULL, NULL)) ||
        (code = idem_server_listen(srv, listen)) != IDEM_OK) {
        return code;
    }
    store = idem_server_store(srv);
    return IDEM_OK;
}

int main(int argc, char **argv)
{
    const char *listen = NULL, *db = NULL, *pg = NULL, *inv = NULL;
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.default_chain = false;
    o.lease_ms = 150;
    o.result_ttl_ms = RESULT_TTL_MS;
    o.redrive_interval_ms = 3600000; /* listed, but passes only when model.Ctl/Redrive asks */
    o.redrive_batch = 1u << 20;      /* a pass reaches every listed call, the test's too */
    o.sweep_interval_ms = 3600000;   /* sweeps only when model.Ctl/Sweep asks */
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        listen = strcmp(a, "--listen") == 0 ? v : listen;
        db = strcmp(a, "--db") == 0 ? v : db;
        pg = strcmp(a, "--pg") == 0 ? v : pg;
        inv = strcmp(a, "--inv") == 0 ? v : inv;
        o.lease_ms = strcmp(a, "--lease-ms") == 0 ? strtoull(v, NULL, 10) : o.lease_ms;
        o.tombstone_ttl_ms =
            strcmp(a, "--tombstone-ms") == 0 ? strtoull(v, NULL, 10) : o.tombstone_ttl_ms;
    }
    if (listen == NULL || db == NULL || inv == NULL) {
        fprintf(stderr, "usage: model_server --listen URL --db DIR --inv URL [--pg CONNINFO] "
                        "[--lease-ms N] [--tombstone-ms N]\n");
        return 2;
    }
    snprintf(runs_path, sizeof(runs_path), "%s/runs", db);
    tombstones = o.tombstone_ttl_ms != 0;
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    idem_client_opts co;
    idem_client_opts_init(&co);
    co.attempt_timeout_ms = 2000;
    co.retry.max_attempts = 1; /* an undo's failure is the inventory's answer */
    idem_store *pg_store = NULL;
    idem_code code = idem_client_open(&to_inv, (const char *[]){inv}, 1, &co);
    if (code == IDEM_OK && pg != NULL) {
        code = idem_store_open_postgres(&pg_store, pg, 4);
    }
    o.db_path = db;
    o.store = pg_store;
    if (code != IDEM_OK || (code = serve(listen, &o)) != IDEM_OK) {
        fprintf(stderr, "model_server: %s\n", idem_errmsg());
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    int sig;
    sigwait(&stop, &sig);
    idem_server_destroy(srv);
    idem_store_close(pg_store);
    idem_client_close(to_inv);
    return 0;
}

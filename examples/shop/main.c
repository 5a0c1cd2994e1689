/* idemrpc-shop: three services in a chain, one effect per hop.
 *
 *   idemrpc-shop --role inventory --listen URL --db DIR [--crash-at after_commit]
 *   idemrpc-shop --role payment   --listen URL --db DIR [--crash-at after_commit]
 *   idemrpc-shop --role order     --listen URL --db DIR --inventory URL --payment URL
 *                [--lease-ms N] [--redrive-ms N] [--log-stdout]
 *                [--crash-at before_reserve|between|after_charge|before_undo|in_undo|
 *                            after_compensation]
 *
 *   order.Shop/Place        cached, key required: "SKU PRICE" → "order=ID reservation=R
 *                           charge=C". Three journaled steps (downstream.h): the order
 *                           id (random, made once), the reservation (inventory) and the
 *                           charge (payment), each downstream call with its derived key.
 *                           The reservation's undo releases the SKU its recorded
 *                           answer names: a charge that fails finally (insufficient
 *                           funds) gives the stock back before the order answers, and
 *                           the order's key is free again.
 *   inv.Stock/Reserve       transactional: stock[SKU] -= 1 (starts at 100), the
 *                           reservation counted with it ("R<n> sku=SKU stock=<m>");
 *                           inv.Stock/Level reads them.
 *   inv.Stock/Release       transactional: the reverse, releases[SKU] += 1;
 *                           inv.Stock/Releases reads it and the reservations ever made.
 *   pay.Pay/Charge          transactional: total += PRICE, charges += 1 (a PRICE over
 *                           1000 is FAILED_PRECONDITION "insufficient funds"); pay.Pay/Total.
 *
 * (inventory also: --crash-at after_release_commit, after a release's commit.)
 * --crash-at makes the process SIGKILL itself at that point of its first effectful
 * call (the way kill -9 would), so a test can restart it and retry: after the restarts
 * stock is reserved once, money charged once, and the client sees one order id.
 * --redrive-ms turns on the order service's re-driver (idem_server_opts): an order
 * whose process died between its steps is finished after a restart without any
 * client retry.
 * Prints "ready" once it listens; SIGTERM stops it. */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idemrpc/idemrpc.h>

#define INITIAL_STOCK 100

typedef struct shop {
    const char *role, *listen, *db, *inventory, *payment, *crash_at;
    bool log_stdout;
    uint64_t lease_ms, redrive_ms;
    idem_client *to_inventory, *to_payment;
    idem_store *store;
} shop;

static shop S;

static void crash_point(const char *point)
{
    if (S.crash_at != NULL && strcmp(S.crash_at, point) == 0) {
        raise(SIGKILL);
    }
}

/* ---- inventory and payment: a counter pair in the record's transaction ---- */

/* *x = the counter db/key (absent: the default already in *x). A read error is not
 * "absent": the handler must fail, not write from a guessed value. */
static idem_code get_ll(idem_txn *t, const char *db, const char *key, long long *x)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, db, key, strlen(key), &v, &n);
    if (code == IDEM_OK && n != sizeof(*x)) {
        return IDEM_DATA_LOSS;
    }
    if (code == IDEM_OK) {
        memcpy(x, v, sizeof(*x));
    }
    return code == IDEM_NOT_FOUND ? IDEM_OK : code;
}

static idem_code put_ll(idem_txn *t, const char *db, const char *key, long long x)
{
    return idem_txn_put(t, db, key, strlen(key), &x, sizeof(x));
}

static idem_code reply_fmt(idem_call *call, const char *fmt, long long a, long long b)
{
    char out[96];
    int n = snprintf(out, sizeof(out), fmt, a, b);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static void payload_str(idem_call *call, char *buf, size_t cap)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    snprintf(buf, cap, "%.*s", (int)(n < cap ? n : cap - 1), p);
}

static idem_code reserve(idem_call *call, void *arg)
{
    (void)arg;
    char sku[64];
    idem_txn *t = idem_call_txn(call);
    payload_str(call, sku, sizeof(sku));
    long long stock = INITIAL_STOCK, made = 0;
    idem_code code;
    if ((code = get_ll(t, "stock", sku, &stock)) != IDEM_OK ||
        (code = get_ll(t, "reservations", sku, &made)) != IDEM_OK) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "reading the stock: %s",
                              idem_code_name(code));
    }
    if (stock <= 0) {
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "out of stock");
    }
    if ((code = put_ll(t, "stock", sku, stock - 1)) != IDEM_OK ||
        (code = put_ll(t, "reservations", sku, made + 1)) != IDEM_OK) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "%s", idem_errmsg());
    }
    char out[160]; /* names what it reserved: the order's undo releases that */
    int n = snprintf(out, sizeof(out), "R%lld sku=%s stock=%lld", made + 1, sku, stock - 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* The reservation's undo, at the inventory: the stock goes back. */
static idem_code release(idem_call *call, void *arg)
{
    (void)arg;
    char sku[64];
    idem_txn *t = idem_call_txn(call);
    payload_str(call, sku, sizeof(sku));
    long long stock = INITIAL_STOCK, made = 0, back = 0;
    idem_code code;
    if ((code = get_ll(t, "stock", sku, &stock)) != IDEM_OK ||
        (code = get_ll(t, "reservations", sku, &made)) != IDEM_OK ||
        (code = get_ll(t, "releases", sku, &back)) != IDEM_OK) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "reading the stock: %s",
                              idem_code_name(code));
    }
    if (made <= 0) {
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "no reservation to release");
    }
    if ((code = put_ll(t, "stock", sku, stock + 1)) != IDEM_OK ||
        (code = put_ll(t, "reservations", sku, made - 1)) != IDEM_OK ||
        (code = put_ll(t, "releases", sku, back + 1)) != IDEM_OK) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "%s", idem_errmsg());
    }
    return reply_fmt(call, "released=%lld stock=%lld", back + 1, stock + 1);
}

static idem_code charge(idem_call *call, void *arg)
{
    (void)arg;
    char price[32];
    idem_txn *t = idem_call_txn(call);
    payload_str(call, price, sizeof(price));
    long long amount = atoll(price);
    if (amount <= 0) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "bad amount '%s'", price);
    }
    if (amount > 1000) { /* final: stored, and the order compensates */
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "insufficient funds");
    }
    long long total = 0, n = 0;
    idem_code code;
    if ((code = get_ll(t, "money", "total", &total)) != IDEM_OK ||
        (code = get_ll(t, "money", "charges", &n)) != IDEM_OK) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "reading the totals: %s",
                              idem_code_name(code));
    }
    if ((code = put_ll(t, "money", "total", total + amount)) != IDEM_OK ||
        (code = put_ll(t, "money", "charges", n + 1)) != IDEM_OK) {
        return idem_call_fail(call, IDEM_UNAVAILABLE, "%s", idem_errmsg());
    }
    return reply_fmt(call, "C%lld total=%lld", n + 1, total + amount);
}

static long long read_ll(const char *db, const char *key, long long absent)
{
    void *v;
    size_t n;
    long long x = absent;
    if (idem_store_app_get(S.store, db, key, strlen(key), &v, &n) == IDEM_OK) {
        if (n == sizeof(x)) {
            memcpy(&x, v, sizeof(x));
        }
        free(v);
    }
    return x;
}

static idem_code level(idem_call *call, void *arg)
{
    (void)arg;
    char sku[64];
    payload_str(call, sku, sizeof(sku));
    return reply_fmt(call, "stock=%lld reservations=%lld", read_ll("stock", sku, INITIAL_STOCK),
                     read_ll("reservations", sku, 0));
}

static idem_code releases(idem_call *call, void *arg)
{
    (void)arg;
    char sku[64];
    payload_str(call, sku, sizeof(sku));
    long long back = read_ll("releases", sku, 0), held = read_ll("reservations", sku, 0);
    return reply_fmt(call, "releases=%lld reserves=%lld", back, back + held);
}

static idem_code total(idem_call *call, void *arg)
{
    (void)arg;
    return reply_fmt(call, "total=%lld charges=%lld", read_ll("money", "total", 0),
                     read_ll("money", "charges", 0));
}

/* After the commit, before the reply leaves: around result_cache. */
static idem_code after_commit(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    idem_code code = idem_call_next(call, next);
    if (strstr(idem_call_method(call), "Reserve") != NULL ||
        strstr(idem_call_method(call), "Charge") != NULL) {
        crash_point("after_commit");
    }
    if (strstr(idem_call_method(call), "Release") != NULL) {
        crash_point("after_release_commit");
    }
    return code;
}

/* order: in front of result_cache, so after a compensated order's key was released and
 * before its answer leaves. */
static idem_code after_compensation(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    idem_code code = idem_call_next(call, next);
    if (idem_call_response_metadata(call, "idem-compensated") != NULL) {
        crash_point("after_compensation");
    }
    return code;
}

/* ---- order: three journaled steps ---- */

typedef struct hop {
    idem_client *client;
    const char *method, *step;
    char payload[64];
} hop;

/* A step's output is the downstream answer's payload. */
static idem_code hop_step(idem_call *call, void *arg, idem_step_result *out)
{
    hop *h = arg;
    idem_request q = {
        .method = h->method, .payload = h->payload, .payload_len = strlen(h->payload)};
    idem_result r;
    idem_code code = idem_call_downstream(call, h->client, h->step, &q, &r);
    if (code == IDEM_OK) {
        out->data = r.payload; /* handed over */
        out->len = r.payload_len;
        r.payload = NULL;
        r.payload_len = 0;
    } else {
        idem_call_fail(call, code, "%s: %s", h->method, r.message ? r.message : idem_errmsg());
    }
    idem_result_clear(&r);
    return code;
}

static idem_code new_order_id(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call, (void)arg;
    char id[32];
    FILE *f = fopen("/dev/urandom", "rb");
    uint64_t x = 0;
    if (f == NULL || fread(&x, sizeof(x), 1, f) != 1) {
        if (f != NULL) {
            fclose(f);
        }
        return IDEM_UNAVAILABLE;
    }
    fclose(f);
    int n = snprintf(id, sizeof(id), "O%016" PRIx64, x);
    if ((out->data = malloc((size_t)n)) == NULL) {
        return IDEM_RESOURCE_EXHAUSTED;
    }
    memcpy(out->data, id, (size_t)n);
    out->len = (size_t)n;
    return IDEM_OK;
}

/* The reservation's undo: inv.Stock/Release of the SKU the recorded reservation names
 * (done: "R<n> sku=<SKU> stock=<m>", the same on every run of the call, also after a
 * crash), with the undo's own derived key (idem_call_downstream inside an undo). The
 * undo runs after place() returned: what it needs comes from done, and its arg is the
 * server's client to the inventory, never a local of place(). */
static idem_code unreserve(idem_call *call, const char *step, const idem_step_result *done,
                           void *to_inventory)
{
    char answer[160], sku[64];
    snprintf(answer, sizeof(answer), "%.*s", (int)done->len, (const char *)done->data);
    if (sscanf(answer, "R%*[0-9] sku=%63s", sku) != 1) {
        return IDEM_DATA_LOSS; /* not a reservation: it stands (idem-compensated=partial) */
    }
    idem_request q = {.method = "inv.Stock/Release", .payload = sku, .payload_len = strlen(sku)};
    idem_result r;
    crash_point("before_undo");
    idem_code code = idem_call_downstream(call, to_inventory, step, &q, &r);
    idem_result_clear(&r);
    if (code == IDEM_OK) {
        crash_point("in_undo"); /* released downstream, not yet journaled here */
    }
    return code;
}

static idem_code place(idem_call *call, void *arg)
{
    (void)arg;
    char body[64], sku[32] = "", price[16] = "";
    payload_str(call, body, sizeof(body));
    if (sscanf(body, "%31s %15s", sku, price) != 2) {
        return idem_call_fail(call, IDEM_INVALID_ARGUMENT, "payload is 'SKU PRICE'");
    }
    hop inv = {S.to_inventory, "inv.Stock/Reserve", "reserve", ""};
    hop pay = {S.to_payment, "pay.Pay/Charge", "charge", ""};
    snprintf(inv.payload, sizeof(inv.payload), "%s", sku);
    snprintf(pay.payload, sizeof(pay.payload), "%s", price);
    idem_step_result id = {0}, r = {0}, c = {0};
    crash_point("before_reserve");
    idem_step_opts local = {.effect_free = true}; /* an id: nothing to give back */
    idem_code code = idem_call_step_with(call, "order-id", new_order_id, NULL, &local, &id);
    idem_step_opts undo = {.undo = unreserve, .undo_arg = S.to_inventory};
    if (code == IDEM_OK &&
        (code = idem_call_step_with(call, "reserve", hop_step, &inv, &undo, &r)) == IDEM_OK) {
        crash_point("between");
        code = idem_call_step(call, "charge", hop_step, &pay, &c);
    }
    if (code == IDEM_OK) {
        crash_point("after_charge");
        char out[200];
        int n = snprintf(out, sizeof(out), "order=%.*s reservation=%.*s charge=%.*s", (int)id.len,
                         (const char *)id.data, (int)r.len, (const char *)r.data, (int)c.len,
                         (const char *)c.data);
        code = idem_call_reply(call, IDEM_OK, out, (size_t)n);
    } else if (idem_call_code(call) == IDEM_OK) {
        code = idem_call_fail(call, code, "%s", idem_errmsg());
    }
    idem_step_result_clear(&id);
    idem_step_result_clear(&r);
    idem_step_result_clear(&c);
    return code;
}

/* ---- process ---- */

static bool parse(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[argc - 1], "--log-stdout") == 0) {
        S.log_stdout = true; /* a flag without a value: last */
        argc--;
    }
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (strcmp(k, "--role") == 0) {
            S.role = v;
        } else if (strcmp(k, "--listen") == 0) {
            S.listen = v;
        } else if (strcmp(k, "--db") == 0) {
            S.db = v;
        } else if (strcmp(k, "--inventory") == 0) {
            S.inventory = v;
        } else if (strcmp(k, "--payment") == 0) {
            S.payment = v;
        } else if (strcmp(k, "--crash-at") == 0) {
            S.crash_at = v;
        } else if (strcmp(k, "--lease-ms") == 0) {
            S.lease_ms = strtoull(v, NULL, 10);
        } else if (strcmp(k, "--redrive-ms") == 0) {
            S.redrive_ms = strtoull(v, NULL, 10);
        } else {
            return false;
        }
    }
    bool order = S.role != NULL && strcmp(S.role, "order") == 0;
    bool leaf =
        S.role != NULL && (strcmp(S.role, "inventory") == 0 || strcmp(S.role, "payment") == 0);
    return argc % 2 == 1 && S.listen != NULL && S.db != NULL && (leaf || order) &&
           (!order || (S.inventory != NULL && S.payment != NULL));
}

/* --log-stdout: the server's log lines on stdout, after "ready" (a test reads them). */
static void log_stdout(void *arg, idem_log_level level, const char *line)
{
    (void)arg, (void)level;
    printf("%s\n", line);
    fflush(stdout);
}

static idem_client *client_to(const char *url)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.caller = "order-svc"; /* the downstream services see this service, not its callers */
    o.attempt_timeout_ms = 500;
    o.retry.max_attempts = 4;
    o.retry.period_ms = 50;
    return idem_client_open(&c, (const char *[]){url}, 1, &o) == IDEM_OK ? c : NULL;
}

static idem_code register_role(idem_server *srv)
{
    idem_method_opts tx = {.flags = IDEM_METHOD_TRANSACTIONAL | IDEM_METHOD_KEY_REQUIRED};
    idem_code code;
    if (strcmp(S.role, "order") == 0) {
        idem_method_opts steps = {.flags = IDEM_METHOD_STEPS}; /* cached, key required */
        /* only to crash there: an interceptor before result_cache stops duplicates parking */
        bool hook = S.crash_at != NULL && strcmp(S.crash_at, "after_compensation") == 0;
        if (hook && (code = idem_server_use_first(srv, "after_compensation", after_compensation,
                                                  NULL)) != IDEM_OK) {
            return code;
        }
        return idem_server_register(srv, "order.Shop/Place", place, NULL, &steps);
    }
    if ((code = idem_server_use_builtin(srv, IDEM_BUILTIN_REQUEST_ID)) != IDEM_OK ||
        (code = idem_server_use(srv, "after_commit", after_commit, NULL)) != IDEM_OK ||
        (code = idem_server_use_builtin(srv, IDEM_BUILTIN_RESULT_CACHE)) != IDEM_OK) {
        return code;
    }
    if (strcmp(S.role, "inventory") == 0) {
        if ((code = idem_server_register(srv, "inv.Stock/Reserve", reserve, NULL, &tx)) !=
                IDEM_OK ||
            (code = idem_server_register(srv, "inv.Stock/Release", release, NULL, &tx)) !=
                IDEM_OK ||
            (code = idem_server_register(srv, "inv.Stock/Releases", releases, NULL, NULL)) !=
                IDEM_OK) {
            return code;
        }
        return idem_server_register(srv, "inv.Stock/Level", level, NULL, NULL);
    }
    return (code = idem_server_register(srv, "pay.Pay/Charge", charge, NULL, &tx)) != IDEM_OK
               ? code
               : idem_server_register(srv, "pay.Pay/Total", total, NULL, NULL);
}

int main(int argc, char **argv)
{
    if (!parse(argc, argv)) {
        fprintf(stderr, "usage: idemrpc-shop --role inventory|payment|order --listen URL --db DIR\n"
                        "       [--inventory URL --payment URL] [--lease-ms N] [--redrive-ms N]\n"
                        "       [--crash-at POINT] [--log-stdout]\n");
        return 2;
    }
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);

    idem_server_opts o;
    idem_server *srv;
    idem_server_opts_init(&o);
    o.db_path = S.db;
    o.lease_ms = S.lease_ms;
    o.redrive_interval_ms = S.redrive_ms;
    o.log_fn = S.log_stdout ? log_stdout : NULL;
    o.default_chain = strcmp(S.role, "order") == 0;
    bool order = strcmp(S.role, "order") == 0;
    if (order && ((S.to_inventory = client_to(S.inventory)) == NULL ||
                  (S.to_payment = client_to(S.payment)) == NULL)) {
        fprintf(stderr, "idemrpc-shop: %s\n", idem_errmsg());
        return 1;
    }
    if (idem_server_create(&srv, &o) != IDEM_OK || register_role(srv) != IDEM_OK ||
        idem_server_listen(srv, S.listen) != IDEM_OK) {
        fprintf(stderr, "idemrpc-shop %s: %s\n", S.role, idem_errmsg());
        return 1;
    }
    S.store = idem_server_store(srv);
    printf("ready\n");
    fflush(stdout);
    int sig;
    sigwait(&stop, &sig);
    idem_server_destroy(srv);
    idem_client_close(S.to_inventory);
    idem_client_close(S.to_payment);
    return 0;
}

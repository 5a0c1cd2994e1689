/* Scenarios b–e, g–i and k–n: the full chain, idem_client to idem_server with the
 * result cache, on an LMDB store in a temporary directory (b–e, one store flag apart)
 * or on PostgreSQL ($IDEMRPC_BENCH_PG, one or two server instances on the one
 * database). They share the client, the handlers and the server start; they differ in
 * the store behind the server, the keys (new per call, or replayed) and the method:
 * cached (echo), transactional (k, l: one business write with the record) or with
 * journaled steps (m, n). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static idem_code echo_handler(idem_call *call, void *arg)
{
    (void)arg;
    size_t n;
    const void *p = idem_call_payload(call, &n);
    return idem_call_reply(call, IDEM_OK, p, n);
}

/* k, l: the echo plus one business write that commits with the record. */
static idem_code tx_handler(idem_call *call, void *arg)
{
    (void)arg;
    const char *key = idem_call_key(call);
    idem_code code = idem_txn_put(idem_call_txn(call), "bench", key, strlen(key), "1", 1);
    return code != IDEM_OK ? idem_call_fail(call, code, "%s", idem_errmsg())
                           : echo_handler(call, NULL);
}

static idem_code step_fn(idem_call *call, void *arg, idem_step_result *out)
{
    (void)call, (void)arg;
    if ((out->data = malloc(64)) == NULL) {
        return IDEM_RESOURCE_EXHAUSTED;
    }
    memset(out->data, 's', 64);
    out->len = 64;
    return IDEM_OK;
}

/* o, p: the undo (a local no-op: the cost measured is the library's). */
static idem_code undo_fn(idem_call *call, const char *step, const idem_step_result *done, void *arg)
{
    (void)call, (void)step, (void)done, (void)arg;
    return IDEM_OK;
}

/* o, p: one step with an undo; p then fails finally, so the undo runs. */
static idem_code undo_handler(idem_call *call, int kind)
{
    idem_step_opts opts = {.undo = undo_fn};
    idem_step_result r;
    idem_code code = idem_call_step_with(call, "one", step_fn, NULL, &opts, &r);
    idem_step_result_clear(&r);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "step: %s", idem_errmsg());
    }
    return kind == HANDLER_COMPENSATED
               ? idem_call_fail(call, IDEM_FAILED_PRECONDITION, "insufficient funds")
               : echo_handler(call, NULL);
}

/* m, n: the echo after arg (an int) journaled steps; o, p: undo_handler. */
static idem_code steps_handler(idem_call *call, void *arg)
{
    static const char *const names[] = {"one", "two", "three"};
    int n = *(const int *)arg;
    if (n >= HANDLER_UNDO) {
        return undo_handler(call, n);
    }
    for (int i = 0; i < n && i < 3; i++) {
        idem_step_result r;
        idem_code code = idem_call_step(call, names[i], step_fn, NULL, &r);
        idem_step_result_clear(&r);
        if (code != IDEM_OK) {
            return idem_call_fail(call, code, "step: %s", idem_errmsg());
        }
    }
    return echo_handler(call, NULL);
}

static int chain_open(bench_thread *t)
{
    idem_client_opts o;
    const char *urls[] = {t->cell->url, t->cell->url2};
    const char *url = urls[0];
    idem_client_opts_init(&o);
    o.caller = "bench";
    o.attempt_timeout_ms = CALL_TIMEOUT_MS;
    o.deadline_ms = CALL_TIMEOUT_MS;
    o.retry.max_attempts = 1; /* a retry would hide a failure inside a latency */
    o.max_frame = MAX_FRAME;  /* the largest --payload's reply, whatever the default */
    if (idem_client_open(&t->conn.client, urls, t->cell->url2[0] ? 2 : 1, &o) != IDEM_OK) {
        return thread_fail(t, "idem_client_open %s: %s", url, idem_errmsg());
    }
    return 0;
}

static int chain_call(bench_thread *t)
{
    const cell *c = t->cell;
    char key[64];
    bool want_replayed = next_call_key(t, key, sizeof(key));

    idem_request q = {.method = METHOD,
                      .idempotency_key = key,
                      .payload = c->payload,
                      .payload_len = c->payload_len};
    idem_result r;
    idem_code code = idem_client_call(t->conn.client, &q, &r);
    int rv = 0;
    if (c->sc->handler == HANDLER_COMPENSATED && code == IDEM_FAILED_PRECONDITION) {
        const char *how = idem_result_metadata(&r, "idem-compensated");
        rv = how != NULL && strcmp(how, "all") == 0
                 ? 0
                 : thread_fail(t, "call: not compensated: %s", r.message ? r.message : "");
    } else if (code != IDEM_OK) {
        rv = thread_fail(t, "call: %s %s", idem_code_name(code),
                         r.message != NULL ? r.message : idem_errmsg());
    } else if (r.payload_len != c->payload_len || r.replayed != want_replayed) {
        rv = thread_fail(t, "call: %zu bytes, replayed %d (want %zu, %d)", r.payload_len,
                         r.replayed, c->payload_len, want_replayed);
    }
    idem_result_clear(&r);
    return rv;
}

static void chain_close(bench_thread *t)
{
    idem_client_close(t->conn.client);
}

static const client_ops chain_ops = {.open = chain_open, .call = chain_call, .close = chain_close};

static int chain_server_start(cell *c, int instance, idem_store *st, idem_server **srv,
                              cell_stats *out)
{
    idem_server_opts o;
    int kind = c->sc->handler;
    unsigned kind_flag = kind < 0   ? IDEM_METHOD_TRANSACTIONAL
                         : kind > 0 ? IDEM_METHOD_STEPS
                                    : IDEM_METHOD_CACHED;
    idem_method_opts m = {.flags = kind_flag | IDEM_METHOD_KEY_REQUIRED};
    idem_handler_fn fn = kind < 0 ? tx_handler : kind > 0 ? steps_handler : echo_handler;
    char url[160];

    idem_server_opts_init(&o);
    o.store = st;
    o.contexts = server_contexts(c->clients);
    o.max_frame = MAX_FRAME; /* the largest --payload's request, whatever the default */
    if (idem_server_create(srv, &o) != IDEM_OK) {
        return cell_fail(out, "idem_server_create: %s", idem_errmsg());
    }
    listen_url(c, instance, url, sizeof(url));
    if (idem_server_register(*srv, METHOD, fn, (void *)&c->sc->handler, &m) != IDEM_OK ||
        idem_server_listen(*srv, url) != IDEM_OK) {
        return cell_fail(out, "server %s: %s", url, idem_errmsg());
    }
    set_dial_url(c, url, idem_server_port(*srv));
    return 0;
}

int run_chain(const scenario *sc, cell *c, cell_stats *out)
{
    idem_store *st = NULL;
    idem_server *srv = NULL;
    const char *dir = tmp_dir_create();
    int rv = -1;

    if (dir == NULL) {
        return cell_fail(out, "mkdtemp under /tmp failed");
    }
    if (idem_store_open_lmdb(&st, dir, STORE_MAP_SIZE, sc->store_flags | cfg.store_flags) !=
        IDEM_OK) {
        cell_fail(out, "idem_store_open_lmdb %s: %s", dir, idem_errmsg());
        goto out;
    }
    if (chain_server_start(c, 0, st, &srv, out) == 0) {
        c->warmup = sc->keys == KEYS_REPLAY ? REPLAY_KEYS : WARMUP_CALLS;
        rv = run_clients(&chain_ops, c, out);
    }
out:
    idem_server_destroy(srv);
    idem_store_stats ss;
    if (st != NULL && idem_store_stats_get(st, &ss) == IDEM_OK && ss.commits > 0) {
        /* The store's own counters, warm-up included: on stderr, the table stays as it is. */
        fprintf(stderr,
                "lmdb %s, %d clients: %llu writes in %llu commits (%.2f per commit), "
                "%llu completions in their claim's commit, %llu early wake-ups\n",
                sc->name, c->clients, (unsigned long long)ss.writes, (unsigned long long)ss.commits,
                (double)ss.writes / (double)ss.commits, (unsigned long long)ss.shared_commits,
                (unsigned long long)ss.early_wakeups);
    }
    if (st != NULL) {
        idem_store_close(st);
    }
    tmp_dir_remove();
    return rv;
}

/* g–i: the same chain on PostgreSQL, with one or two server instances (q: i with the
 * store's replay cache); x, y: on the HA topology. */
int run_pg(const scenario *sc, cell *c, cell_stats *out)
{
    bool ha = sc->letter == 'x' || sc->letter == 'y';
    const char *env = ha ? "IDEMRPC_BENCH_PG_HA" : "IDEMRPC_BENCH_PG";
    const char *conninfo = getenv(env);
    idem_store *st[2] = {NULL, NULL};
    idem_server *srv[2] = {NULL, NULL};
    int rv = -1;

    if (conninfo == NULL) {
        return cell_fail(out, "set %s to a libpq conninfo", env);
    }
    for (int i = 0; i < sc->instances; i++) {
        idem_pg_opts po = {.pool_size = server_contexts(c->clients),
                           .replay_cache_entries = sc->letter == 'q' ? 16384 : 0};
        if (idem_store_open_postgres_ex(&st[i], conninfo, &po) != IDEM_OK) {
            cell_fail(out, "idem_store_open_postgres: %s", idem_errmsg());
            goto out;
        }
        if (i == 1) {
            snprintf(c->url2, sizeof(c->url2), "%s", c->url); /* the next start sets url */
        }
        if (chain_server_start(c, i, st[i], &srv[i], out) != 0) {
            goto out;
        }
    }
    c->warmup = sc->keys == KEYS_REPLAY ? REPLAY_KEYS : WARMUP_CALLS;
    /* q: each key replayed once more untimed (the read that fills the cache): at 64
     * clients a 1.5 s cell replays each of its 6400 keys about once. */
    c->warmup *= sc->letter == 'q' ? 2 : 1;
    rv = run_clients(&chain_ops, c, out);
out:
    for (int i = 0; i < 2; i++) {
        idem_server_destroy(srv[i]);
        if (st[i] != NULL) {
            idem_store_close(st[i]);
        }
    }
    return rv;
}

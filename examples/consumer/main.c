/* A program built against an installed idemrpc (docs/guide.md, "Use it from your project"): a
 * server with one cached method on inproc://, called twice with one key through
 * idem_client. The second call replays the first answer instead of running again.
 *   consumer [LMDB_DIR]      (default ./consumer-db, created if missing) */
#include <idemrpc/idemrpc.h>
#include <stdio.h>

static idem_code greet(idem_call *call, void *arg)
{
    size_t len;
    const char *name = idem_call_payload(call, &len);
    char out[128];
    int n = snprintf(out, sizeof(out), "hello, %.*s (call %d)", (int)len, name, ++*(int *)arg);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static int call_greet(idem_client *c)
{
    idem_request q = {.method = "demo.Greeter/Hello",
                      .idempotency_key = "greet-1",
                      .payload = "world",
                      .payload_len = 5};
    idem_result r;
    idem_code code = idem_client_call(c, &q, &r);
    if (code == IDEM_OK) {
        printf("%.*s, replayed: %s\n", (int)r.payload_len, (const char *)r.payload,
               r.replayed ? "true" : "false");
    } else {
        fprintf(stderr, "call: %s %s\n", idem_code_name(code), r.message ? r.message : "");
    }
    idem_result_clear(&r);
    return code == IDEM_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    const char *url = "inproc://consumer";
    int runs = 0, rv = 1;
    idem_server *srv = NULL;
    idem_client *c = NULL;
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.db_path = argc > 1 ? argv[1] : "consumer-db";
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    if (idem_server_create(&srv, &o) != IDEM_OK ||
        idem_server_register(srv, "demo.Greeter/Hello", greet, &runs, &m) != IDEM_OK ||
        idem_server_listen(srv, url) != IDEM_OK || idem_client_open(&c, &url, 1, NULL) != IDEM_OK) {
        fprintf(stderr, "consumer: %s\n", idem_errmsg());
        goto out;
    }
    rv = call_greet(c) || call_greet(c); /* the second one is a replay */
out:
    idem_client_close(c);
    idem_server_destroy(srv);
    return rv;
}

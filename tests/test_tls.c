/* TLS with required client certificates: one client CA per listener = one caller, over
 * tls+tcp:// (the real client) and https:// (curl). The CA and certificates are made
 * with openssl for every run, in a temp dir: nothing committed can expire. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "testutil.h"

static char *dir;
static char path[8][512];
enum { SERVER_PEM, SERVER_CA, CA_A, CLIENT_A, CA_B, CLIENT_B };
static atomic_int executions;

static const char *p(int which)
{
    return path[which];
}

/* Runs a shell command in dir; its exit status. */
static int sh(const char *cmd)
{
    char full[4096];
    snprintf(full, sizeof(full), "cd '%s' && %s", dir, cmd);
    int st = system(full);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#define KEYGEN "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
#define QUIET " >/dev/null 2>&1"

/* A CA named name: name.crt, name.key. */
static void make_ca(const char *name)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), KEYGEN "-x509 -days 2 -keyout %s.key -out %s.crt -subj /CN=%s" QUIET,
             name, name, name);
    cr_assert_eq(sh(cmd), 0, "openssl: CA %s", name);
}

/* name.pem: a certificate for cn (and localhost, 127.0.0.1) signed by ca, and its key. */
static void make_cert(const char *n, const char *ca, const char *cn)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             KEYGEN "-keyout %s.key -out %s.csr -subj /CN=%s" QUIET " && "
                    "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > %s.ext && "
                    "openssl x509 -req -days 2 -in %s.csr -CA %s.crt -CAkey %s.key "
                    "-CAcreateserial -extfile %s.ext -out %s.crt" QUIET " && "
                    "cat %s.crt %s.key > %s.pem",
             n, n, cn, n, n, ca, ca, n, n, n, n, n);
    cr_assert_eq(sh(cmd), 0, "openssl: certificate %s", n);
}

static void setup(void)
{
    dir = tu_tempdir("tls");
    make_ca("sca");
    make_ca("caA");
    make_ca("caB");
    make_cert("server", "sca", "localhost");
    make_cert("a", "caA", "client-a");
    make_cert("b", "caB", "client-b");
    const char *files[] = {"server.pem", "sca.crt", "caA.crt", "a.pem", "caB.crt", "b.pem"};
    for (size_t i = 0; i < 6; i++) {
        snprintf(path[i], sizeof(path[i]), "%s/%s", dir, files[i]);
    }
    atomic_store(&executions, 0);
}

static void teardown(void)
{
    tu_rmtree(dir);
}

TestSuite(tls, .init = setup, .fini = teardown, .timeout = 60);

/* Answers "<caller> <verified> <execution>". */
static idem_code h_who(idem_call *call, void *arg)
{
    (void)arg;
    char out[200];
    int n = snprintf(out, sizeof(out), "%s %d %d", idem_call_caller(call),
                     (int)idem_call_caller_verified(call), atomic_fetch_add(&executions, 1) + 1);
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* A server whose only listener is tls+tcp for caller (clients from ca); store shared
 * when not NULL. */
static void tls_server(tu_server *ts, idem_store *store, int ca, const char *caller)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = store;
    tu_server_create(ts, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED};
    cr_assert_eq(idem_server_register(ts->srv, "t.Who/Am", h_who, NULL, &cached), IDEM_OK);
    idem_tls_listener tls = {p(SERVER_PEM), p(ca), caller};
    cr_assert_eq(idem_server_listen_tls(ts->srv, "tls+tcp://127.0.0.1:0", &tls), IDEM_OK, "%s",
                 idem_errmsg());
    snprintf(ts->url, sizeof(ts->url), "tls+tcp://127.0.0.1:%d", idem_server_port(ts->srv));
}

static idem_client *tls_client(const char *url, int cert, uint32_t deadline_ms)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.tls_ca_file = p(SERVER_CA);
    o.tls_cert_key_file = p(cert);
    o.tls_server_name = "localhost";
    o.attempt_timeout_ms = deadline_ms / 2;
    o.deadline_ms = deadline_ms;
    cr_assert_eq(idem_client_open(&c, (const char *[]){url}, 1, &o), IDEM_OK, "%s", idem_errmsg());
    return c;
}

static idem_code call_who(idem_client *c, const char *caller, const char *key, idem_result *r)
{
    idem_request q = {.method = "t.Who/Am", .caller = caller, .idempotency_key = key};
    return idem_client_call(c, &q, r);
}

Test(tls, a_client_with_the_listeners_ca_is_its_caller_and_verified)
{
    tu_server s;
    tls_server(&s, NULL, CA_A, "A");
    idem_client *c = tls_client(s.url, CLIENT_A, 5000);
    idem_result r;
    cr_assert_eq(call_who(c, NULL, "k1", &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "A 1 1");
    idem_result_clear(&r);
    cr_expect_eq(call_who(c, "A", "k1", &r), IDEM_OK, "naming itself is fine");
    cr_expect(r.replayed);
    idem_result_clear(&r);
    idem_client_close(c);
    tu_server_destroy(&s, false);
}

Test(tls, a_request_naming_another_caller_is_permission_denied)
{
    tu_server s;
    tls_server(&s, NULL, CA_A, "A");
    idem_client *c = tls_client(s.url, CLIENT_A, 5000);
    idem_result r;
    cr_expect_eq(call_who(c, "B", "k1", &r), IDEM_PERMISSION_DENIED, "%s", r.message);
    cr_expect_neq(strstr(r.message ? r.message : "", "verified caller"), NULL, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&executions), 0);
    idem_client_close(c);
    tu_server_destroy(&s, false);
}

Test(tls, a_client_whose_certificate_another_ca_signed_cannot_connect)
{
    tu_server s;
    tls_server(&s, NULL, CA_A, "A");
    idem_client *c = tls_client(s.url, CLIENT_B, 1200);
    idem_result r;
    idem_code code = call_who(c, "A", "k1", &r);
    cr_expect(code == IDEM_UNAVAILABLE || code == IDEM_DEADLINE_EXCEEDED, "%s: %s",
              idem_code_name(code), r.message);
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&executions), 0, "no handshake, no call");
    idem_client_close(c);
    tu_server_destroy(&s, false);
}

Test(tls, caller_b_on_its_own_listener_never_reads_a_record_of_a)
{
    char *sdir;
    idem_store *st = tu_store_open("tls-shared", &sdir);
    tu_server sa, sb;
    tls_server(&sa, st, CA_A, "A");
    tls_server(&sb, st, CA_B, "B");
    idem_client *a = tls_client(sa.url, CLIENT_A, 5000), *b = tls_client(sb.url, CLIENT_B, 5000);
    idem_result r;
    cr_assert_eq(call_who(a, NULL, "same-key", &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "A 1 1");
    idem_result_clear(&r);
    cr_assert_eq(call_who(b, NULL, "same-key", &r), IDEM_OK, "%s", r.message);
    cr_expect_str_eq(r.payload, "B 1 2", "B's own execution, in B's scope");
    cr_expect_not(r.replayed);
    idem_result_clear(&r);
    idem_client_close(a);
    idem_client_close(b);
    tu_server_destroy(&sa, false);
    tu_server_destroy(&sb, false);
    idem_store_close(st);
    tu_rmtree(sdir);
}

/* curl over https with a client certificate; its exit status, the body in out. */
static int curl(int port, int cert, const char *extra_header, char *out, size_t cap)
{
    char fmt[2048];
    snprintf(fmt, sizeof(fmt),
             "curl -s --max-time 5 --cacert %s --cert %s --resolve localhost:%d:127.0.0.1 "
             "-H 'Idempotency-Key: h1' %s -X POST --data x "
             "https://localhost:%d/t.Who/Am > curl.out 2>/dev/null",
             p(SERVER_CA), p(cert), port, extra_header, port);
    int rc = sh(fmt);
    char file[600];
    snprintf(file, sizeof(file), "%s/curl.out", dir);
    FILE *f = fopen(file, "r");
    size_t n = f != NULL ? fread(out, 1, cap - 1, f) : 0;
    out[n] = '\0';
    if (f != NULL) {
        fclose(f);
    }
    return rc;
}

Test(tls, https_with_a_client_certificate_is_its_listeners_caller)
{
    tu_server s;
    idem_server_opts o;
    idem_server_opts_init(&o);
    tu_server_create(&s, &o);
    idem_method_opts cached = {.flags = IDEM_METHOD_CACHED};
    cr_assert_eq(idem_server_register(s.srv, "t.Who/Am", h_who, NULL, &cached), IDEM_OK);
    tu_server_listen(&s);
    idem_tls_listener tls = {p(SERVER_PEM), p(CA_A), "A"};
    cr_assert_eq(idem_server_listen_https(s.srv, "https://127.0.0.1:0", &tls), IDEM_OK, "%s",
                 idem_errmsg());
    int port = idem_server_http_port(s.srv);
    char body[512];
    cr_expect_eq(curl(port, CLIENT_A, "", body, sizeof(body)), 0);
    cr_expect_str_eq(body, "A 1 1");
    cr_expect_eq(curl(port, CLIENT_A, "-H 'X-Caller: B'", body, sizeof(body)), 0);
    cr_expect_neq(strstr(body, "PERMISSION_DENIED"), NULL, "%s", body);
    cr_expect_neq(curl(port, CLIENT_B, "", body, sizeof(body)), 0, "B's certificate: no TLS");
    cr_expect_eq(atomic_load(&executions), 1);
    tu_server_destroy(&s, false);
}

Test(tls, the_client_checks_the_servers_name_by_default)
{
    tu_server s;
    tls_server(&s, NULL, CA_A, "A");
    char url[96];
    snprintf(url, sizeof(url), "tls+tcp://localhost:%d", idem_server_port(s.srv));
    idem_client_opts o;
    idem_client *good, *bad;
    idem_client_opts_init(&o);
    o.tls_ca_file = p(SERVER_CA);
    o.tls_cert_key_file = p(CLIENT_A);
    o.attempt_timeout_ms = 600;
    o.deadline_ms = 1200;
    cr_assert_eq(idem_client_open(&good, (const char *[]){url}, 1, &o), IDEM_OK, "%s",
                 idem_errmsg());
    o.tls_server_name = "payments.example"; /* not the name in the server's certificate */
    cr_assert_eq(idem_client_open(&bad, (const char *[]){url}, 1, &o), IDEM_OK, "%s",
                 idem_errmsg());
    idem_result r;
    cr_expect_eq(call_who(good, NULL, "k1", &r), IDEM_OK, "the URL's host: %s", r.message);
    idem_result_clear(&r);
    idem_code code = call_who(bad, NULL, "k2", &r);
    cr_expect(code == IDEM_UNAVAILABLE || code == IDEM_DEADLINE_EXCEEDED,
              "a certificate for another name: %s", idem_code_name(code));
    idem_result_clear(&r);
    cr_expect_eq(atomic_load(&executions), 1);
    idem_client_close(good);
    idem_client_close(bad);
    tu_server_destroy(&s, false);
}

Test(tls, a_caller_of_a_tls_listener_cannot_be_declared_on_a_plain_one)
{
    tu_server s;
    tls_server(&s, NULL, CA_A, "A");
    char plain[600];
    snprintf(plain, sizeof(plain), "ipc://%s/plain.ipc", dir);
    cr_assert_eq(idem_server_listen(s.srv, plain), IDEM_OK, "%s", idem_errmsg());
    idem_client *c = tu_client(plain, 3000);
    idem_result r;
    cr_expect_eq(call_who(c, "A", "k1", &r), IDEM_PERMISSION_DENIED, "%s", r.message);
    idem_result_clear(&r);
    cr_expect_eq(call_who(c, "somebody-else", "k1", &r), IDEM_OK, "an unprotected name: %s",
                 r.message);
    cr_expect_str_eq(r.payload ? r.payload : "", "somebody-else 0 1");
    idem_result_clear(&r);
    idem_client_close(c);
    tu_server_destroy(&s, false);
}

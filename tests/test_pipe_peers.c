/* Integration: the nng front reads a pipe's transport identity once, when the pipe is
 * added, and forgets it when the pipe goes (src/server/nng_peers.c). A real server on
 * ipc:// (its uid mapped to a caller) and tcp:// at once, real clients. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "nng_peers.h"
#include "server_internal.h"
#include "testutil.h"

#define WHOAMI "test.Peer/WhoAmI"

static tu_server S;
static char ipc_url[256], *ipc_dir;

/* "caller=X verified=0|1" */
static idem_code h_whoami(idem_call *call, void *arg)
{
    (void)arg;
    char out[256];
    int n = snprintf(out, sizeof(out), "caller=%s verified=%d", idem_call_caller(call),
                     idem_call_caller_verified(call));
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

static void setup(void)
{
    idem_server_opts o;
    idem_ipc_caller me = {.uid = getuid(), .caller = "A"};
    idem_server_opts_init(&o);
    o.ipc_callers = &me;
    o.n_ipc_callers = 1;
    tu_server_create(&S, &o);
    cr_assert_eq(idem_server_register(S.srv, WHOAMI, h_whoami, NULL, NULL), IDEM_OK);
    ipc_dir = tu_tempdir("ipc");
    snprintf(ipc_url, sizeof(ipc_url), "ipc://%s/s.ipc", ipc_dir);
    cr_assert_eq(idem_server_listen(S.srv, ipc_url), IDEM_OK, "%s", idem_errmsg());
    tu_server_listen(&S);
}

static void teardown(void)
{
    tu_server_destroy(&S, false);
    tu_rmtree(ipc_dir);
}

TestSuite(pipe_peers, .init = setup, .fini = teardown, .timeout = 60);

static idem_client *client(const char *url, const char *caller)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.attempt_timeout_ms = 5000;
    o.retry.max_attempts = 1;
    o.caller = caller;
    cr_assert_eq(idem_client_open(&c, &url, 1, &o), IDEM_OK, "%s", idem_errmsg());
    return c;
}

/* One call; the reply payload (or message) into out. */
static idem_code whoami(idem_client *c, char *out, size_t cap)
{
    idem_result r;
    idem_request q = {.method = WHOAMI, .payload = "?", .payload_len = 1};
    idem_code code = idem_client_call(c, &q, &r);
    snprintf(out, cap, "%.*s", code == IDEM_OK ? (int)r.payload_len : (int)strlen(r.message),
             code == IDEM_OK ? (const char *)r.payload : r.message);
    idem_result_clear(&r);
    return code;
}

static void expect_whoami(idem_client *c, idem_code code, const char *want)
{
    char out[512];
    cr_assert_eq(whoami(c, out, sizeof(out)), code, "%s", out);
    cr_expect(strstr(out, want) != NULL, "%s (want %s)", out, want);
}

/* REM_POST runs on nng's reaper after the client closed: await it, bounded. */
static size_t await_pipe_peers(size_t want)
{
    size_t n = idem__server_pipe_peers(S.srv);
    for (int i = 0; i < 10000 && n != want; i++) {
        nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
        n = idem__server_pipe_peers(S.srv);
    }
    return n;
}

Test(pipe_peers, only_the_ipc_pipes_carry_the_uid_derived_caller)
{
    idem_client *ipc1 = client(ipc_url, NULL), *ipc2 = client(ipc_url, NULL);
    idem_client *tcp = client(S.url, "B"), *tcp_as_a = client(S.url, "A");
    for (int round = 0; round < 3; round++) { /* interleaved: each message its own pipe's */
        expect_whoami(ipc1, IDEM_OK, "caller=A verified=1");
        expect_whoami(tcp, IDEM_OK, "caller=B verified=0");
        expect_whoami(ipc2, IDEM_OK, "caller=A verified=1");
        expect_whoami(tcp_as_a, IDEM_PERMISSION_DENIED, "caller \"A\" is verified on this server");
    }
    cr_expect_eq(idem__server_pipe_peers(S.srv), 4, "one entry per open pipe");
    idem_client_close(ipc1);
    idem_client_close(tcp);
    cr_expect_eq(await_pipe_peers(2), 2);
    expect_whoami(ipc2, IDEM_OK, "caller=A verified=1");
    expect_whoami(tcp_as_a, IDEM_PERMISSION_DENIED, "caller \"A\" is verified on this server");
    idem_client_close(ipc2);
    idem_client_close(tcp_as_a);
}

Test(pipe_peers, connect_disconnect_cycles_leave_no_entry)
{
    for (int i = 0; i < 100; i++) {
        idem_client *c = client(i % 2 == 0 ? ipc_url : S.url, i % 2 == 0 ? NULL : "B");
        expect_whoami(c, IDEM_OK, i % 2 == 0 ? "caller=A verified=1" : "caller=B verified=0");
        idem_client_close(c);
    }
    cr_expect_eq(await_pipe_peers(0), 0, "every closed pipe's entry is dropped");
    idem_client *c = client(ipc_url, NULL); /* and the cache still fills */
    expect_whoami(c, IDEM_OK, "caller=A verified=1");
    cr_expect_eq(idem__server_pipe_peers(S.srv), 1);
    idem_client_close(c);
}

/* ---- the cache alone (nng_peers.c): what no real pipe shows on demand ---- */

Test(pipe_peers_cache, a_removal_that_overtakes_its_add_leaves_no_entry)
{
    idem_pipe_peers c;
    idem_peer uid = {.has_uid = true, .uid = 42}, out = {0};
    idem__pipe_peers_init(&c);
    idem__pipe_peers_remove(&c, 7); /* REM_POST before the ADD_PRE callback's insert */
    idem__pipe_peers_add(&c, 7, &uid);
    cr_expect_eq(idem__pipe_peers_count(&c), 0);
    cr_expect(!idem__pipe_peers_get(&c, 7, &out), "read per message, not from a dead entry");
    idem__pipe_peers_add(&c, 8, &uid); /* the next pipe is cached as usual */
    cr_expect(idem__pipe_peers_get(&c, 8, &out) && out.has_uid && out.uid == 42);
    idem__pipe_peers_fini(&c);
}

Test(pipe_peers_cache, a_full_cache_takes_no_more_and_an_id_reused_replaces_its_entry)
{
    idem_pipe_peers c;
    idem_peer tls = {.transport_unverified = true}, plain = {0}, out = {0};
    idem__pipe_peers_init(&c);
    for (uint32_t id = 1; id <= IDEM_PIPE_PEERS_MAX; id++) {
        idem__pipe_peers_add(&c, id, &tls);
    }
    idem__pipe_peers_add(&c, IDEM_PIPE_PEERS_MAX + 1, &plain);
    cr_expect_eq(idem__pipe_peers_count(&c), IDEM_PIPE_PEERS_MAX);
    cr_expect(!idem__pipe_peers_get(&c, IDEM_PIPE_PEERS_MAX + 1, &out), "over the bound");
    idem__pipe_peers_add(&c, 1, &plain); /* a new pipe under an id whose entry stayed */
    cr_expect(idem__pipe_peers_get(&c, 1, &out) && !out.transport_unverified);
    cr_expect(idem__pipe_peers_get(&c, 2, &out) && out.transport_unverified, "fail closed kept");
    for (uint32_t id = 1; id <= IDEM_PIPE_PEERS_MAX; id++) {
        idem__pipe_peers_remove(&c, id);
    }
    cr_expect_eq(idem__pipe_peers_count(&c), 0);
    idem__pipe_peers_fini(&c);
}

/* A disk that fails a sync, then syncs again, through the real server and client: what
 * was answered OK is on disk even where Linux marked the pages a failed fdatasync could
 * not write clean, so that the next fdatasync succeeds without writing them
 * ("fsyncgate"). The store's writes are recorded in this process (power_cut.c: a failed
 * sync loses what was pending, unless a later write to the page is synced), the server
 * is stopped, the power cut applied (power_cut_apply.c), and a server on what is left
 * must replay every answer. */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "lmdb_internal.h"
#include "power_cut.h"
#include "testutil.h"

static char *dir;
static char store_dir[512], data[600], undo[600];
static atomic_int runs;

static void setup(void)
{
    dir = tu_tempdir("sync_failure");
    snprintf(store_dir, sizeof(store_dir), "%s/store", dir);
    snprintf(data, sizeof(data), "%s/data.mdb", store_dir);
    snprintf(undo, sizeof(undo), "%s/undo.log", dir);
    atomic_store(&runs, 0);
}

static void teardown(void)
{
    atomic_store(&power_cut_pass_syncs, 0);
    atomic_store(&power_cut_fail_syncs, 0);
    tu_rmtree(dir);
}

TestSuite(sync_failure, .init = setup, .fini = teardown, .timeout = 60);

/* The first run lets its batch's commit sync and makes the sync after it (the one that
 * flushes the batch's meta page, nothing being queued) fail. */
static idem_code put(idem_call *call, void *arg)
{
    (void)arg;
    char out[64];
    int run = atomic_fetch_add(&runs, 1) + 1;
    int n = snprintf(out, sizeof(out), "run %d", run);
    if (run == 1) {
        atomic_store(&power_cut_pass_syncs, 1);
        atomic_store(&power_cut_fail_syncs, 1);
    }
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

/* A durable store (pipelined: its meta page waits for the next sync) and a server on
 * it; the claim and its completion share a batch (held open for them). */
static void start(idem_store **st, tu_server *srv)
{
    cr_assert_eq(idem_store_open_lmdb(st, store_dir, 0, 0), IDEM_OK, "%s", idem_errmsg());
    ((lmdb_store *)*st)->gc.hold_us = 30u * 1000 * 1000; /* before its first write */
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.store = *st;
    tu_server_create(srv, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(srv->srv, "s.Note/Put", put, NULL, &m), IDEM_OK);
    tu_server_listen(srv);
}

static void stop(idem_store *st, tu_server *srv)
{
    tu_server_destroy(srv, true);
    idem_store_close(st);
}

static idem_code call(const tu_server *srv, idem_result *r)
{
    idem_client *cl = tu_client(srv->url, 5000);
    idem_request q = {.method = "s.Note/Put", .idempotency_key = "k1"};
    idem_code code = idem_client_call(cl, &q, r);
    idem_client_close(cl);
    return code;
}

Test(sync_failure, an_answer_after_a_failed_sync_is_on_disk_though_the_next_sync_succeeds)
{
    idem_store *st;
    tu_server srv;
    idem_result r;
    power_cut_record(undo, data);
    start(&st, &srv);
    cr_assert_eq(call(&srv, &r), IDEM_OK, "%s", r.message ? r.message : "");
    cr_log_info("answered OK after %u attempt(s), %s", r.attempts,
                r.replayed ? "replayed" : "not replayed");
    cr_expect_eq(atomic_load(&power_cut_fail_syncs), 0, "the flush's sync failed");
    char answer[64];
    snprintf(answer, sizeof(answer), "%.*s", (int)r.payload_len, (const char *)r.payload);
    idem_result_clear(&r);
    stop(st, &srv);
    power_cut_record(NULL, NULL); /* else the cut's own writes would be recorded */

    long undone = power_cut_apply(undo, data);
    cr_assert_geq(undone, 1, "the power cut undid the write the failed sync lost");
    start(&st, &srv);
    cr_expect_eq(call(&srv, &r), IDEM_OK, "%s", r.message ? r.message : "");
    cr_expect(r.replayed, "k1 was answered OK (\"%s\"), and after the power cut it ran again",
              answer);
    cr_expect(r.payload_len == strlen(answer) && memcmp(r.payload, answer, r.payload_len) == 0,
              "answered \"%s\", now \"%.*s\"", answer, (int)r.payload_len, (const char *)r.payload);
    idem_result_clear(&r);
    stop(st, &srv);
}

/* The PostgreSQL store's replay cache (idem_pg_opts.replay_cache_*), through real servers
 * and clients on a schema of the test's own in $IDEMRPC_TEST_PG: what it answers, what
 * a forget on another instance costs, and its bounds. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/store/pg/pg_internal.h"
#include "testutil.h"

#define METHOD "cache.Test/Op"
#define CALLER "shop"

static char schema[32];
static char *conninfo;
static atomic_int runs;

static void setup(void)
{
    conninfo = tu_pg_schema_create(schema);
    atomic_store(&runs, 0);
}

static void teardown(void)
{
    if (conninfo != NULL) {
        tu_pg_schema_drop(schema);
        free(conninfo);
        conninfo = NULL;
    }
}

TestSuite(pg_cache, .init = setup, .fini = teardown, .timeout = 120);

/* Answers "<key> run <n>" followed by pad bytes of the request's payload length. */
static idem_code h_op(idem_call *call, void *arg)
{
    (void)arg;
    char out[8192];
    size_t pad = 0;
    idem_call_payload(call, &pad);
    int len = snprintf(out, sizeof(out), "%s run %d", idem_call_key(call),
                       atomic_fetch_add(&runs, 1) + 1);
    pad = pad < sizeof(out) - (size_t)len ? pad : sizeof(out) - (size_t)len;
    memset(out + len, 'p', pad);
    return idem_call_reply(call, IDEM_OK, out, (size_t)len + pad);
}

/* How many times st's listener has LISTENed (0: none yet, or none at all). */
static uint64_t listens_of(idem_store *st)
{
    pg_listener *l = ((pg_store *)st)->listener;
    return l != NULL ? idem__pg_listener_listens(l) : 0;
}

/* Waits (bounded) until st's listener has made more than after LISTENs: each one
 * empties the cache, so a test fills it after that. */
static void await_listens(idem_store *st, uint64_t after)
{
    for (int i = 0; i < 500 && listens_of(st) <= after; i++) {
        nanosleep(&(struct timespec){0, 10000000L}, NULL);
    }
    cr_assert_gt(listens_of(st), after, "the store's listener listens");
}

static idem_store *open_store(const idem_pg_opts *extra)
{
    idem_pg_opts o = extra != NULL ? *extra : (idem_pg_opts){0};
    idem_store *st;
    o.pool_size = 4;
    o.pooler = tu_pg_pooler();
    cr_assert_eq(idem_store_open_postgres_ex(&st, conninfo, &o), IDEM_OK, "%s", idem_errmsg());
    if (o.replay_cache_entries > 0 && !o.no_notify && !o.pooler) {
        await_listens(st, 0);
    }
    return st;
}

static void server_on(tu_server *ts, idem_store *st)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.contexts = 8;
    o.store = st;
    tu_server_create(ts, &o);
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    cr_assert_eq(idem_server_register(ts->srv, METHOD, h_op, NULL, &m), IDEM_OK, "%s",
                 idem_errmsg());
    tu_server_listen(ts);
}

/* One call of key on url with pad payload bytes; the result in *r (cleared by caller). */
static void call(const char *url, const char *key, size_t pad, idem_result *r)
{
    static const char payload[4096];
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.retry.max_attempts = 3;
    cr_assert_eq(idem_client_open(&c, (const char *[]){url}, 1, &o), IDEM_OK);
    idem_request q = {.method = METHOD,
                      .caller = CALLER,
                      .idempotency_key = key,
                      .payload = payload,
                      .payload_len = pad < sizeof(payload) ? pad : sizeof(payload)};
    memset(r, 0, sizeof(*r));
    cr_assert_eq(idem_client_call(c, &q, r), IDEM_OK, "%s: %s", key, r->message);
    idem_client_close(c);
}

static pg_rcache_stats stats_of(idem_store *st)
{
    pg_rcache_stats s;
    idem__pg_rcache_stats(((pg_store *)st)->rcache, &s);
    return s;
}

/* Replays key on url (run first when new) until st's cache answers one, bounded: the
 * first replay reads the database and fills the cache, but the announcement of the run's
 * own completion, or a LISTEN's flush, may land after that fill and empty it again.
 * *from_db and *from_cache: the last replay read from the database, and the hit (cleared
 * by the caller). */
static void replay_until_cached(idem_store *st, const char *url, const char *key, size_t pad,
                                idem_result *from_db, idem_result *from_cache)
{
    memset(from_db, 0, sizeof(*from_db));
    for (int i = 0; i < 20; i++) {
        uint64_t hits = stats_of(st).hits;
        call(url, key, pad, from_cache);
        if (stats_of(st).hits > hits) {
            return;
        }
        idem_result_clear(from_db);
        *from_db = *from_cache;
    }
    cr_assert_fail("%s was never replayed from the cache in 20 replays", key);
}

/* Runs key on url, then replays it until st's cache answers it. */
static void run_until_cached(idem_store *st, const char *url, const char *key)
{
    idem_result r, from_db;
    call(url, key, 0, &r);
    idem_result_clear(&r);
    replay_until_cached(st, url, key, 0, &from_db, &r);
    idem_result_clear(&from_db);
    idem_result_clear(&r);
}

static bool same_result(const idem_result *a, const idem_result *b)
{
    return a->code == b->code && a->payload_len == b->payload_len &&
           memcmp(a->payload, b->payload, a->payload_len) == 0;
}

Test(pg_cache, a_replay_served_from_the_cache_returns_the_bytes_the_database_holds)
{
    idem_store *st = open_store(&(idem_pg_opts){.replay_cache_entries = 64});
    tu_server a;
    server_on(&a, st);
    idem_result first, from_db, from_cache;
    call(a.url, "k1", 100, &first);
    replay_until_cached(st, a.url, "k1", 100, &from_db, &from_cache);
    cr_expect(!first.replayed && from_db.replayed && from_cache.replayed);
    cr_expect(same_result(&first, &from_db) && same_result(&first, &from_cache));
    cr_expect_str_eq(idem_result_metadata(&from_cache, "idem-first-at"),
                     idem_result_metadata(&from_db, "idem-first-at"));
    cr_expect_eq(atomic_load(&runs), 1);
    idem_result_clear(&first);
    idem_result_clear(&from_db);
    idem_result_clear(&from_cache);
    tu_server_destroy(&a, false);
    idem_store_close(st);
}

/* Replays key on url until the handler runs it again (a result that is no replay), at
 * most max_calls times, 20 ms apart; true when it ran again. */
static bool runs_again_within(const char *url, const char *key, int max_calls)
{
    for (int i = 0; i < max_calls; i++) {
        idem_result r;
        call(url, key, 0, &r);
        bool ran = !r.replayed;
        idem_result_clear(&r);
        if (ran) {
            return true;
        }
        struct timespec ts = {0, 20000000L};
        nanosleep(&ts, NULL); /* a bounded poll for a condition another process brings */
    }
    return false;
}

/* A cached replay on a, then the key forgotten through another store (idemctl's way):
 * a stops replaying it, bounded by max_calls polls. */
static void forget_elsewhere(const idem_pg_opts *cached, int max_calls)
{
    idem_store *st = open_store(cached), *other = open_store(NULL);
    tu_server a;
    server_on(&a, st);
    run_until_cached(st, a.url, "k-forget");
    idem_key_ref key = {CALLER, METHOD, "k-forget"};
    cr_assert_eq(idem_store_delete(other, &key), IDEM_OK, "%s", idem_errmsg());
    cr_expect(runs_again_within(a.url, "k-forget", max_calls),
              "the forgotten key still replays after %d polls", max_calls);
    cr_expect_eq(atomic_load(&runs), 2);
    tu_server_destroy(&a, false);
    idem_store_close(st);
    idem_store_close(other);
}

Test(pg_cache, a_key_forgotten_on_another_instance_stops_replaying_when_its_announcement_arrives)
{
    if (tu_pg_pooler()) {
        cr_skip_test("no LISTEN through a pooler: the ttl bounds it (the next test)");
    }
    /* a ttl of an hour: only the announcement can end the entry within the poll */
    forget_elsewhere(&(idem_pg_opts){.replay_cache_entries = 64, .replay_cache_ttl_ms = 3600000},
                     250);
}

Test(pg_cache, without_announcements_a_forgotten_key_stops_replaying_within_the_ttl)
{
    forget_elsewhere(
        &(idem_pg_opts){.replay_cache_entries = 64, .replay_cache_ttl_ms = 300, .no_notify = true},
        250);
}

/* Runs sql on a connection of its own (the test's schema); the first value of its
 * first row as an int, 0 when it has none. */
static int admin_int(const char *sql)
{
    PGconn *c = PQconnectdb(conninfo);
    cr_assert_eq(PQstatus(c), CONNECTION_OK, "%s", PQerrorMessage(c));
    PGresult *r = PQexec(c, sql);
    cr_assert(PQresultStatus(r) == PGRES_TUPLES_OK, "%s: %s", sql, PQerrorMessage(c));
    int v = PQntuples(r) > 0 ? atoi(PQgetvalue(r, 0, 0)) : 0;
    PQclear(r);
    PQfinish(c);
    return v;
}

/* The announcement of a forget lost (the forgetting store announces nothing, as one
 * sent while the listener was away), then the listener's connection killed: once it
 * listens again, the cached instance stops replaying the key, long before the ttl. */
Test(pg_cache, a_forget_whose_announcement_was_lost_stops_replaying_once_the_listener_is_back)
{
    if (tu_pg_pooler()) {
        cr_skip_test("no LISTEN through a pooler: the ttl bounds it");
    }
    idem_store *st = open_store(
                   &(idem_pg_opts){.replay_cache_entries = 64, .replay_cache_ttl_ms = 3600000}),
               *quiet = open_store(&(idem_pg_opts){.no_notify = true});
    tu_server a;
    server_on(&a, st);
    run_until_cached(st, a.url, "k-lost");
    idem_key_ref key = {CALLER, METHOD, "k-lost"};
    cr_assert_eq(idem_store_delete(quiet, &key), IDEM_OK, "%s", idem_errmsg());
    cr_assert(!runs_again_within(a.url, "k-lost", 1), "nothing announced the forget yet");
    uint64_t listens = listens_of(st);
    cr_assert_geq(admin_int("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                            "AND (query LIKE 'LISTEN %' OR query = 'SELECT pg_is_in_recovery()')"),
                  1, "the listener's backend was found and killed");
    await_listens(st, listens);
    cr_expect(runs_again_within(a.url, "k-lost", 250),
              "the forgotten key still replays after the listener came back");
    cr_expect_eq(atomic_load(&runs), 2);
    tu_server_destroy(&a, false);
    idem_store_close(st);
    idem_store_close(quiet);
}

typedef struct slow_replay {
    const char *url;
    idem_result r;
} slow_replay;

static void *slow_replay_main(void *arg)
{
    slow_replay *s = arg;
    call(s->url, "k-slow", 0, &s->r);
    return NULL;
}

/* A replay whose database read waits behind a table lock for twice the ttl fills the
 * cache with an entry counted from when the read began: already over, never answered. */
Test(pg_cache, an_entry_is_answered_at_most_the_ttl_after_the_read_that_filled_it_began)
{
    const uint32_t ttl = 300;
    idem_store *st = open_store(&(idem_pg_opts){.replay_cache_entries = 64,
                                                .replay_cache_ttl_ms = ttl,
                                                .lock_timeout_ms = 20000,
                                                .statement_timeout_ms = 30000});
    tu_server a;
    server_on(&a, st);
    idem_result r;
    call(a.url, "k-slow", 0, &r); /* the run: a COMPLETED record, nothing cached yet */
    idem_result_clear(&r);
    PGconn *lock = PQconnectdb(conninfo);
    cr_assert_eq(PQstatus(lock), CONNECTION_OK, "%s", PQerrorMessage(lock));
    PGresult *res = PQexec(lock, "BEGIN; LOCK TABLE idem_records IN ACCESS EXCLUSIVE MODE");
    cr_assert_eq(PQresultStatus(res), PGRES_COMMAND_OK, "%s", PQerrorMessage(lock));
    PQclear(res);
    slow_replay s = {.url = a.url};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, slow_replay_main, &s), 0);
    const char *waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                          "AND datname = current_database()";
    for (int i = 0; i < 500 && admin_int(waiting) == 0; i++) {
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL); /* a bounded poll: the read is queued behind the lock */
    }
    cr_assert_gt(admin_int(waiting), 0, "the replay's read waits for the lock");
    for (uint64_t until = idem__mono_ms() + 2 * ttl; idem__mono_ms() < until;) {
        struct timespec ts = {0, 20000000L};
        nanosleep(&ts, NULL); /* the read has now begun more than the ttl ago */
    }
    res = PQexec(lock, "COMMIT");
    cr_assert_eq(PQresultStatus(res), PGRES_COMMAND_OK, "%s", PQerrorMessage(lock));
    PQclear(res);
    PQfinish(lock);
    cr_assert_eq(pthread_join(th, NULL), 0);
    cr_expect(s.r.replayed, "the slow read replayed from the database");
    idem_result_clear(&s.r);
    uint64_t hits = stats_of(st).hits;
    call(a.url, "k-slow", 0, &r);
    cr_expect(r.replayed);
    idem_result_clear(&r);
    cr_expect_eq(stats_of(st).hits, hits, "an entry past its ttl from its read was answered");
    tu_server_destroy(&a, false);
    idem_store_close(st);
}

Test(pg_cache, entries_and_bytes_never_exceed_their_bounds)
{
    const size_t max_entries = 4, max_bytes = 3000;
    idem_store *st = open_store(
        &(idem_pg_opts){.replay_cache_entries = max_entries, .replay_cache_bytes = max_bytes});
    tu_server a;
    server_on(&a, st);
    idem_result r;
    for (int round = 0; round < 3; round++) {
        for (int k = 0; k < 12; k++) {
            char key[16];
            snprintf(key, sizeof(key), "b%d", k);
            call(a.url, key, k % 3 == 0 ? 1000 : 10, &r); /* some ~1 KB responses */
            idem_result_clear(&r);
            pg_rcache_stats s = stats_of(st);
            cr_assert_leq(s.entries, max_entries);
            cr_assert_leq(s.bytes, max_bytes);
        }
    }
    cr_expect_gt(stats_of(st).entries, 0);
    call(a.url, "huge", 4000, &r); /* over the bytes bound: never cached, still replayed */
    idem_result_clear(&r);
    call(a.url, "huge", 4000, &r);
    cr_expect(r.replayed && r.payload_len > 4000);
    idem_result_clear(&r);
    cr_expect_leq(stats_of(st).bytes, max_bytes);
    tu_server_destroy(&a, false);
    idem_store_close(st);
}

Test(pg_cache, is_off_unless_asked_for)
{
    idem_store *st = open_store(NULL);
    cr_expect_null(((pg_store *)st)->rcache);
    idem_store_close(st);
}

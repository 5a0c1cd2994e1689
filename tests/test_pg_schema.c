/* The PostgreSQL store's schema (src/store/pg/schema.c): a start whose tables are
 * complete takes no table lock; a migration creates only what is missing, waits politely
 * for a live session's lock instead of failing the start, leaves nothing half-made when
 * killed, and serialises two instances migrating at once; the tables' format is recorded
 * and a newer one refused. Needs $IDEMRPC_TEST_PG (skipped otherwise). */
#include <criterion/criterion.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "store.h"
#include "testutil.h"

static char schema[32];
static char *conninfo;
static PGconn *reader; /* a live session holding a lock, as another instance's txn would */

static void schema_setup(void)
{
    conninfo = tu_pg_schema_create(schema);
    idem_store *st;
    cr_assert_eq(tu_pg_open(&st, conninfo, 1), IDEM_OK, "%s", idem_errmsg());
    idem_store_close(st);
}

static void schema_teardown(void)
{
    if (reader != NULL) {
        PQfinish(reader);
        reader = NULL;
    }
    tu_pg_schema_drop(schema);
    free(conninfo);
    conninfo = NULL;
}

TestSuite(pg_schema, .init = schema_setup, .fini = schema_teardown, .timeout = 120);

/* The one value of sql on a connection of its own ("" for no row). */
static const char *value_of(const char *sql)
{
    static char buf[128];
    PGconn *c = PQconnectdb(conninfo);
    cr_assert_eq(PQstatus(c), CONNECTION_OK, "%s", PQerrorMessage(c));
    PGresult *r = PQexec(c, sql);
    cr_assert_eq(PQresultStatus(r), PGRES_TUPLES_OK, "%s: %s", sql, PQerrorMessage(c));
    snprintf(buf, sizeof(buf), "%s", PQntuples(r) > 0 ? PQgetvalue(r, 0, 0) : "");
    PQclear(r);
    PQfinish(c);
    return buf;
}

/* A session that read idem_records in a transaction it keeps open (ACCESS SHARE held). */
static void hold_a_read_of_idem_records(void)
{
    reader = PQconnectdb(conninfo);
    cr_assert_eq(PQstatus(reader), CONNECTION_OK, "%s", PQerrorMessage(reader));
    PGresult *r = PQexec(reader, "BEGIN; SELECT count(*) FROM idem_records");
    cr_assert_eq(PQresultStatus(r), PGRES_TUPLES_OK, "%s", PQerrorMessage(reader));
    PQclear(r);
}

static void end_the_read(void)
{
    PQclear(PQexec(reader, "COMMIT"));
}

/* Sessions of this schema's database waiting for a lock on a migration of the store. */
static int migrations_waiting(void)
{
    return atoi(value_of("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                         " AND query LIKE '%pg_advisory_xact_lock(1768189296)%'"));
}

/* Polls (up to 10 s) until a migration was seen waiting for a lock. It waits 200 ms at
 * a time and steps aside between attempts, so one look is no answer either way. */
static bool a_migration_waited(void)
{
    for (int i = 0; i < 1000; i++) {
        if (migrations_waiting() > 0) {
            return true;
        }
        usleep(10 * 1000);
    }
    return false;
}

static bool schema_complete(void)
{
    return strcmp(value_of("SELECT count(*) FROM pg_attribute WHERE attrelid ="
                           " to_regclass('idem_records') AND attname = 'token_expires_ms'"),
                  "1") == 0 &&
           strcmp(value_of("SELECT to_regclass('idem_kv_empty') IS NOT NULL"), "t") == 0 &&
           strcmp(value_of("SELECT value FROM idem_meta WHERE name = 'format'"), "1") == 0;
}

typedef struct opener {
    pthread_t tid;
    idem_code code;
    char msg[512];
} opener;

static void *open_store(void *arg)
{
    opener *o = arg;
    idem_store *st = NULL;
    o->code = tu_pg_open(&st, conninfo, 1);
    snprintf(o->msg, sizeof(o->msg), "%s", o->code == IDEM_OK ? "" : idem_errmsg());
    idem_store_close(st);
    return NULL;
}

Test(pg_schema, a_store_records_its_format)
{
    cr_expect_str_eq(value_of("SELECT value FROM idem_meta WHERE name = 'format'"), "1");
}

Test(pg_schema, a_newer_format_is_refused_clearly_and_left_as_it_is)
{
    tu_pg_exec(conninfo, "UPDATE idem_meta SET value = 2 WHERE name = 'format'");
    opener o;
    open_store(&o);
    cr_expect_eq(o.code, IDEM_FAILED_PRECONDITION, "%s", o.msg);
    cr_expect(strstr(o.msg, "format 2, newer than the 1") != NULL, "%s", o.msg);
    cr_expect_str_eq(value_of("SELECT value FROM idem_meta WHERE name = 'format'"), "2");
}

Test(pg_schema, an_older_format_record_is_raised_at_the_next_start)
{
    tu_pg_exec(conninfo, "UPDATE idem_meta SET value = 0 WHERE name = 'format'");
    opener o;
    open_store(&o);
    cr_expect_eq(o.code, IDEM_OK, "%s", o.msg);
    cr_expect_str_eq(value_of("SELECT value FROM idem_meta WHERE name = 'format'"), "1");
}

/* The previous release's tables (0.4 and older: no tombstones) gain the tombstone table,
 * its index and the Response-code function at the next start; the format stays 1, so
 * that an instance of that release still starts on the store (a rolling upgrade; it
 * ignores tombstones, docs/upgrading.md). */
Test(pg_schema, a_store_without_tombstones_gains_them_at_the_next_start_and_keeps_its_format)
{
    tu_pg_exec(conninfo, "DROP TABLE IF EXISTS idem_tombstones;"
                         " DROP FUNCTION IF EXISTS idem_response_code(bytea)");
    opener o;
    open_store(&o);
    cr_assert_eq(o.code, IDEM_OK, "%s", o.msg);
    cr_expect_str_eq(value_of("SELECT to_regclass('idem_tombstones') IS NOT NULL AND"
                              " to_regclass('idem_tombstones_until') IS NOT NULL AND"
                              " to_regprocedure('idem_response_code(bytea)') IS NOT NULL"),
                     "t");
    /* the function reads field 1 of a Response wherever it is, 0 when absent */
    cr_expect_str_eq(value_of("SELECT idem_response_code('\\x08051203616263'::bytea) || ','"
                              " || idem_response_code('\\x1203616263'::bytea) || ','"
                              " || idem_response_code('\\x1203616263080e'::bytea) || ','"
                              " || idem_response_code('\\x12ff'::bytea)"),
                     "5,0,14,2");
    cr_expect_str_eq(value_of("SELECT value FROM idem_meta WHERE name = 'format'"), "1");
}

/* An older release's tables lack a newer index: the start creates just that (a lock on
 * idem_kv), not an ALTER of idem_records, which a live reader's lock would stop. */
Test(pg_schema, a_start_that_adds_an_index_is_not_stopped_by_a_live_reader_of_records)
{
    tu_pg_exec(conninfo, "DROP INDEX idem_kv_empty");
    hold_a_read_of_idem_records();
    opener o;
    open_store(&o);
    cr_expect_eq(o.code, IDEM_OK, "%s", o.msg);
    end_the_read();
    cr_expect(schema_complete());
}

/* A column is missing: the ALTER needs the lock a live reader holds. The start waits
 * (politely: 200 ms at a time) and starts once the reader is done. */
Test(pg_schema, a_migration_waits_for_a_live_readers_lock_and_then_starts)
{
    tu_pg_exec(conninfo, "ALTER TABLE idem_records DROP COLUMN token_expires_ms");
    hold_a_read_of_idem_records();
    opener o;
    cr_assert_eq(pthread_create(&o.tid, NULL, open_store, &o), 0);
    cr_expect(a_migration_waited(), "the migration waits for the reader's lock");
    usleep(1500 * 1000); /* past the 1 s lock_timeout that used to fail the start */
    end_the_read();
    pthread_join(o.tid, NULL);
    cr_expect_eq(o.code, IDEM_OK, "%s", o.msg);
    cr_expect(schema_complete());
}

Test(pg_schema, a_migration_that_cannot_get_its_lock_in_time_says_why)
{
    tu_pg_exec(conninfo, "ALTER TABLE idem_records DROP COLUMN token_expires_ms");
    hold_a_read_of_idem_records();
    idem_store *st = NULL;
    idem_pg_opts opts = {.pool_size = 1, .pooler = tu_pg_pooler(), .migrate_timeout_ms = 1000};
    idem_code code = idem_store_open_postgres_ex(&st, conninfo, &opts);
    cr_expect_eq(code, IDEM_UNAVAILABLE, "%s", idem_errmsg());
    const char *m = idem_errmsg();
    cr_expect(strncmp(m, "canceling statement due to lock timeout", 39) == 0, "the cause first: %s",
              m);
    cr_expect(strstr(m, "(postgres schema migration, SQLSTATE 55P03)") != NULL, "%s", m);
    cr_expect(strstr(m, "migrate_timeout_ms") != NULL, "%s", m);
    cr_expect(strstr(m, "ALTER") == NULL && strlen(m) < 400, "no SQL in it: %s", m);
    idem_store_close(st);
}

/* A child (CONNINFO): another instance, starting on the store (migrating). */
TU_CHILD_MAIN(migrates)
{
    if (argc != 1) {
        return 2;
    }
    printf("ready\n");
    fflush(stdout);
    conninfo = argv[0];
    opener o;
    open_store(&o);
    return 0;
}

Test(pg_schema, a_migration_killed_midway_leaves_nothing_half_made)
{
    tu_pg_exec(conninfo, "ALTER TABLE idem_records DROP COLUMN token_expires_ms;"
                         " DROP INDEX idem_kv_empty; DROP TABLE idem_meta");
    hold_a_read_of_idem_records();
    tu_child other;
    tu_spawn_child(&other, "migrates", (const char *const[]){conninfo, NULL});
    cr_assert(a_migration_waited(), "the other instance is migrating");
    kill(other.pid, SIGKILL);
    tu_reap(&other);
    end_the_read();
    cr_expect_str_eq(value_of("SELECT to_regclass('idem_meta') IS NULL AND"
                              " to_regclass('idem_kv_empty') IS NULL"),
                     "t", "the killed migration left nothing");
    opener o;
    open_store(&o);
    cr_expect_eq(o.code, IDEM_OK, "%s", o.msg);
    cr_expect(schema_complete());
}

Test(pg_schema, two_instances_migrating_at_once_both_start)
{
    tu_pg_exec(conninfo, "DROP TABLE idem_records, idem_tokens, idem_kv, idem_meta;"
                         " DROP SEQUENCE idem_fence");
    opener o[4];
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(pthread_create(&o[i].tid, NULL, open_store, &o[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(o[i].tid, NULL);
        cr_expect_eq(o[i].code, IDEM_OK, "instance %d: %s", i, o[i].msg);
    }
    cr_expect(schema_complete());
}

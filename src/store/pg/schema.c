/* The PostgreSQL store's schema: created, migrated and versioned catalog-first.
 *
 * A start reads the catalog (no locks beyond a catalog read) and, when every table,
 * index, column and the format record are there, changes nothing: an ALTER TABLE or
 * CREATE INDEX that had nothing to do would still queue for a table lock behind every
 * open transaction that read the table (a live instance's handler, a pg_dump), and
 * everything after it would queue behind the ALTER. Only what is missing is created, in
 * one transaction, under an advisory lock that serialises instances migrating at once,
 * with the catalog read again under that lock. Each attempt waits for locks at most
 * MIGRATE_ATTEMPT_LOCK_MS and then steps aside (rolls back, so the queue it joined
 * drains), retrying with backoff for up to idem_pg_opts.migrate_timeout_ms. DDL is
 * transactional in PostgreSQL: a migration killed midway leaves nothing half-made.
 *
 * idem_meta ("format" → IDEM__PG_FORMAT) says what the tables are; a store of a newer
 * format is refused clearly, never misread. Older binaries ignore idem_meta. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg_internal.h"

#define MIGRATE_LOCK_KEY 1768189296 /* "idmp": the migration's advisory lock */
#define MIGRATE_ATTEMPT_LOCK_MS 200
#define MIGRATE_BACKOFF_MIN_MS 50
#define MIGRATE_BACKOFF_MAX_MS 1000

#define HAS_COLUMN(c)                                                                              \
    "EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('idem_records') AND"          \
    " attname = '" c "' AND NOT attisdropped)"
#define TOKEN_COLUMNS                                                                              \
    HAS_COLUMN("token") " AND " HAS_COLUMN("token_scope") " AND " HAS_COLUMN("token_expires_ms")

#define EVERY_OBJECT                                                                               \
    "to_regclass('idem_records') IS NOT NULL AND to_regclass('idem_records_expires') IS NOT NULL"  \
    " AND to_regclass('idem_tokens') IS NOT NULL AND to_regclass('idem_tokens_expires') IS NOT"    \
    " NULL AND " TOKEN_COLUMNS " AND to_regclass('idem_fence') IS NOT NULL AND"                    \
    " to_regclass('idem_kv') IS NOT NULL AND to_regclass('idem_kv_empty') IS NOT NULL AND"         \
    " to_regclass('idem_tombstones') IS NOT NULL AND"                                              \
    " to_regclass('idem_tombstones_until') IS NOT NULL AND " HAS_RESPONSE_CODE

/* The sweep's tombstone keeps the code of the stored Response (wire.h's
 * idem__response_code in SQL): field 1, a varint; absent (proto3) when OK; 2 (UNKNOWN)
 * for what does not parse. */
#define HAS_RESPONSE_CODE "to_regprocedure('idem_response_code(bytea)') IS NOT NULL"
#define RESPONSE_CODE_FN                                                                           \
    " CREATE FUNCTION idem_response_code(r bytea) RETURNS smallint LANGUAGE plpgsql IMMUTABLE"     \
    " AS $f$ DECLARE i int := 0; n int := coalesce(length(r), 0); f bigint; v bigint; s int;"      \
    " b int; BEGIN WHILE i < n LOOP"                                                               \
    " f := 0; s := 0; LOOP IF i >= n OR s > 56 THEN RETURN 2; END IF; b := get_byte(r, i);"        \
    " i := i + 1; f := f | ((b & 127)::bigint << s); s := s + 7; EXIT WHEN b < 128; END LOOP;"     \
    " IF f & 7 NOT IN (0, 2) THEN RETURN 2; END IF;"                                               \
    " v := 0; s := 0; LOOP IF i >= n OR s > 56 THEN RETURN 2; END IF; b := get_byte(r, i);"        \
    " i := i + 1; v := v | ((b & 127)::bigint << s); s := s + 7; EXIT WHEN b < 128; END LOOP;"     \
    " IF f & 7 = 0 AND f >> 3 = 1 THEN RETURN CASE WHEN v BETWEEN 0 AND 16 THEN v ELSE 2 END;"     \
    " ELSIF f & 7 = 2 THEN IF v < 0 OR v > n - i THEN RETURN 2; END IF; i := i + v::int; END IF;"  \
    " END LOOP; RETURN 0; END $f$;"

/* Every object there, whether idem_meta is (its format is read separately: a query
 * naming a missing table would not parse), and whether idem_records is (a store at all). */
static const char present_sql[] = "SELECT " EVERY_OBJECT ", to_regclass('idem_meta') IS NOT NULL,"
                                  " to_regclass('idem_records') IS NOT NULL";
static const char format_sql[] = "SELECT value FROM idem_meta WHERE name = 'format'";

/* %u: lock wait of this attempt, statement bound; %d: the advisory lock, the format.
 * Creates only what is missing, the catalog read again under the advisory lock. */
static const char migrate_sql[] =
    "SET LOCAL lock_timeout = %u; SET LOCAL statement_timeout = %u;"
    " SELECT pg_advisory_xact_lock(%d);"
    " DO $idem$ BEGIN"
    " IF to_regclass('idem_records') IS NULL THEN CREATE TABLE idem_records ("
    " caller text NOT NULL, method text NOT NULL, key text NOT NULL,"
    " state smallint NOT NULL CHECK (state IN (1, 2)), fingerprint bytea NOT NULL,"
    " owner bigint NOT NULL, lease_until_ms bigint NOT NULL, first_at_ms bigint NOT NULL,"
    " expires_ms bigint NOT NULL, response bytea, PRIMARY KEY (caller, method, key)); END IF;"
    " IF to_regclass('idem_records_expires') IS NULL THEN"
    " CREATE INDEX idem_records_expires ON idem_records (expires_ms); END IF;"
    " IF to_regclass('idem_tokens') IS NULL THEN CREATE TABLE idem_tokens ("
    " token text PRIMARY KEY, scope text NOT NULL, expires_ms bigint NOT NULL); END IF;"
    " IF to_regclass('idem_tokens_expires') IS NULL THEN"
    " CREATE INDEX idem_tokens_expires ON idem_tokens (expires_ms); END IF;"
    " IF NOT (" TOKEN_COLUMNS ") THEN ALTER TABLE idem_records"
    " ADD COLUMN IF NOT EXISTS token text, ADD COLUMN IF NOT EXISTS token_scope text,"
    " ADD COLUMN IF NOT EXISTS token_expires_ms bigint; END IF;"
    " IF to_regclass('idem_fence') IS NULL THEN CREATE SEQUENCE idem_fence; END IF;"
    " IF to_regclass('idem_kv') IS NULL THEN CREATE TABLE idem_kv (db text NOT NULL,"
    " k bytea NOT NULL, v bytea, PRIMARY KEY (db, k)); END IF;"
    " IF to_regclass('idem_kv_empty') IS NULL THEN"
    " CREATE INDEX idem_kv_empty ON idem_kv (db) WHERE v IS NULL; END IF;"
    " IF to_regclass('idem_tombstones') IS NULL THEN CREATE TABLE idem_tombstones ("
    " caller text NOT NULL, method text NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL,"
    " code smallint NOT NULL, first_at_ms bigint NOT NULL, expired_at_ms bigint NOT NULL,"
    " until_ms bigint NOT NULL, PRIMARY KEY (caller, method, key)); END IF;"
    " IF to_regclass('idem_tombstones_until') IS NULL THEN"
    " CREATE INDEX idem_tombstones_until ON idem_tombstones (until_ms); END IF;"
    " IF NOT " HAS_RESPONSE_CODE " THEN" RESPONSE_CODE_FN " END IF;"
    " IF to_regclass('idem_meta') IS NULL THEN"
    " CREATE TABLE idem_meta (name text PRIMARY KEY, value bigint NOT NULL); END IF;"
    " INSERT INTO idem_meta VALUES ('format', %d) ON CONFLICT (name) DO UPDATE"
    " SET value = GREATEST(idem_meta.value, EXCLUDED.value);"
    " END $idem$";

/* What the catalog says: *complete when every object and the format record are there;
 * a format newer than this binary's is FAILED_PRECONDITION; no idem_records table is
 * NOT_FOUND for a store opened with idem_pg_opts.existing. */
static idem_code schema_read(pool_slot *pc, bool *complete)
{
    PGresult *r;
    *complete = false;
    idem_code code = idem__pg_conn_query(pc->c, "schema check", present_sql, pc->bound_ms, &r);
    if (code != IDEM_OK) {
        return code;
    }
    bool objects = strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    bool meta = strcmp(PQgetvalue(r, 0, 1), "t") == 0;
    bool records = strcmp(PQgetvalue(r, 0, 2), "t") == 0;
    PQclear(r);
    if (!records && pc->st->existing) {
        return idem__err(IDEM_NOT_FOUND,
                         "the database is not an idemrpc store (no idem_records table on its "
                         "search_path): nothing created");
    }
    if (!meta) {
        return IDEM_OK;
    }
    if ((code = idem__pg_conn_query(pc->c, "schema format", format_sql, pc->bound_ms, &r)) !=
        IDEM_OK) {
        return code;
    }
    long long format = PQntuples(r) == 1 ? strtoll(PQgetvalue(r, 0, 0), NULL, 10) : 0;
    PQclear(r);
    if (format > IDEM__PG_FORMAT) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "the store's tables have format %lld, newer than the %d this idemrpc "
                         "understands: use the release that wrote them (docs/upgrading.md)",
                         format, IDEM__PG_FORMAT);
    }
    *complete = objects && format == IDEM__PG_FORMAT; /* an older format is migrated */
    return IDEM_OK;
}

idem_code idem__pg_schema_ensure(pool_slot *pc)
{
    pg_store *st = pc->st;
    bool complete;
    idem_code code = schema_read(pc, &complete);
    if (code == IDEM_OK && !complete && st->existing) {
        /* A tool's look changes nothing: a migration would also raise the format an
         * older server checks at its next start. */
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "the store's tables are of an older format than this idemrpc's %d "
                         "(or incomplete), and a tool does not migrate them: start a server "
                         "of this release on it first, or use the tool of the store's release",
                         IDEM__PG_FORMAT);
    }
    uint64_t give_up = idem__mono_ms() + st->migrate_ms, backoff = MIGRATE_BACKOFF_MIN_MS;
    unsigned attempts = 0;
    while (code == IDEM_OK && !complete) {
        char sql[sizeof(migrate_sql) + 64];
        uint64_t now = idem__mono_ms();
        uint32_t left = now < give_up ? (uint32_t)(give_up - now) : 1;
        /* The statement's bound outlasts the attempt's lock wait: a lock that never came
         * is reported as the lock timeout it is. */
        snprintf(sql, sizeof(sql), migrate_sql, MIGRATE_ATTEMPT_LOCK_MS,
                 left + MIGRATE_ATTEMPT_LOCK_MS, MIGRATE_LOCK_KEY, IDEM__PG_FORMAT);
        attempts++;
        code = idem__pg_conn_query(pc->c, "schema migration", sql,
                                   left + MIGRATE_ATTEMPT_LOCK_MS + 1000, NULL);
        if (code == IDEM_OK) {
            return IDEM_OK;
        }
        if (code != IDEM_UNAVAILABLE || PQtransactionStatus(pc->c) != PQTRANS_IDLE ||
            idem__mono_ms() + backoff >= give_up) {
            break;
        }
        /* Another session holds a lock the migration needs (or another instance is
         * migrating): step aside, then read the catalog again. */
        idem__sleep_ms(backoff);
        backoff = backoff * 2 > MIGRATE_BACKOFF_MAX_MS ? MIGRATE_BACKOFF_MAX_MS : backoff * 2;
        code = schema_read(pc, &complete);
    }
    if (code != IDEM_OK && attempts > 0) {
        char cause[512];
        snprintf(cause, sizeof(cause), "%s", idem_errmsg());
        return idem__err(code,
                         "%s; the schema migration gave up after %u attempts in %u ms "
                         "(idem_pg_opts.migrate_timeout_ms): another session holds a lock on "
                         "the store's tables (an open transaction, a pg_dump)",
                         cause, attempts, st->migrate_ms);
    }
    return code;
}

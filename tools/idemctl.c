/* idemctl: look at and repair an idemrpc store, LMDB (--db DIR) or PostgreSQL (--pg
 * CONNINFO), also while servers use it (LMDB readers never block the writer; writes here
 * queue behind the servers' like any other process's).
 *
 *   idemctl STORE [--json] stats
 *   idemctl STORE [--json] list [--caller C] [--state in_progress|completed] [--limit N]
 *                               [--lapsed] [--older-ms MS]   (calls in progress)
 *   idemctl STORE [--json] show METHOD KEY [--caller C]    (no --caller: any caller)
 *   idemctl STORE [--json] show --digest HEX [--caller C]  (the key= of a log line)
 *   idemctl STORE [--json] outbox [--limit N]               (idemctl_queues.c)
 *   idemctl STORE [--json] markers GROUP [--limit N]        (idemctl_queues.c)
 *   idemctl STORE [--json] journals [--limit N]             (idemctl_journal.c)
 *   idemctl STORE [--json] purge --expired
 *   idemctl STORE [--json] delete METHOD KEY [--caller C] [--force]
 *
 * Exit status: 0 done, 1 not found / refused / store error, 2 bad usage. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <idemrpc/idemrpc.h>

#include "cli.h"
#include "idemctl.h"
#include "json.h"
#include "idemrpc.pb-c.h"
#include "internal.h" /* idem__sha256 (src/supplemental, in the tools' helper library) */

static const char *state_name(idem_record_state s)
{
    return s == IDEM_REC_IN_PROGRESS ? "in_progress" : "completed";
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The clock rec's times are judged on: PostgreSQL reads its own with the record (the
 * database's), LMDB keeps the callers' times (this host's). */
uint64_t idemctl_store_now(const idem_record *rec)
{
    return rec->now_ms ? rec->now_ms : now_ms();
}

/* An IN_PROGRESS record whose owner stopped renewing: the next claim takes it over. */
static bool lease_lapsed(const idem_record *rec)
{
    return rec->state == IDEM_REC_IN_PROGRESS && rec->lease_until_ms <= idemctl_store_now(rec);
}

const char *idemctl_lease_name(const idem_record *rec)
{
    return rec->state != IDEM_REC_IN_PROGRESS ? "-" : lease_lapsed(rec) ? "lapsed" : "live";
}

void idemctl_print_time(uint64_t ms)
{
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    char buf[32];
    gmtime_r(&t, &tm);
    strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
    fputs(buf, stdout);
}

void idemctl_json_key(const char *caller, const char *method, const char *key)
{
    fputs("\"caller\":", stdout);
    idem__json_fputs(stdout, caller);
    fputs(",\"method\":", stdout);
    idem__json_fputs(stdout, method);
    fputs(",\"key\":", stdout);
    idem__json_fputs(stdout, key);
}

static int cmd_stats(idem_store *st, const args *a)
{
    idem_store_stats s;
    if (idem_store_stats_get(st, &s) != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return 1;
    }
    /* map_size 0: a store with no fixed map (PostgreSQL). */
    if (a->json) {
        printf("{\"records\":%zu,\"in_progress\":%zu,\"completed\":%zu,\"tokens\":%zu,"
               "\"tombstones\":%zu,\"map_size\":%zu,\"map_used\":%zu}\n",
               s.records, s.in_progress, s.completed, s.tokens, s.tombstones, s.map_size,
               s.map_used);
        return 0;
    }
    printf("records      %zu\nin_progress  %zu\ncompleted    %zu\ntokens       %zu\n"
           "tombstones   %zu\n",
           s.records, s.in_progress, s.completed, s.tokens, s.tombstones);
    if (s.map_size) {
        printf("map used     %zu of %zu bytes (%.1f%%)\n", s.map_used, s.map_size,
               100.0 * (double)s.map_used / (double)s.map_size);
    }
    return 0;
}

typedef struct list_state {
    const args *a;
    long shown;
} list_state;

/* --lapsed and --older-ms select calls in progress only. */
static bool list_wanted(const args *a, const idem_key_ref *k, const idem_record *rec)
{
    if ((a->caller[0] && strcmp(a->caller, k->caller) != 0) ||
        (a->state && strcmp(a->state, state_name(rec->state)) != 0)) {
        return false;
    }
    if ((a->lapsed || a->older_ms >= 0) && rec->state != IDEM_REC_IN_PROGRESS) {
        return false;
    }
    if (a->lapsed && !lease_lapsed(rec)) {
        return false;
    }
    return a->older_ms < 0 || rec->first_at_ms + (uint64_t)a->older_ms <= idemctl_store_now(rec);
}

static bool list_one(void *arg, const idem_key_ref *k, const idem_record *rec)
{
    list_state *ls = arg;
    const args *a = ls->a;
    if (!list_wanted(a, k, rec)) {
        return true;
    }
    if (ls->shown >= a->limit) {
        return false;
    }
    if (a->json) {
        fputs(ls->shown ? ",\n {" : "[\n {", stdout);
        idemctl_json_key(k->caller, k->method, k->key);
        printf(",\"state\":\"%s\",\"owner\":%" PRIu64 ",\"first_at_ms\":%" PRIu64
               ",\"lease_until_ms\":%" PRIu64 ",\"lease\":\"%s\",\"expires_ms\":%" PRIu64 "}",
               state_name(rec->state), rec->owner, rec->first_at_ms, rec->lease_until_ms,
               idemctl_lease_name(rec), rec->expires_ms);
    } else {
        if (ls->shown == 0) {
            printf("%-16s %-32s %-32s %-11s %-20s %-20s %s\n", "CALLER", "METHOD", "KEY", "STATE",
                   "FIRST_AT", "EXPIRES", "LEASE");
        }
        printf("%-16s %-32s %-32s %-11s ", k->caller[0] ? k->caller : "-", k->method, k->key,
               state_name(rec->state));
        idemctl_print_time(rec->first_at_ms);
        putchar(' ');
        idemctl_print_time(rec->expires_ms);
        printf(" %s\n", idemctl_lease_name(rec));
    }
    ls->shown++;
    return true;
}

static int cmd_list(idem_store *st, const args *a)
{
    if (a->state != NULL && strcmp(a->state, "tombstone") == 0) {
        return idemctl_list_tombs(st, a);
    }
    list_state ls = {a, 0};
    idem_code code = idem_store_foreach(st, list_one, &ls);
    if (a->json) {
        fputs(ls.shown ? "\n]\n" : "[]\n", stdout);
    } else if (ls.shown == 0) {
        puts("no records");
    }
    if (code != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return 1;
    }
    return 0;
}

static void print_response(const idem_record *rec, bool json)
{
    Idem__V1__Response *r = rec->response_len
                                ? idem__v1__response__unpack(NULL, rec->response_len, rec->response)
                                : NULL;
    if (r == NULL) {
        fputs(json ? "null" : "response     -\n", stdout);
        return;
    }
    if (json) {
        printf("{\"code\":\"%s\",\"message\":", idem_code_name(r->code));
        idem__json_fputs(stdout, r->message);
        printf(",\"payload_bytes\":%zu}", r->payload.len);
    } else { /* the handler's message, escaped: it may hold line breaks or raw bytes */
        size_t n = strlen(r->message);
        char *text = malloc(4 * n + 1);
        if (text != NULL) {
            idemctl_escape(r->message, n, n, text);
        }
        printf("response     %s, %zu payload bytes%s%s\n", idem_code_name(r->code), r->payload.len,
               n > 0 ? ", message: " : "", text != NULL ? text : "(no memory to show it)");
        free(text);
    }
    idem__v1__response__free_unpacked(r, NULL);
}

/* The key digest the log lines carry (observe.c): hex of SHA-256(key), 64 digits. */
static void key_digest(const char *key, char hex[65])
{
    uint8_t d[32];
    size_t len = strlen(key);
    if (!idem__sha256((const void *const[]){key}, &len, 1, d)) {
        snprintf(hex, 65, "%s", "unavailable"); /* only allocation fails */
        return;
    }
    for (int i = 0; i < 32; i++) {
        snprintf(hex + 2 * i, 3, "%02x", d[i]);
    }
}

static bool print_record(idem_store *st, const idem_key_ref *k, const idem_record *rec, bool json)
{
    char fp[2 * IDEM_FINGERPRINT_LEN + 1], digest[65];
    for (int i = 0; i < IDEM_FINGERPRINT_LEN; i++) {
        snprintf(fp + 2 * i, 3, "%02x", rec->fingerprint[i]);
    }
    key_digest(k->key, digest);
    digest[16] = '\0'; /* as logged: the first 8 bytes */
    if (json) {
        fputs("{", stdout);
        idemctl_json_key(k->caller, k->method, k->key);
        printf(",\"key_digest\":\"%s\",\"state\":\"%s\",\"owner\":%" PRIu64
               ",\"fingerprint\":\"%s\",\"first_at_ms\":%" PRIu64 ",\"lease_until_ms\":%" PRIu64
               ",\"lease\":\"%s\",\"store_now_ms\":%" PRIu64 ",\"expires_ms\":%" PRIu64
               ",\"response\":",
               digest, state_name(rec->state), rec->owner, fp, rec->first_at_ms,
               rec->lease_until_ms, idemctl_lease_name(rec), idemctl_store_now(rec),
               rec->expires_ms);
        print_response(rec, true);
        fputs(",\"journal\":", stdout);
        bool ok = idemctl_show_journal(st, k, rec, true);
        puts("}");
        return ok;
    }
    printf("caller       %s\nmethod       %s\nkey          %s\nkey digest   %s\n",
           k->caller[0] ? k->caller : "-", k->method, k->key, digest);
    printf("state        %s\nowner        %" PRIu64 "\nfingerprint  %s\nfirst at     ",
           state_name(rec->state), rec->owner, fp);
    idemctl_print_time(rec->first_at_ms);
    fputs(rec->state == IDEM_REC_IN_PROGRESS ? "\nlease until  " : "\nexpires      ", stdout);
    idemctl_print_time(rec->state == IDEM_REC_IN_PROGRESS ? rec->lease_until_ms : rec->expires_ms);
    if (rec->state == IDEM_REC_IN_PROGRESS) {
        uint64_t now = idemctl_store_now(rec), until = rec->lease_until_ms;
        printf(until <= now ? " (lapsed %" PRIu64 " ms ago)" : " (live, %" PRIu64 " ms left)",
               until <= now ? now - until : until - now);
    }
    putchar('\n');
    print_response(rec, false);
    return idemctl_show_journal(st, k, rec, false);
}

typedef struct show_state {
    const args *a;
    idem_key_ref *found; /* copies (free_refs) */
    size_t n, cap;
    bool oom;
} show_state;

static bool show_matches(const args *a, const idem_key_ref *k)
{
    if (a->caller_set && strcmp(a->caller, k->caller) != 0) {
        return false;
    }
    if (a->digest == NULL) {
        return strcmp(a->method, k->method) == 0 && strcmp(a->key, k->key) == 0;
    }
    char digest[65];
    key_digest(k->key, digest);
    return strncasecmp(digest, a->digest, strlen(a->digest)) == 0;
}

/* Collects the keys of matching records: a visit sees no response bytes, so show reads
 * each match again with idem_store_get. At most --limit. */
static bool show_collect(void *arg, const idem_key_ref *k, const idem_record *rec)
{
    show_state *ss = arg;
    (void)rec;
    if (!show_matches(ss->a, k)) {
        return true;
    }
    if (ss->n == ss->cap) {
        size_t cap = ss->cap ? 2 * ss->cap : 8;
        idem_key_ref *grown = realloc(ss->found, cap * sizeof(*grown));
        if (grown == NULL) {
            ss->oom = true;
            return false;
        }
        ss->found = grown, ss->cap = cap;
    }
    idem_key_ref *c = &ss->found[ss->n];
    c->caller = strdup(k->caller), c->method = strdup(k->method), c->key = strdup(k->key);
    ss->n++;
    ss->oom = c->caller == NULL || c->method == NULL || c->key == NULL;
    return !ss->oom && (long)ss->n < ss->a->limit;
}

static void free_refs(show_state *ss)
{
    for (size_t i = 0; i < ss->n; i++) {
        free((char *)ss->found[i].caller);
        free((char *)ss->found[i].method);
        free((char *)ss->found[i].key);
    }
    free(ss->found);
}

/* Prints one record, read afresh; false when it is gone (or unreadable). */
static bool show_key(idem_store *st, const idem_key_ref *k, bool json)
{
    idem_record rec;
    if (idem_store_get(st, k, &rec) != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return false;
    }
    bool ok = print_record(st, k, &rec, json);
    idem_record_clear(&rec);
    return ok;
}

/* show: one exact key with --caller; else every record of any caller with that method
 * and key, or whose key digest starts with --digest (records apart by a blank line;
 * --json prints one object per line). */
static int cmd_show(idem_store *st, const args *a)
{
    if (a->caller_set && a->digest == NULL) {
        idem_key_ref k = {a->caller, a->method, a->key};
        idem_record rec;
        idem_code code = idem_store_get(st, &k, &rec);
        if (code == IDEM_OK) {
            bool ok = print_record(st, &k, &rec, a->json);
            idem_record_clear(&rec);
            return ok ? 0 : 1;
        }
        char why[512];
        snprintf(why, sizeof(why), "%s", idem_errmsg());
        if (code == IDEM_NOT_FOUND && (idemctl_show_tomb(st, a) || idemctl_show_listed(st, a))) {
            return 0; /* its result expired, or released with its journal held */
        }
        fprintf(stderr, "idemctl: %s\n", why);
        return 1;
    }
    show_state ss = {.a = a};
    idem_code code = idem_store_foreach(st, show_collect, &ss);
    int rc = 0;
    if (code != IDEM_OK || ss.oom) {
        fprintf(stderr, "idemctl: %s\n", ss.oom ? "out of memory" : idem_errmsg());
        rc = 1;
    } else if (ss.n == 0 && a->digest == NULL && idemctl_show_listed(st, a)) {
        rc = 0;
    } else if (ss.n == 0) {
        if (a->digest != NULL) {
            fprintf(stderr, "idemctl: no record whose key digest starts with %s\n", a->digest);
        } else {
            fprintf(stderr, "idemctl: no record %s %s for any caller\n", a->method, a->key);
        }
        rc = 1;
    }
    for (size_t i = 0; rc == 0 && i < ss.n; i++) {
        if (i > 0 && !a->json) {
            putchar('\n');
        }
        rc = show_key(st, &ss.found[i], a->json) ? 0 : 1;
    }
    free_refs(&ss);
    return rc;
}

static int cmd_purge(idem_store *st, const args *a)
{
    if (!a->expired) {
        fprintf(stderr, "idemctl: purge needs --expired (only expired records are purged)\n");
        return 2;
    }
    size_t total = 0, n;
    uint64_t now = now_ms();
    do { /* bounded batches: the server's writers get their turn in between */
        if (idem_store_sweep(st, now, 1000, &n) != IDEM_OK) {
            fprintf(stderr, "idemctl: %s\n", idem_errmsg());
            return 1;
        }
        total += n;
    } while (n == 1000);
    printf(a->json ? "{\"purged\":%zu}\n" : "purged %zu expired records and tokens\n", total);
    return 0;
}

static int cmd_delete(idem_store *st, const args *a)
{
    idem_key_ref k = {a->caller, a->method, a->key};
    idem_record rec;
    idem_code code = idem_store_get(st, &k, &rec);
    idem_tombstone t;
    if (code == IDEM_NOT_FOUND && idem_store_tombstone_get(st, &k, &t) == IDEM_OK) {
        return idemctl_delete_tomb(st, a); /* its result expired: the tombstone goes */
    }
    if (code != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return 1;
    }
    bool running = rec.state == IDEM_REC_IN_PROGRESS;
    idem_record_clear(&rec);
    if (running && !a->force) {
        fprintf(stderr,
                "idemctl: %s %s is IN_PROGRESS: a call may be running it. Deleting "
                "lets a retry run it again. Repeat with --force to delete.\n",
                a->method, a->key);
        return 1;
    }
    if (idem_store_delete(st, &k) != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return 1;
    }
    if (!a->json) {
        printf("deleted %s %s\n", a->method, a->key);
        return 0;
    }
    fputs("{\"deleted\":{", stdout);
    idemctl_json_key(a->caller, a->method, a->key);
    puts("}}");
    return 0;
}

/* The store the command line names; an existing one only (nothing created from a
 * mistyped --db or --pg). LMDB opens read-only unless the command writes. */
static idem_code open_store(const args *a, bool writes, idem_store **st)
{
    if (a->pg != NULL) {
        idem_pg_opts o = {.pool_size = 1, .existing = true, .pooler = a->pooler};
        return idem_store_open_postgres_ex(st, a->pg, &o);
    }
    /* map_size 0: LMDB keeps the size the store was created with when it is larger. */
    return idem_store_open_lmdb(st, a->db, 0,
                                IDEM_STORE_EXISTING | (writes ? 0 : IDEM_STORE_READONLY));
}

int main(int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*fn)(idem_store *, const args *);
        bool writes;
    } cmds[] = {
        {"stats", cmd_stats, false},         {"list", cmd_list, false},
        {"show", cmd_show, false},           {"outbox", idemctl_outbox, false},
        {"markers", idemctl_markers, false}, {"journals", idemctl_journals, false},
        {"purge", cmd_purge, true},          {"delete", cmd_delete, true},
    };
    args a;
    int status;
    if (idemctl_dead_wanted(argc, argv)) { /* a broker's dead letters, not a store */
        return idemctl_dead_main(argc, argv);
    }
    if (!idemctl_parse(argc, argv, &a, &status)) {
        return status;
    }
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        if (strcmp(a.cmd, cmds[i].name) != 0) {
            continue;
        }
        idem_store *st;
        if (open_store(&a, cmds[i].writes, &st) != IDEM_OK) {
            fprintf(stderr, "idemctl: %s\n", idem_errmsg());
            return 1;
        }
        int rc = cmds[i].fn(st, &a);
        idem_store_close(st);
        return rc;
    }
    fprintf(stderr, "idemctl: unknown command '%s'\n", a.cmd);
    idemctl_usage(stderr);
    return CLI_USAGE_ERROR;
}

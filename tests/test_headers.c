/* The headers are the reference (issue 37 item 6): every default a public options struct
 * documents ("0 = ...") is the one the library uses, every close/destroy/clear takes
 * NULL, and <idemrpc/idemrpc.h> declares everything.
 *
 * Each row names a field, a pattern its header text must match (the header with its
 * comment markers and line breaks folded into single spaces) and the value the library
 * gives the field left 0. A struct's "0 = " count must equal its rows, so a new
 * documented default needs a row. */
#include <criterion/criterion.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client_internal.h"
#include "idemrpc/idemrpc.h" /* all of it: nats.h included */
#include "lmdb_internal.h"
#include "server_setup.h"
#include "testutil.h"

typedef struct row {
    const char *field, *pattern;
    double want, got;
} row;

/* The header's text, line breaks and runs of blanks folded into single spaces. */
static char *header_text(const char *name)
{
    const char *dir = getenv("IDEMRPC_INCLUDE");
    cr_assert_not_null(dir, "IDEMRPC_INCLUDE names include/idemrpc (tests/meson.build)");
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    char *out = calloc(1, 1 << 20);
    size_t n = 0;
    int ch, prev = ' ';
    while ((ch = fgetc(f)) != EOF && n < (1u << 20) - 1) {
        ch = ch == '\n' || ch == '\t' ? ' ' : ch;
        if (ch == ' ' && prev == ' ') {
            continue;
        }
        out[n++] = (char)ch;
        prev = ch;
    }
    fclose(f);
    return out;
}

/* The body of "typedef struct name {...} name;" in text, folded. */
static char *struct_body(const char *text, const char *name)
{
    char open[128], close[128];
    snprintf(open, sizeof(open), "typedef struct %s {", name);
    snprintf(close, sizeof(close), "} %s;", name);
    const char *a = strstr(text, open), *b = a != NULL ? strstr(a, close) : NULL;
    cr_assert(a != NULL && b != NULL, "struct %s not found", name);
    /* Comment markers out: "/ * ... * /" become spaces, so patterns read the prose. */
    char *body = strndup(a, (size_t)(b - a));
    char *w = body;
    for (const char *r = body; *r != '\0'; r++) {
        if ((r[0] == '/' && r[1] == '*') || (r[0] == '*' && r[1] == '/')) {
            r++;
            continue;
        }
        if (*r == '*' && w > body && w[-1] == ' ') {
            continue; /* a continuation line's " * " */
        }
        if (*r == ' ' && w > body && w[-1] == ' ') {
            continue;
        }
        *w++ = *r;
    }
    *w = '\0';
    return body;
}

static size_t count(const char *s, const char *what)
{
    size_t n = 0;
    for (const char *p = s; (p = strstr(p, what)) != NULL; p += strlen(what)) {
        n += p == s || p[-1] != '<'; /* "<0 = none" is not a default */
    }
    return n;
}

static void check_struct(const char *header, const char *name, const row *rows, size_t n)
{
    char *text = header_text(header);
    char *body = struct_body(text, name);
    for (size_t i = 0; i < n; i++) {
        regex_t re;
        cr_assert_eq(regcomp(&re, rows[i].pattern, REG_EXTENDED | REG_NOSUB), 0, "%s",
                     rows[i].pattern);
        cr_expect_eq(regexec(&re, body, 0, NULL, 0), 0, "%s %s: the header no longer says /%s/",
                     name, rows[i].field, rows[i].pattern);
        regfree(&re);
        cr_expect_eq(rows[i].got, rows[i].want, "%s %s: documented %.17g, the library uses %.17g",
                     name, rows[i].field, rows[i].want, rows[i].got);
    }
    cr_expect_eq(count(body, "0 = "), n,
                 "%s documents %zu defaults (\"0 = \"), this test has %zu rows: add the new "
                 "one",
                 name, count(body, "0 = "), n);
    free(body);
    free(text);
}

#define MiB (1024.0 * 1024.0)

Test(headers, every_default_server_h_documents_is_the_one_the_server_uses)
{
    idem_server_opts o;
    idem_server_opts_init(&o);
    idem__server_opts_defaults(&o);
    /* map_size is the LMDB store's: a store opened with 0. */
    char *dir = tu_tempdir("headers");
    idem_store *st;
    cr_assert_eq(idem_store_open_lmdb(&st, dir, 0, IDEM_STORE_NOSYNC), IDEM_OK, "%s",
                 idem_errmsg());
    MDB_envinfo info;
    cr_assert_eq(mdb_env_info(((lmdb_store *)st)->env, &info), 0);
    double cores = (double)sysconf(_SC_NPROCESSORS_ONLN);
    const row rows[] = {
        {"contexts", "contexts; concurrent calls .{0,50}; 0 = 256 ", 256, o.contexts},
        {"workers", "workers; handler threads; 0 = 2 x cores ", 2 * cores, o.workers},
        {"max_queue", "0 = no limit beyond contexts\\. size_t max_queue;", 0, o.max_queue},
        {"max_frame", "max_frame; bytes; 0 = 4 MiB\\.", 4 * MiB, o.max_frame},
        {"map_size", "map_size; LMDB map size; 0 = 1 GiB ", 1024 * MiB, info.me_mapsize},
        {"result_ttl_ms", "result_ttl_ms; 0 = 24 h ", 24 * 3600e3, o.result_ttl_ms},
        {"lease_ms", "lease_ms; 0 = 30 s ", 30e3, o.lease_ms},
        {"token_ttl_ms", "token_ttl_ms; 0 = 10 min ", 600e3, o.token_ttl_ms},
        {"max_wait_ms", "max_wait_ms; longest duplicate wait .{0,40}; 0 = 10 s ", 10e3,
         o.max_wait_ms},
        {"sweep_interval_ms", "sweep_interval_ms; 0 = 60 s ", 60e3, o.sweep_interval_ms},
        {"sweep_batch", "sweep_batch; records deleted per write txn; 0 = 1000 ", 1000,
         o.sweep_batch},
        {"max_run_ms", "max_run_ms; default of idem_method_opts.max_run_ms; 0 = 5 min ", 300e3,
         o.max_run_ms},
        {"max_waiters", "0 = 4096\\. size_t max_waiters;", 4096, o.max_waiters},
        {"http_max_pending", "0 = 1024\\. size_t http_max_pending;", 1024, o.http_max_pending},
        {"signature_window_ms", "signature_window_ms; accepted clock skew.{0,20}; 0 = 5 min ",
         300e3, o.signature_window_ms},
        {"redrive_batch", "redrive_batch; listed calls looked at per pass; 0 = 16 ", 16,
         o.redrive_batch},
        {"redrive_max_runs", "Re-runs of one call .{0,160}; 0 = 3, at most 254\\.", 3,
         o.redrive_max_runs},
        {"http_request_timeout_ms",
         "within http_request_timeout_ms of its first byte, else 408 "
         "and the connection closes \\(0 = 10 s\\)",
         10e3, o.http_request_timeout_ms},
        {"http_idle_timeout_ms", "after http_idle_timeout_ms \\(0 = 60 s\\)", 60e3,
         o.http_idle_timeout_ms},
        {"http_max_conns", "http_max_conns connections at once \\(0 = 1024\\)", 1024,
         o.http_max_conns},
        {"http_max_buffered", "\\(0 = 64 x max_frame, 256 MiB by default\\)", 256 * MiB,
         o.http_max_buffered},
    };
    check_struct("server.h", "idem_server_opts", rows, sizeof(rows) / sizeof(rows[0]));
    idem_store_close(st);
    tu_rmtree(dir);
}

Test(headers, every_default_client_h_documents_is_the_one_the_client_uses)
{
    idem_client_opts o;
    idem_client_opts_init(&o);
    idem__client_opts_defaults(&o);
    const row retry[] = {
        {"max_attempts", "max_attempts; 0 = 5; 1 = no retry", 5, o.retry.max_attempts},
        {"period_ms", "period_ms; first backoff; 0 = 100 ", 100, o.retry.period_ms},
        {"max_period_ms", "max_period_ms; cap; 0 = 1000 ", 1000, o.retry.max_period_ms},
        {"multiplier", "multiplier; 0 = 1\\.5 ", 1.5, o.retry.multiplier},
        {"jitter", "jitter; .{0,30}; 0 = 0\\.2, <0 = none ", 0.2, o.retry.jitter},
    };
    check_struct("client.h", "idem_retry_policy", retry, sizeof(retry) / sizeof(retry[0]));
    const row client[] = {
        {"attempt_timeout_ms", "attempt_timeout_ms; one attempt's reply wait; 0 = 2000 ", 2000,
         o.attempt_timeout_ms},
        {"deadline_ms", "deadline_ms; whole call incl\\. retries, sent as deadline; 0 = 10000 ",
         10000, o.deadline_ms},
        {"max_frame", "max_frame; reply limit; 0 = 4 MiB \\+ 64 KiB ", 4 * MiB + 64 * 1024,
         o.max_frame},
    };
    check_struct("client.h", "idem_client_opts", client, sizeof(client) / sizeof(client[0]));
}

/* Every close, destroy and clear of the public API takes NULL and does nothing (what
 * idemrpc.h says): a cleanup path may call them unconditionally. */
Test(headers, every_close_destroy_and_clear_takes_null)
{
    idem_client_close(NULL);
    idem_result_clear(NULL);
    idem_step_result_clear(NULL);
    idem_nats_consumer_close(NULL);
    idem_nats_relay_close(NULL);
    idem_debounce_destroy(NULL);
    idem_server_destroy(NULL);
    idem_store_close(NULL);
    idem_record_clear(NULL);
    idem_outbox_msgs_free(NULL, 3);
    cr_expect_eq(idem_lock_release(NULL), IDEM_INVALID_ARGUMENT);
}

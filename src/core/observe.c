/* Observability: one logfmt line per call and the counters behind GET /metrics.
 * Counters are relaxed atomics: they are statistics, not synchronisation. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"

static const char *const reasons[] = {
    IDEM_REASON_BAD_FRAME,     IDEM_REASON_TOO_LARGE,    IDEM_REASON_BUSY,
    IDEM_REASON_UNIMPLEMENTED, IDEM_REASON_KEY_REQUIRED, IDEM_REASON_BAD_KEY,
    IDEM_REASON_KEY_REUSED,    IDEM_REASON_IN_PROGRESS,  IDEM_REASON_TOKEN,
    IDEM_REASON_STORE,         IDEM_REASON_DEBOUNCED,    IDEM_REASON_DEADLINE,
    IDEM_REASON_CLAIM_LOST,    IDEM_REASON_IDENTITY,     IDEM_REASON_RESULT_GONE,
};
#define N_REASONS IDEM_ARRAY_LEN(reasons)

struct idem_observer {
    idem_log_level level;
    idem_log_fn fn;
    void *arg;
    atomic_ullong executed, replayed, rejected[N_REASONS + 1]; /* last: other */
    atomic_ullong by_code[IDEM_CODE_COUNT];
    atomic_llong in_flight, waiting;
    atomic_ullong latency_us_sum, calls, announcements;
    atomic_ullong redrives[IDEM__REDRIVE_EVENTS];
    atomic_ullong leases[IDEM__LEASE_EVENTS];
    /* idem__store_gauges, field by field; store_reads: reads that set them */
    atomic_ullong in_progress, completed, tombstones, map_size, map_used, outbox_pending,
        outbox_age_ms;
    atomic_ullong store_reads, store_read_failures;
    idem__metric_sources *sources;
};

static void log_stderr(void *arg, idem_log_level level, const char *line)
{
    (void)arg, (void)level;
    fprintf(stderr, "%s\n", line);
}

idem_observer *idem__observer_create(const idem_server_opts *opts)
{
    idem_observer *obs = calloc(1, sizeof(*obs));
    if (obs != NULL && (obs->sources = idem__metric_sources_create()) == NULL) {
        free(obs);
        return NULL;
    }
    if (obs != NULL) {
        obs->level = opts->log_level;
        obs->fn = opts->log_fn != NULL ? opts->log_fn : log_stderr;
        obs->arg = opts->log_arg;
    }
    return obs;
}

void idem__observer_destroy(idem_observer *obs)
{
    if (obs != NULL) {
        idem__metric_sources_destroy(obs->sources);
    }
    free(obs);
}

idem__metric_sources *idem__observer_sources(idem_observer *obs)
{
    return obs->sources;
}

/* One escape of logfmt's quoted values into esc (≥ 5 bytes); returns its length. */
static size_t logfmt_escape(unsigned char c, char esc[5])
{
    switch (c) {
    case '"':
    case '\\':
        esc[0] = '\\', esc[1] = (char)c;
        return 2;
    case '\n':
        memcpy(esc, "\\n", 2);
        return 2;
    case '\r':
        memcpy(esc, "\\r", 2);
        return 2;
    case '\t':
        memcpy(esc, "\\t", 2);
        return 2;
    default:
        if (c < 0x20 || c == 0x7f) {
            snprintf(esc, 5, "\\x%02x", c);
            return 4;
        }
        esc[0] = (char)c;
        return 1;
    }
}

const char *idem__logfmt_quote(char *out, size_t cap, const char *s)
{
    size_t n = 0;
    out[n++] = '"';
    for (const unsigned char *p = (const unsigned char *)(s != NULL ? s : ""); *p; p++) {
        char esc[5];
        size_t k = logfmt_escape(*p, esc);
        if (n + k + 2 > cap) { /* room for the closing quote and the NUL */
            break;
        }
        memcpy(out + n, esc, k);
        n += k;
    }
    out[n++] = '"';
    out[n] = '\0';
    return out;
}

void idem__log(idem_observer *obs, idem_log_level level, const char *fmt, ...)
{
    char line[1024];
    if (obs == NULL || level > obs->level) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(line, sizeof(line), "level=%s ", level == IDEM_LOG_ERROR ? "error" : "info");
    vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    /* Callers quote what a client chose (idem__logfmt_quote); this is the backstop that
     * keeps one call one line even if a value slipped through unquoted. */
    for (char *p = line; *p; p++) {
        if ((unsigned char)*p < 0x20 || *p == 0x7f) {
            *p = '?';
        }
    }
    obs->fn(obs->arg, level, line);
}

static size_t reason_index(const char *reason)
{
    for (size_t i = 0; reason != NULL && i < N_REASONS; i++) {
        if (strcmp(reason, reasons[i]) == 0) {
            return i;
        }
    }
    return N_REASONS;
}

static const char *outcome(const idem_call *call)
{
    return call->replayed ? "replayed" : call->executed ? "executed" : "rejected";
}

static bool lower_hex(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) {
            return false;
        }
    }
    return true;
}

/* " trace_id=<32 hex>" from a well-formed W3C traceparent (version-trace-parent-flags),
 * else "": a malformed one is not logged at all. */
static void trace_field(const idem_call *call, char out[48])
{
    const char *v = idem_call_metadata(call, "traceparent");
    out[0] = '\0';
    if (v == NULL || strlen(v) != 55 || v[2] != '-' || v[35] != '-' || v[52] != '-' ||
        !lower_hex(v, 2) || !lower_hex(v + 3, 32) || !lower_hex(v + 36, 16) ||
        !lower_hex(v + 53, 2) || strncmp(v, "ff", 2) == 0 ||
        strncmp(v + 3, "00000000000000000000000000000000", 32) == 0) {
        return;
    }
    snprintf(out, 48, " trace_id=%.32s", v + 3);
}

void idem__log_key_hash(char out[IDEM_LOG_KEY_HASH_CAP], const char *key)
{
    uint8_t d[32];
    snprintf(out, IDEM_LOG_KEY_HASH_CAP, "-");
    if (key != NULL &&
        idem__sha256((const void *const[]){key}, (const size_t[]){strlen(key)}, 1, d)) {
        idem__hex(out, d, 8);
    }
}

void idem__observe_call(idem_observer *obs, const idem_call *call, uint64_t latency_us)
{
    if (call->replayed) {
        atomic_fetch_add_explicit(&obs->replayed, 1, memory_order_relaxed);
    } else if (call->executed) {
        atomic_fetch_add_explicit(&obs->executed, 1, memory_order_relaxed);
    } else {
        atomic_fetch_add_explicit(&obs->rejected[reason_index(call->reason)], 1,
                                  memory_order_relaxed);
    }
    if ((unsigned)call->code < IDEM_CODE_COUNT) {
        atomic_fetch_add_explicit(&obs->by_code[call->code], 1, memory_order_relaxed);
    }
    atomic_fetch_add_explicit(&obs->calls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&obs->latency_us_sum, latency_us, memory_order_relaxed);
    if (obs->level < IDEM_LOG_INFO) {
        return;
    }
    /* The key is logged as a hash: it may carry business identifiers. */
    char key_hash[IDEM_LOG_KEY_HASH_CAP];
    idem__log_key_hash(key_hash, call->key_source != IDEM_KEY_NONE ? call->key : NULL);
    /* request id, method and caller are the client's: quoted and escaped. */
    char id[IDEM_LOGQ_CAP], method[IDEM_LOGQ_CAP], caller[IDEM_LOGQ_CAP], trace[48];
    trace_field(call, trace);
    idem__log(obs, IDEM_LOG_INFO,
              "request_id=%s%s method=%s caller=%s key=%s outcome=%s%s%s code=%s "
              "attempt=%u latency_us=%llu",
              idem__logfmt_quote(id, sizeof(id), call->request_id[0] ? call->request_id : "-"),
              trace, idem__logfmt_quote(method, sizeof(method), call->req->method),
              idem__logfmt_quote(caller, sizeof(caller), call->caller), key_hash, outcome(call),
              call->reason ? " reason=" : "", call->reason ? call->reason : "",
              idem_code_name(call->code), call->req->attempt, (unsigned long long)latency_us);
}

void idem__observe_announcement(idem_observer *obs)
{
    atomic_fetch_add_explicit(&obs->announcements, 1, memory_order_relaxed);
}

void idem__observe_redrive(idem_observer *obs, enum idem__redrive_event what)
{
    atomic_fetch_add_explicit(&obs->redrives[what], 1, memory_order_relaxed);
}

void idem__observe_lease(idem_observer *obs, enum idem__lease_event what)
{
    if (obs != NULL) {
        atomic_fetch_add_explicit(&obs->leases[what], 1, memory_order_relaxed);
    }
}

#define STORE(x, v) atomic_store_explicit(&(x), (v), memory_order_relaxed)

void idem__observe_store(idem_observer *obs, const idem__store_gauges *g)
{
    STORE(obs->in_progress, g->in_progress);
    STORE(obs->completed, g->completed);
    STORE(obs->tombstones, g->tombstones);
    STORE(obs->map_size, g->map_size);
    STORE(obs->map_used, g->map_used);
    STORE(obs->outbox_pending, g->outbox_pending);
    STORE(obs->outbox_age_ms, g->outbox_oldest_age_ms);
    atomic_fetch_add_explicit(&obs->store_reads, 1, memory_order_relaxed);
}

void idem__observe_store_failure(idem_observer *obs)
{
    atomic_fetch_add_explicit(&obs->store_read_failures, 1, memory_order_relaxed);
}

void idem__observe_waiting(idem_observer *obs, int delta)
{
    atomic_fetch_add_explicit(&obs->waiting, delta, memory_order_relaxed);
}

void idem__observe_in_flight(idem_observer *obs, int delta)
{
    atomic_fetch_add_explicit(&obs->in_flight, delta, memory_order_relaxed);
}

/* Appends printf output to a growing buffer; false on ENOMEM. */
static bool append(char **buf, size_t *len, size_t *cap, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(*buf + *len, *cap - *len, fmt, ap);
        va_end(ap);
        if (n >= 0 && (size_t)n < *cap - *len) {
            *len += (size_t)n;
            return true;
        }
        char *grown = realloc(*buf, *cap * 2);
        if (grown == NULL) {
            return false;
        }
        *buf = grown;
        *cap *= 2;
    }
}

#define LOAD(x) ((unsigned long long)atomic_load_explicit(&(x), memory_order_relaxed))

/* The call counters: calls by outcome, rejections by reason, responses by code. */
static bool metrics_calls(char **b, size_t *len, size_t *cap, idem_observer *obs)
{
    bool ok = append(b, len, cap,
                     "# HELP idem_calls_total Calls by outcome.\n"
                     "# TYPE idem_calls_total counter\n"
                     "idem_calls_total{outcome=\"executed\"} %llu\n"
                     "idem_calls_total{outcome=\"replayed\"} %llu\n",
                     LOAD(obs->executed), LOAD(obs->replayed));
    unsigned long long rejected = 0;
    for (size_t i = 0; i <= N_REASONS; i++) {
        rejected += LOAD(obs->rejected[i]);
    }
    ok = ok && append(b, len, cap,
                      "idem_calls_total{outcome=\"rejected\"} %llu\n"
                      "# HELP idem_rejected_total Calls the library rejected, "
                      "by reason.\n# TYPE idem_rejected_total counter\n",
                      rejected);
    for (size_t i = 0; i <= N_REASONS && ok; i++) {
        ok = append(b, len, cap, "idem_rejected_total{reason=\"%s\"} %llu\n",
                    i < N_REASONS ? reasons[i] : "other", LOAD(obs->rejected[i]));
    }
    ok = ok && append(b, len, cap,
                      "# HELP idem_responses_total Responses by code.\n"
                      "# TYPE idem_responses_total counter\n");
    for (int c = 0; c < IDEM_CODE_COUNT && ok; c++) {
        ok = append(b, len, cap, "idem_responses_total{code=\"%s\"} %llu\n", idem_code_name(c),
                    LOAD(obs->by_code[c]));
    }
    return ok;
}

/* The gauges (in flight, waiting), the announcements and re-drives, and the latency. */
static bool metrics_gauges(char **b, size_t *len, size_t *cap, idem_observer *obs)
{
    return append(b, len, cap,
                  "# HELP idem_in_flight Calls received and not yet answered.\n"
                  "# TYPE idem_in_flight gauge\nidem_in_flight %lld\n"
                  "# HELP idem_waiting_duplicates Duplicates parked on a running first call.\n"
                  "# TYPE idem_waiting_duplicates gauge\nidem_waiting_duplicates %lld\n"
                  "# HELP idem_store_announcements_total Completions announced by other "
                  "processes sharing the store (PostgreSQL NOTIFY), heard.\n"
                  "# TYPE idem_store_announcements_total counter\n"
                  "idem_store_announcements_total %llu\n"
                  "# HELP idem_redrives_total What the re-driver did with abandoned calls: "
                  "ran the handler again, re-ran one that did not execute (replayed, "
                  "refused), removed a completed call's journal, gave up.\n"
                  "# TYPE idem_redrives_total counter\n"
                  "idem_redrives_total{result=\"run\"} %llu\n"
                  "idem_redrives_total{result=\"not_run\"} %llu\n"
                  "idem_redrives_total{result=\"journal_removed\"} %llu\n"
                  "idem_redrives_total{result=\"gave_up\"} %llu\n"
                  "# HELP idem_call_latency_microseconds Server-side call latency.\n"
                  "# TYPE idem_call_latency_microseconds summary\n"
                  "idem_call_latency_microseconds_sum %llu\n"
                  "idem_call_latency_microseconds_count %llu\n",
                  (long long)atomic_load_explicit(&obs->in_flight, memory_order_relaxed),
                  (long long)atomic_load_explicit(&obs->waiting, memory_order_relaxed),
                  LOAD(obs->announcements), LOAD(obs->redrives[0]), LOAD(obs->redrives[1]),
                  LOAD(obs->redrives[2]), LOAD(obs->redrives[3]), LOAD(obs->latency_us_sum),
                  LOAD(obs->calls));
}

/* The leases' events, and the store's size and outbox as the sweeper last read them
 * (none before its first read: a dashboard shows no data rather than a false 0). */
static bool metrics_store(char **b, size_t *len, size_t *cap, idem_observer *obs)
{
    bool ok = append(b, len, cap,
                     "# HELP idem_lease_lapses_total Running calls whose lease ran out before a "
                     "renewal reached the store (another claimer may take the key).\n"
                     "# TYPE idem_lease_lapses_total counter\nidem_lease_lapses_total %llu\n"
                     "# HELP idem_lease_takeovers_total Claims that took over a key whose "
                     "owner's lease had run out (the owner died or stalled).\n"
                     "# TYPE idem_lease_takeovers_total counter\nidem_lease_takeovers_total %llu\n"
                     "# HELP idem_store_read_failures_total Sweeper reads of the store's size "
                     "and outbox that failed.\n# TYPE idem_store_read_failures_total counter\n"
                     "idem_store_read_failures_total %llu\n",
                     LOAD(obs->leases[IDEM__LEASE_LAPSED]),
                     LOAD(obs->leases[IDEM__LEASE_TAKEN_OVER]), LOAD(obs->store_read_failures));
    if (!ok || LOAD(obs->store_reads) == 0) {
        return ok;
    }
    return append(b, len, cap,
                  "# HELP idem_store_records Records by state, at the last sweep.\n"
                  "# TYPE idem_store_records gauge\n"
                  "idem_store_records{state=\"in_progress\"} %llu\n"
                  "idem_store_records{state=\"completed\"} %llu\n"
                  "# HELP idem_store_tombstones Tombstones kept (keys whose result expired, "
                  "remembered for the tombstone horizon), at the last sweep.\n"
                  "# TYPE idem_store_tombstones gauge\nidem_store_tombstones %llu\n"
                  "# HELP idem_store_size_bytes The store's map size (LMDB; 0: unbounded).\n"
                  "# TYPE idem_store_size_bytes gauge\nidem_store_size_bytes %llu\n"
                  "# HELP idem_store_used_bytes The map's bytes in use (LMDB).\n"
                  "# TYPE idem_store_used_bytes gauge\nidem_store_used_bytes %llu\n"
                  "# HELP idem_outbox_pending Outbox messages not relayed yet.\n"
                  "# TYPE idem_outbox_pending gauge\nidem_outbox_pending %llu\n"
                  "# HELP idem_outbox_oldest_age_seconds How long the oldest outbox message "
                  "has been the oldest, as the sweeps saw it (0: empty).\n"
                  "# TYPE idem_outbox_oldest_age_seconds gauge\n"
                  "idem_outbox_oldest_age_seconds %.3f\n",
                  LOAD(obs->in_progress), LOAD(obs->completed), LOAD(obs->tombstones),
                  LOAD(obs->map_size), LOAD(obs->map_used), LOAD(obs->outbox_pending),
                  (double)LOAD(obs->outbox_age_ms) / 1000.0);
}

char *idem__metrics_text(idem_observer *obs)
{
    size_t len = 0, cap = 4096;
    char *b = malloc(cap);
    char *more = idem__metric_sources_text(obs->sources);
    bool ok = b != NULL && more != NULL && metrics_calls(&b, &len, &cap, obs) &&
              metrics_gauges(&b, &len, &cap, obs) && metrics_store(&b, &len, &cap, obs) &&
              append(&b, &len, &cap, "%s", more);
    free(more);
    if (!ok) {
        free(b);
        return NULL;
    }
    return b;
}

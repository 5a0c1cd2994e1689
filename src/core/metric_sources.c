/* The metrics other parts of a program add to GET /metrics (server.h,
 * idem_server_add_metrics): a server's sources, and their samples as Prometheus text.
 * The mutex is held while a source runs, so that a removal waits for the scrape that
 * may be calling it: after idem__metric_sources_remove, nothing calls it again. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"

typedef struct source {
    idem_metrics_fn fn;
    void *arg;
    void (*drop)(void *arg);
    unsigned id; /* 0: a free slot */
} source;

struct idem__metric_sources {
    pthread_mutex_t mu;
    source s[IDEM_MAX_METRICS_SOURCES];
    unsigned next_id;
};

idem__metric_sources *idem__metric_sources_create(void)
{
    idem__metric_sources *ms = calloc(1, sizeof(*ms));
    if (ms != NULL && pthread_mutex_init(&ms->mu, NULL) != 0) {
        free(ms);
        return NULL;
    }
    return ms;
}

void idem__metric_sources_destroy(idem__metric_sources *ms)
{
    for (size_t i = 0; ms != NULL && i < IDEM_MAX_METRICS_SOURCES; i++) {
        if (ms->s[i].id != 0 && ms->s[i].drop != NULL) {
            ms->s[i].drop(ms->s[i].arg);
        }
    }
    if (ms != NULL) {
        pthread_mutex_destroy(&ms->mu);
        free(ms);
    }
}

idem_code idem__metric_sources_add(idem__metric_sources *ms, idem_metrics_fn fn, void *arg,
                                   void (*drop)(void *arg), unsigned *id)
{
    size_t i = 0;
    pthread_mutex_lock(&ms->mu);
    while (i < IDEM_MAX_METRICS_SOURCES && ms->s[i].id != 0) {
        i++;
    }
    if (i < IDEM_MAX_METRICS_SOURCES) {
        ms->next_id = ms->next_id + 1 ? ms->next_id + 1 : 1; /* never 0: a free slot's */
        ms->s[i] = (source){fn, arg, drop, ms->next_id};
        if (id != NULL) {
            *id = ms->next_id;
        }
    }
    pthread_mutex_unlock(&ms->mu);
    return i < IDEM_MAX_METRICS_SOURCES
               ? IDEM_OK
               : idem__err(IDEM_RESOURCE_EXHAUSTED, "at most %d metrics sources per server",
                           IDEM_MAX_METRICS_SOURCES);
}

void idem__metric_sources_remove(idem__metric_sources *ms, unsigned id)
{
    source gone = {0};
    pthread_mutex_lock(&ms->mu);
    for (size_t i = 0; id != 0 && i < IDEM_MAX_METRICS_SOURCES; i++) {
        if (ms->s[i].id == id) {
            gone = ms->s[i];
            memset(&ms->s[i], 0, sizeof(ms->s[i]));
        }
    }
    pthread_mutex_unlock(&ms->mu);
    if (gone.drop != NULL) {
        gone.drop(gone.arg);
    }
}

static bool name_ok(const char *s, bool colon)
{
    if (s == NULL || !((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || *s == '_' ||
                       (colon && *s == ':'))) {
        return false;
    }
    for (s++; *s; s++) {
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '_' || (colon && *s == ':'))) {
            return false;
        }
    }
    return true;
}

/* Text with Prometheus's escapes: \\ and \n always, \" too in a label value. */
static void put_escaped(FILE *f, const char *s, bool quote)
{
    for (; s != NULL && *s; s++) {
        if (*s == '\\' || (quote && *s == '"')) {
            fputc('\\', f);
            fputc(*s, f);
        } else if (*s == '\n') {
            fputs("\\n", f);
        } else {
            fputc(*s, f);
        }
    }
}

static void put_sample(FILE *f, const idem_metric *m)
{
    fputs(m->name, f);
    if (m->label != NULL) {
        fprintf(f, "{%s=\"", m->label);
        put_escaped(f, m->label_value, true);
        fputs("\"}", f);
    }
    fprintf(f, " %.17g\n", m->value);
}

/* Each name once under its HELP and TYPE, with every sample of that name. */
static void put_samples(FILE *f, const idem_metric *m, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++) {
            seen = strcmp(m[j].name, m[i].name) == 0;
        }
        if (seen) {
            continue;
        }
        fprintf(f, "# HELP %s ", m[i].name);
        put_escaped(f, m[i].help, false);
        fprintf(f, "\n# TYPE %s %s\n", m[i].name, m[i].counter ? "counter" : "gauge");
        for (size_t j = i; j < n; j++) {
            if (strcmp(m[j].name, m[i].name) == 0) {
                put_sample(f, &m[j]);
            }
        }
    }
}

/* The valid samples of every source, in m; how many. */
static size_t collect(idem__metric_sources *ms, idem_metric *m)
{
    size_t n = 0;
    for (size_t i = 0; i < IDEM_MAX_METRICS_SOURCES; i++) {
        if (ms->s[i].id == 0) {
            continue;
        }
        size_t base = n, got = ms->s[i].fn(ms->s[i].arg, m + base, IDEM_MAX_METRICS_SAMPLES);
        for (size_t k = 0; k < got && k < IDEM_MAX_METRICS_SAMPLES; k++) {
            const idem_metric *x = &m[base + k];
            if (name_ok(x->name, true) && (x->label == NULL || name_ok(x->label, false))) {
                m[n++] = *x; /* n <= base + k: a copy onto itself or backwards */
            }
        }
    }
    return n;
}

char *idem__metric_sources_text(idem__metric_sources *ms)
{
    idem_metric *m = malloc(sizeof(*m) * IDEM_MAX_METRICS_SOURCES * IDEM_MAX_METRICS_SAMPLES);
    char *text = NULL;
    size_t len = 0;
    FILE *f = m != NULL ? open_memstream(&text, &len) : NULL;
    if (f != NULL) {
        pthread_mutex_lock(&ms->mu);
        put_samples(f, m, collect(ms, m));
        pthread_mutex_unlock(&ms->mu);
        if (fclose(f) != 0) {
            free(text);
            text = NULL;
        }
    }
    free(m);
    return text;
}

/* Responses being built for the HTTP front's connections (see http_conn.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"
#include "json.h"

void idem__hres_append(idem_hres *res, const void *p, size_t n)
{
    if (res->oom || res->len + n + 1 > res->cap) {
        size_t cap = res->cap ? res->cap : 512;
        while (cap < res->len + n + 1) {
            cap *= 2;
        }
        char *b = res->oom ? NULL : realloc(res->buf, cap);
        if (b == NULL) {
            res->oom = true;
            return;
        }
        res->buf = b;
        res->cap = cap;
    }
    memcpy(res->buf + res->len, p, n);
    res->len += n;
}

void idem__hres_room(idem_hres *res, size_t n)
{
    if (res->oom || res->len + n + 1 <= res->cap) {
        return;
    }
    char *b = realloc(res->buf, res->len + n + 1);
    if (b == NULL) {
        res->oom = true;
        return;
    }
    res->buf = b;
    res->cap = res->len + n + 1;
}

void idem__hres_oom(idem_hres *res)
{
    static const char oom[] = "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                              "Connection: close\r\n\r\n";
    free(res->buf);
    res->buf = strdup(oom);
    res->len = res->buf != NULL ? sizeof(oom) - 1 : 0;
    res->cap = res->buf != NULL ? sizeof(oom) : 0;
}

void idem__hres_start(idem_hres *res, int status, const char *reason)
{
    char line[128];
    memset(res, 0, sizeof(*res));
    int n = snprintf(line, sizeof(line), "HTTP/1.1 %d %s\r\n", status, reason);
    idem__hres_append(res, line, (size_t)n);
}

void idem__hres_header(idem_hres *res, const char *name, const char *value)
{
    idem__hres_append(res, name, strlen(name));
    idem__hres_append(res, ": ", 2);
    idem__hres_append(res, value, strlen(value));
    idem__hres_append(res, "\r\n", 2);
}

size_t idem__hres_refusal(idem_hres *res, int status, const char *msg, char *json, size_t cap)
{
    static const struct {
        int status;
        const char *reason, *code;
    } kinds[] = {
        {400, "Bad Request", "INVALID_ARGUMENT"},
        {408, "Request Timeout", "DEADLINE_EXCEEDED"},
        {413, "Content Too Large", "RESOURCE_EXHAUSTED"},
        {414, "URI Too Long", "INVALID_ARGUMENT"},
        {417, "Expectation Failed", "INVALID_ARGUMENT"},
        {503, "Service Unavailable", "UNAVAILABLE"},
        {504, "Gateway Timeout", "DEADLINE_EXCEEDED"},
        {505, "HTTP Version Not Supported", "UNIMPLEMENTED"},
        {507, "Insufficient Storage", "RESOURCE_EXHAUSTED"},
    };
    size_t k = 0;
    while (k + 1 < sizeof(kinds) / sizeof(kinds[0]) && kinds[k].status != status) {
        k++;
    }
    k = kinds[k].status == status ? k : 0;
    char m[320];
    if (!idem__json_string(m, sizeof(m), msg)) {
        strcpy(m, "\"\"");
    }
    int n = snprintf(json, cap, "{\"code\":\"%s\",\"message\":%s}", kinds[k].code, m);
    idem__hres_start(res, kinds[k].status, kinds[k].reason);
    idem__hres_header(res, "Content-Type", "application/json");
    if (status == 503) {
        idem__hres_header(res, "Retry-After", "1");
    }
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
}

int idem__hres_unheld(size_t size, size_t max_buffered, char *msg, size_t cap)
{
    bool never = size - IDEM_HBUF_INITIAL > max_buffered;
    snprintf(msg, cap,
             "the call completed, but its answer (%zu bytes) %s http_max_buffered; retry "
             "with the same idempotency key to read it%s",
             size, never ? "is larger than the server's" : "does not fit now in the server's",
             never ? " over nng, or raise http_max_buffered" : " (Retry-After)");
    return never ? 507 : 503;
}

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

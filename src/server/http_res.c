/* Responses being built for the HTTP front's connections (see http_conn.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_conn.h"

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

/* Shared test helpers over raw sockets (testutil.h): TCP connections to 127.0.0.1, HTTP
 * exchanges a test controls to the byte, and TLS material made for a run. */
#include "testutil.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

/* ---- HTTP ---- */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <strings.h>
#include <sys/socket.h>

int tu_dial(int port, int bound_s)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {bound_s, 0}; /* a bound, not synchronisation: a hung server fails */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "connect port %d", port);
    return fd;
}

void tu_send_all(int fd, const void *p, size_t len)
{
    for (size_t off = 0; off < len;) {
        ssize_t n = send(fd, (const char *)p + off, len - off, MSG_NOSIGNAL);
        if (n <= 0) {
            return; /* the server may answer (413) and close before reading everything */
        }
        off += (size_t)n;
    }
}

static void http_exchange(tu_http *out, int port, const char *request, size_t len)
{
    memset(out, 0, sizeof(*out));
    int fd = tu_dial(port, 10);
    tu_send_all(fd, request, len);
    size_t cap = 1 << 16, used = 0;
    char *buf = malloc(cap);
    cr_assert_not_null(buf);
    for (;;) {
        if (used + 1 >= cap) {
            cap *= 2;
            cr_assert_not_null(buf = realloc(buf, cap));
        }
        ssize_t n = recv(fd, buf + used, cap - used - 1, 0);
        if (n <= 0) {
            break;
        }
        used += (size_t)n;
        buf[used] = '\0';
        char *end = strstr(buf, "\r\n\r\n");
        const char *cl = end != NULL ? strcasestr(buf, "\r\nContent-Length:") : NULL;
        if (end != NULL && cl != NULL && cl < end &&
            used >= (size_t)(end + 4 - buf) + strtoul(cl + 17, NULL, 10)) {
            break;
        }
    }
    close(fd);
    buf[used] = '\0';
    char *end = strstr(buf, "\r\n\r\n");
    if (end == NULL || sscanf(buf, "HTTP/1.%*d %d", &out->status) != 1) {
        free(buf);
        return;
    }
    *end = '\0';
    out->head = buf;
    out->body_len = used - (size_t)(end + 4 - buf);
    out->body = malloc(out->body_len + 1);
    cr_assert_not_null(out->body);
    memcpy(out->body, end + 4, out->body_len);
    out->body[out->body_len] = '\0';
}

void tu_http_post(tu_http *out, int port, const char *path, const char *const *headers,
                  size_t n_headers, const void *body, size_t len)
{
    size_t hlen = 256 + strlen(path);
    for (size_t i = 0; i < n_headers; i++) {
        hlen += strlen(headers[i]) + 2;
    }
    char *req = malloc(hlen + len);
    cr_assert_not_null(req);
    int n =
        snprintf(req, hlen, "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n", path);
    for (size_t i = 0; i < n_headers; i++) {
        n += snprintf(req + n, hlen - (size_t)n, "%s\r\n", headers[i]);
    }
    n += snprintf(req + n, hlen - (size_t)n, "Content-Length: %zu\r\n\r\n", len);
    memcpy(req + n, body, len);
    http_exchange(out, port, req, (size_t)n + len);
    free(req);
}

void tu_http_get(tu_http *out, int port, const char *path)
{
    char req[512];
    int n = snprintf(req, sizeof(req),
                     "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", path);
    http_exchange(out, port, req, (size_t)n);
}

const char *tu_http_header(const tu_http *r, const char *name, char *buf, size_t cap)
{
    size_t nl = strlen(name);
    for (const char *line = r->head ? strstr(r->head, "\r\n") : NULL; line != NULL;
         line = strstr(line + 2, "\r\n")) {
        const char *p = line + 2;
        if (strncasecmp(p, name, nl) == 0 && p[nl] == ':') {
            p += nl + 1;
            while (*p == ' ') {
                p++;
            }
            size_t vl = strcspn(p, "\r");
            snprintf(buf, cap, "%.*s", (int)vl, p);
            return buf;
        }
    }
    return NULL;
}

void tu_http_free(tu_http *r)
{
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof(*r));
}

/* ---- TLS material ---- */

#define KEYGEN "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "

char *tu_make_certs(const char *tag)
{
    char cmd[4096];
    char *dir = tu_tempdir(tag);
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && (" KEYGEN
             "-x509 -days 2 -keyout sca.key -out sca.crt -subj /CN=sca && " KEYGEN
             "-x509 -days 2 -keyout cca.key -out cca.crt -subj /CN=cca && " KEYGEN
             "-keyout server.key -out server.csr -subj /CN=localhost && "
             "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext && "
             "openssl x509 -req -days 2 -in server.csr -CA sca.crt -CAkey sca.key "
             "-CAcreateserial -extfile san.ext -out server.crt && "
             "cat server.crt server.key > server.pem && " KEYGEN
             "-keyout client.key -out client.csr -subj /CN=client-a && "
             "openssl x509 -req -days 2 -in client.csr -CA cca.crt -CAkey cca.key "
             "-CAcreateserial -out client.crt) >/dev/null 2>&1",
             dir);
    cr_assert_eq(system(cmd), 0, "openssl: %s", cmd);
    return dir;
}

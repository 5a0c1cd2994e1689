/* The hung host (hung_host.h): a listening socket that nobody reads. Connections wait in
 * the kernel's backlog; hung_host_connections takes them out and holds them, open and
 * silent, until hung_host_stop. No thread: nothing ever answers. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "hung_host.h"

#define HELD_MAX 1024

struct hung_host {
    int lfd, port, n;
    int held[HELD_MAX];
};

hung_host *hung_host_start(void)
{
    hung_host *h = calloc(1, sizeof(*h));
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t alen = sizeof(a);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (h == NULL || (h->lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0)) < 0) {
        free(h);
        return NULL;
    }
    if (bind(h->lfd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(h->lfd, 128) != 0 ||
        getsockname(h->lfd, (struct sockaddr *)&a, &alen) != 0) {
        close(h->lfd);
        free(h);
        return NULL;
    }
    h->port = ntohs(a.sin_port);
    return h;
}

int hung_host_port(const hung_host *h)
{
    return h->port;
}

int hung_host_connections(hung_host *h)
{
    int fd;
    while ((fd = accept4(h->lfd, NULL, NULL, SOCK_CLOEXEC)) >= 0 || errno == EINTR) {
        if (fd < 0) {
            continue;
        }
        if (h->n < HELD_MAX) {
            h->held[h->n] = fd;
        } else {
            close(fd); /* counted; a test never makes this many */
        }
        h->n++;
    }
    return h->n;
}

void hung_host_stop(hung_host *h)
{
    for (int i = 0; i < h->n && i < HELD_MAX; i++) {
        close(h->held[i]);
    }
    close(h->lfd);
    free(h);
}

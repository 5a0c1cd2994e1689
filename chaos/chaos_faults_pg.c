/* The pg topology's network faults (chaos_faults.h). Each server reaches PostgreSQL
 * through a conninfo of two hosts, as docs/ha.md recommends for a cluster:
 *   host=127.0.0.1,127.0.0.1 port=HUNG,PROXY_i
 * HUNG is the run's hung host: a loopback port bound and not listening, so that a
 * connection to it is refused at once and libpq goes on to the second host, PROXY_i,
 * server i's fault proxy (tests/pgproxy.c) to the real database. Faults:
 *   partition  server i's proxy is cut (no FIN or RST) for 1-3 leases;
 *   slow_db    every chunk through server i's proxy is delayed 20-80 ms for 2-4 leases;
 *   hung_host  HUNG listens and never accepts (the kernel completes the handshake, then
 *              nothing answers: a stopped or partitioned ex-leader) while PostgreSQL
 *              restarts and for 4-8 leases after, so every connection of both servers
 *              is made again while the first host listed hangs. Only the restart itself is a
 *              window without writes (the checker's "pg_restarted" mark); the hung host
 *              excuses nothing: a connection must be bounded by the lease, not by
 *              connect_timeout per host. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "chaos_faults.h"
#include "pgproxy.h"

static pgproxy *proxies[CHAOS_SERVERS];
static struct {
    int fd, port; /* fd: bound; listening only during a hung_host fault */
} hung = {-1, 0};

/* Binds 127.0.0.1:port (0: any free one) without listening; the bound port in *port. */
static int hung_bind(int *port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)*port)};
    socklen_t len = sizeof(a);
    int one = 1, fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        perror("idemrpc-chaos: the hung host's port");
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    *port = ntohs(a.sin_port);
    return fd;
}

bool chaos_pg_route(const chaos_cfg *cfg, size_t i, char *via, size_t cap)
{
    if (hung.fd < 0 && (hung.fd = hung_bind(&hung.port)) < 0) {
        return false;
    }
    if ((proxies[i] = pgproxy_start(cfg->pg)) == NULL) {
        return false;
    }
    /* later keywords win in a conninfo */
    int n = snprintf(via, cap, "%s host=127.0.0.1,127.0.0.1 port=%d,%d", cfg->pg, hung.port,
                     pgproxy_port(proxies[i]));
    return n > 0 && (size_t)n < cap;
}

void chaos_pg_network(uint64_t *rng, const chaos_cfg *cfg, size_t i, pid_t pid, bool cut)
{
    uint64_t lease = cfg->lease_ms;
    const char *kind = cut ? "partition" : "slow_db";
    chaos_server_event("fault", kind, i, pid);
    if (cut) {
        pgproxy_cut(proxies[i], true);
        chaos_sleep_ms(chaos_between(rng, lease, 3 * lease));
        pgproxy_cut(proxies[i], false);
    } else {
        pgproxy_delay(proxies[i], (unsigned)chaos_between(rng, 20, 80));
        chaos_sleep_ms(chaos_between(rng, 2 * lease, 4 * lease));
        pgproxy_delay(proxies[i], 0);
    }
    chaos_server_event("fault_end", kind, i, pid);
}

bool chaos_pg_hung_host(uint64_t *rng, const chaos_cfg *cfg)
{
    const char *f[] = {"kind", "hung_host"};
    if (hung.fd < 0 || listen(hung.fd, 128) != 0) {
        perror("idemrpc-chaos: hung_host: listen");
        return false;
    }
    chaos_history_event("fault", 1, f);
    chaos_services(cfg, "restart-pg");
    chaos_history_event("pg_restarted", 1, f);
    chaos_sleep_ms(chaos_between(rng, 4 * cfg->lease_ms, 8 * cfg->lease_ms));
    /* Closing resets the handshakes it never accepted; the port is bound again at once
     * (refusing, as before the fault). */
    close(hung.fd);
    hung.fd = hung_bind(&hung.port);
    chaos_history_event("fault_end", 1, f);
    return true;
}

void chaos_pg_stop(void)
{
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        if (proxies[i] != NULL) {
            pgproxy_stop(proxies[i]);
            proxies[i] = NULL;
        }
    }
    if (hung.fd >= 0) {
        close(hung.fd);
        hung.fd = -1;
    }
}

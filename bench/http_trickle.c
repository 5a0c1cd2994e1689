/* idemrpc-http-trickle: the CPU time the HTTP front spends on a request head that
 * arrives a byte at a time, against the same head sent at once (docs/performance.md,
 * "HTTP heads"). A server runs in a child process (LMDB store in a temporary directory,
 * the HTTP front on 127.0.0.1); the parent sends GET heads of --head-kib KiB (answered
 * 405 by the front itself, so only the framing is measured) and reads the child's CPU
 * clock around each batch. A measurement, not a test: the byte-at-a-time pace is a
 * sleep, and the number of receives the server makes depends on the scheduler.
 *   idemrpc-http-trickle [--head-kib 32] [--whole 50] [--trickled 2] [--pace-us 20] */
#include <arpa/inet.h>
#include <dirent.h>
#include <idemrpc/idemrpc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

static void die(const char *what)
{
    perror(what);
    exit(1);
}

static void rm_dir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[512];
    while (d != NULL && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
            snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
            unlink(path);
        }
    }
    if (d != NULL) {
        closedir(d);
    }
    rmdir(dir);
}

/* The child: serves HTTP until the parent closes the pipe; writes its port first. */
static void serve(int up, int down)
{
    char dir[] = "/tmp/idemrpc-trickle-XXXXXX";
    idem_server *srv;
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.http_request_timeout_ms = 600 * 1000; /* a trickled head takes seconds */
    if (mkdtemp(dir) == NULL) {
        die("mkdtemp");
    }
    o.db_path = dir;
    if (idem_server_create(&srv, &o) != IDEM_OK ||
        idem_server_listen_http(srv, "http://127.0.0.1:0") != IDEM_OK) {
        fprintf(stderr, "server: %s\n", idem_errmsg());
        exit(1);
    }
    int port = idem_server_http_port(srv);
    char c;
    if (write(up, &port, sizeof(port)) != sizeof(port)) {
        die("write");
    }
    while (read(down, &c, 1) > 0) {
    }
    idem_server_destroy(srv);
    rm_dir(dir);
    exit(0);
}

static double cpu_ms(clockid_t clk)
{
    struct timespec ts;
    if (clock_gettime(clk, &ts) != 0) {
        die("clock_gettime (the server's CPU clock)");
    }
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* One head on a connection of its own, at once (pace_us < 0) or a byte at a time; reads
 * the answer to its end. */
static void one_head(int port, const char *head, size_t len, long pace_us)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0 ||
        connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        die("connect");
    }
    struct timespec pace = {0, pace_us * 1000};
    for (size_t off = 0; off < len;) {
        size_t n = pace_us < 0 ? len - off : 1;
        ssize_t sent = send(fd, head + off, n, MSG_NOSIGNAL);
        if (sent <= 0) {
            die("send");
        }
        off += (size_t)sent;
        if (pace_us > 0) {
            nanosleep(&pace, NULL);
        }
    }
    char buf[4096];
    ssize_t got = 0, n;
    while ((n = recv(fd, buf + got, sizeof(buf) - 1 - (size_t)got, 0)) > 0) {
        got += n;
    }
    buf[got] = '\0';
    if (strncmp(buf, "HTTP/1.1 405 ", 13) != 0) {
        fprintf(stderr, "unexpected answer: %.80s\n", buf);
        exit(1);
    }
    close(fd);
}

/* Server CPU ms per head over n heads. */
static double per_head(clockid_t clk, int port, const char *head, size_t len, long pace, int n)
{
    double before = cpu_ms(clk);
    for (int i = 0; i < n; i++) {
        one_head(port, head, len, pace);
    }
    return (cpu_ms(clk) - before) / n;
}

static void usage(FILE *to)
{
    fputs("usage: idemrpc-http-trickle [--head-kib N (4..32, default 32)] [--whole N (50)]\n"
          "                            [--trickled N (2)] [--pace-us N (20)]\n"
          "  The HTTP front's CPU time for a head sent at once and a byte at a time.\n",
          to);
}

/* The options into kib, whole, trickled, pace; false (status set) to exit. */
static bool parse_args(int argc, char **argv, uint64_t v[4], int *status)
{
    static const struct option opts[] = {
        {"head-kib", required_argument, NULL, 0}, {"whole", required_argument, NULL, 1},
        {"trickled", required_argument, NULL, 2}, {"pace-us", required_argument, NULL, 3},
        {"help", no_argument, NULL, 'h'},         {NULL, 0, NULL, 0}};
    static const uint64_t lo[4] = {4, 1, 1, 1}, hi[4] = {32, 100000, 1000, 1000000};
    int c;
    *status = CLI_USAGE_ERROR;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            *status = 0;
            return false;
        }
        if (c < 0 || c > 3 ||
            !cli_parse_u64("idemrpc-http-trickle", opts[c].name, optarg, lo[c], hi[c], &v[c])) {
            usage(stderr);
            return false;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "idemrpc-http-trickle: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return false;
    }
    return true;
}

int main(int argc, char **argv)
{
    uint64_t v[4] = {32, 50, 2, 20};
    int status;
    if (!parse_args(argc, argv, v, &status)) {
        return status;
    }
    long kib = (long)v[0], whole = (long)v[1], trickled = (long)v[2], pace = (long)v[3];
    size_t len = (size_t)kib * 1024;
    char *head = malloc(len + 1);
    if (head == NULL) {
        die("malloc");
    }
    int n = snprintf(head, len, "GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    size_t line = (len - (size_t)n - 2) / 60 + 1; /* 60 header lines fill the rest */
    for (int i = 0; (size_t)n + 2 < len; i++) {
        size_t l = line < len - (size_t)n - 2 ? line : len - (size_t)n - 2;
        int h = snprintf(head + n, len + 1 - (size_t)n, "X-%d:", i);
        memset(head + n + h, 'a', l - (size_t)h - 2);
        memcpy(head + n + l - 2, "\r\n", 2);
        n += (int)l;
    }
    memcpy(head + n, "\r\n", 2);
    int up[2], down[2], port;
    if (pipe(up) != 0 || pipe(down) != 0) {
        die("pipe");
    }
    pid_t pid = fork(); /* no thread yet: the child may run the server */
    if (pid == 0) {
        close(up[0]), close(down[1]);
        serve(up[1], down[0]);
    }
    close(up[1]), close(down[0]);
    clockid_t clk;
    if (pid < 0 || read(up[0], &port, sizeof(port)) != sizeof(port) ||
        clock_getcpuclockid(pid, &clk) != 0) {
        die("the server process");
    }
    double at_once = per_head(clk, port, head, len, -1, (int)whole);
    double bytewise = per_head(clk, port, head, len, pace, (int)trickled);
    printf("head %ld KiB: server CPU per head %.3f ms sent at once, %.3f ms a byte at a time "
           "(%ld us apart): ratio %.1f\n",
           kib, at_once, bytewise, pace, bytewise / at_once);
    close(down[1]);
    waitpid(pid, NULL, 0);
    free(head);
    return 0;
}

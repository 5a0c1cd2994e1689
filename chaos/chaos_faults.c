/* The two server processes and the faults done to them, on a schedule drawn from the
 * seed: SIGKILL then restart, SIGSTOP for 1.5-3 leases then SIGCONT; on the lmdb
 * topology a full store (the store agent fills the map, holds it full for 1-4 leases,
 * then frees CHAOS_HEADROOM_BYTES); on the pg topology a PostgreSQL restart, Redis
 * stopped for 0.5-2 s, a partition (server i's connections to the database go silent,
 * no FIN or RST, for 1-3 leases) and a slow database (every chunk between server i and
 * the database delayed 20-80 ms for 2-4 leases) and a hung first host in the conninfo
 * while PostgreSQL restarts: chaos_faults_pg.c. One fault at a time, each ended
 * before the next; a server that dies without being killed is a "crash" event (the checker counts
 * it as a violation). Only the fault thread touches the table while the run goes on;
 * chaos_faults_heal and chaos_servers_stop come after it.
 *
 * lmdb: the store agent's ballast and the fill fault are chaos_faults_fill.c; both
 * topologies: slow HTTP clients (chaos_faults_http.c) and, in a build with the gRPC
 * front, slow gRPC clients (chaos_faults_grpc.c). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chaos_faults.h"

typedef struct server {
    pid_t pid; /* 0 = not running */
    bool stopped;
    char url[600], http[64], grpc[64]; /* its nng, HTTP, gRPC fronts (a restart keeps them) */
} server;

static server servers[CHAOS_SERVERS];
#ifdef CHAOS_HAVE_PG
static char pg_via[CHAOS_SERVERS][1200]; /* pg: each server's conninfo (chaos_pg_route) */
#endif
static char self_exe[PATH_MAX];
static const chaos_cfg *run_cfg;

const char *chaos_server_url(size_t i)
{
    return servers[i].url;
}

pid_t chaos_server_pid(size_t i)
{
    return servers[i].pid;
}

const char *chaos_server_http(size_t i)
{
    return servers[i].http;
}

const char *chaos_server_grpc(size_t i)
{
    return servers[i].grpc;
}

const char *chaos_self_exe(void)
{
    return self_exe;
}

size_t chaos_server_of(pid_t pid)
{
    size_t i = 0;
    while (i < CHAOS_SERVERS && (pid <= 0 || servers[i].pid != pid)) {
        i++;
    }
    return i;
}

void chaos_server_event(const char *ev, const char *kind, size_t i, pid_t pid)
{
    char idx[16], p[16];
    snprintf(idx, sizeof(idx), "%zu", i);
    snprintf(p, sizeof(p), "%d", (int)pid);
    const char *f[] = {"kind", kind, "server", idx, "pid", p};
    chaos_history_event(ev, 3, f);
}

void chaos_exec(const char *const *argv, int out_fd, int err_fd)
{
    dup2(out_fd, STDOUT_FILENO);
    if (err_fd >= 0) {
        dup2(err_fd, STDERR_FILENO);
    }
    execv(argv[0], (char *const *)argv);
    _exit(127);
}

/* Starts server i and waits (≤ 20 s) for its "ready" line. */
static bool server_start(size_t i)
{
    const chaos_cfg *cfg = run_cfg;
    char log[700], lease[24], store[600], map[24], redrive[24];
    int fds[2];
    snprintf(log, sizeof(log), "%s/server-%zu.log", cfg->dir, i);
    snprintf(lease, sizeof(lease), "%" PRIu64, cfg->lease_ms);
    snprintf(store, sizeof(store), "%s/store", cfg->dir);
    snprintf(map, sizeof(map), "%" PRIu64, cfg->map_mib << 20);
    snprintf(redrive, sizeof(redrive), "%" PRIu64, cfg->redrive_ms);
#ifdef CHAOS_HAVE_GRPC
    const char *grpc_flag = "--grpc";
#else
    const char *grpc_flag = NULL; /* argv ends there: a build without the gRPC front */
#endif
    const char *lmdb[] = {
        self_exe,     "--serve",    "--listen",     servers[i].url, "--http",  servers[i].http,
        "--effects",  cfg->effects, "--lease-ms",   lease,          "--db",    store,
        "--map-size", map,          "--redrive-ms", redrive,        grpc_flag, servers[i].grpc,
        NULL};
    const char *via = cfg->pg;
#ifdef CHAOS_HAVE_PG
    via = cfg->topology == CHAOS_PG ? pg_via[i] : cfg->pg;
#endif
    const char *pg[] = {
        self_exe,    "--serve",    "--listen",     servers[i].url, "--http",  servers[i].http,
        "--effects", cfg->effects, "--lease-ms",   lease,          "--pg",    via,
        "--redis",   cfg->redis,   "--redrive-ms", redrive,        grpc_flag, servers[i].grpc,
        NULL};
    int err = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (pipe(fds) != 0) {
        return false;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        chaos_exec(cfg->topology == CHAOS_LMDB ? lmdb : pg, fds[1], err);
    }
    if (err >= 0) {
        close(err);
    }
    close(fds[1]);
    char line[16] = {0};
    struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
    bool ready = pid > 0 && poll(&pfd, 1, 20000) == 1 && read(fds[0], line, 6) == 6 &&
                 strncmp(line, "ready\n", 6) == 0;
    close(fds[0]);
    if (pid <= 0) {
        return false;
    }
    servers[i].pid = pid;
    servers[i].stopped = false;
    chaos_server_event("start", ready ? "ready" : "not_ready", i, pid);
    return ready;
}

bool chaos_servers_start(const chaos_cfg *cfg)
{
    run_cfg = cfg;
    ssize_t n = readlink("/proc/self/exe", self_exe, sizeof(self_exe) - 1);
    if (n <= 0) {
        return false;
    }
    self_exe[n] = '\0';
    if (cfg->topology == CHAOS_LMDB && !chaos_agent_start(cfg)) {
        fprintf(stderr, "idemrpc-chaos: the store agent did not start (see %s/agent.log)\n",
                cfg->dir);
        return false;
    }
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        snprintf(servers[i].url, sizeof(servers[i].url), "ipc://%s/s%zu.ipc", cfg->dir, i);
        snprintf(servers[i].http, sizeof(servers[i].http), "http://127.0.0.1:%d",
                 chaos_free_port());
        snprintf(servers[i].grpc, sizeof(servers[i].grpc), "tcp://127.0.0.1:%d", chaos_free_port());
#ifdef CHAOS_HAVE_PG
        if (cfg->topology == CHAOS_PG && !chaos_pg_route(cfg, i, pg_via[i], sizeof(pg_via[i]))) {
            fprintf(stderr, "idemrpc-chaos: no way to the database for server %zu\n", i);
            return false;
        }
#endif
        if (!server_start(i)) {
            fprintf(stderr, "idemrpc-chaos: server %zu did not start (see %s/server-%zu.log)\n", i,
                    cfg->dir, i);
            return false;
        }
    }
    return true;
}

/* A server that exited without our SIGKILL: a crash. Restarts it. */
static void reap_crashed(void)
{
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        int st;
        if (servers[i].pid > 0 && waitpid(servers[i].pid, &st, WNOHANG) == servers[i].pid) {
            chaos_server_event("fault", "crash", i, servers[i].pid);
            servers[i].pid = 0;
            server_start(i);
        }
    }
}

/* VmRSS and RssAnon (kB) of pid; false when it is gone. */
static bool read_rss(pid_t pid, char *vm, char *anon, size_t cap)
{
    char path[64], line[128];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return false;
    }
    vm[0] = anon[0] = '\0';
    while (fgets(line, sizeof(line), f) != NULL) {
        char v[32];
        if (sscanf(line, "VmRSS: %31s", v) == 1) {
            snprintf(vm, cap, "%s", v);
        } else if (sscanf(line, "RssAnon: %31s", v) == 1) {
            snprintf(anon, cap, "%s", v);
        }
    }
    fclose(f);
    return vm[0] != '\0' && anon[0] != '\0';
}

void chaos_servers_sample_rss(void)
{
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        char vm[32], anon[32], idx[8], pid[16];
        if (servers[i].pid <= 0 || servers[i].stopped ||
            !read_rss(servers[i].pid, vm, anon, sizeof(vm))) {
            continue;
        }
        snprintf(idx, sizeof(idx), "%zu", i);
        snprintf(pid, sizeof(pid), "%d", (int)servers[i].pid);
        const char *fields[] = {"server", idx, "pid", pid, "kib", vm, "anon", anon};
        chaos_history_event("rss", 4, fields);
    }
}

/* The kill ends when the process is gone (reap_ms after SIGKILL: a thread in an
 * uninterruptible wait, such as an fsync, dies only when it returns). kind: "kill", or
 * the fault it is part of ("undo_crash"). */
void chaos_fault_kill(uint64_t *rng, size_t i, const char *kind)
{
    pid_t pid = servers[i].pid;
    chaos_server_event("fault", kind, i, pid);
    uint64_t t = chaos_now_ms();
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    char idx[16], p[16], reap[24];
    snprintf(idx, sizeof(idx), "%zu", i);
    snprintf(p, sizeof(p), "%d", (int)pid);
    snprintf(reap, sizeof(reap), "%" PRIu64, chaos_now_ms() - t);
    const char *f[] = {"kind", kind, "server", idx, "pid", p, "reap_ms", reap};
    chaos_history_event("fault_end", 4, f);
    servers[i].pid = 0;
    chaos_sleep_ms(chaos_between(rng, 100, 800));
    server_start(i);
}

static void fault_stop(uint64_t *rng, size_t i)
{
    uint64_t lease = run_cfg->lease_ms;
    chaos_server_event("fault", "stop", i, servers[i].pid);
    servers[i].stopped = true;
    kill(servers[i].pid, SIGSTOP);
    chaos_sleep_ms(chaos_between(rng, lease * 3 / 2, lease * 3));
    kill(servers[i].pid, SIGCONT);
    servers[i].stopped = false;
    chaos_server_event("fault_end", "stop", i, servers[i].pid);
}

void chaos_services(const chaos_cfg *cfg, const char *what)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s %s >/dev/null 2>&1", cfg->services, what);
    if (system(cmd) != 0) {
        fprintf(stderr, "idemrpc-chaos: '%s' failed\n", cmd);
    }
}

static void fault_service(uint64_t *rng, const char *kind)
{
    const char *f[] = {"kind", kind};
    chaos_history_event("fault", 1, f);
    if (strcmp(kind, "pg_restart") == 0) {
        chaos_services(run_cfg, "restart-pg");
    } else {
        chaos_services(run_cfg, "stop-redis");
        chaos_sleep_ms(chaos_between(rng, 500, 2000));
        chaos_services(run_cfg, "start-redis");
    }
    chaos_history_event("fault_end", 1, f);
}

/* Waits ms in 100 ms steps, sampling RSS every second and reaping crashes. */
static void fault_wait(uint64_t ms, const volatile bool *stop)
{
    static uint64_t last_sample;
    for (uint64_t end = chaos_now_ms() + ms; chaos_now_ms() < end && !*stop;) {
        chaos_sleep_ms(100);
        reap_crashed();
        if (chaos_now_ms() - last_sample >= 1000) {
            last_sample = chaos_now_ms();
            chaos_servers_sample_rss();
        }
    }
}

uint64_t chaos_faults_run(const chaos_cfg *cfg, const volatile bool *stop)
{
    uint64_t rng = cfg->seed * 0x9e3779b97f4a7c15ull + 1, faults = 0;
    fault_wait(1500, stop); /* let the workload start first */
    while (!*stop) {
        uint64_t pick = chaos_between(&rng, 0, 99);
        size_t i = (size_t)chaos_between(&rng, 0, CHAOS_SERVERS - 1);
        if (cfg->slow_http_pct > 0 && chaos_between(&rng, 1, 100) <= cfg->slow_http_pct) {
            pick = 6; /* slow_http; without the option no draw: a seed's schedule stays */
        }
        if (cfg->slow_grpc_pct > 0 && chaos_between(&rng, 1, 100) <= cfg->slow_grpc_pct) {
            pick = 9; /* slow_grpc, as above */
        }
        if (cfg->topology == CHAOS_PG && pick >= 85) {
            fault_service(&rng, "redis_stop");
        } else if (cfg->topology == CHAOS_PG && pick >= 77) {
            fault_service(&rng, "pg_restart");
#ifdef CHAOS_HAVE_PG
        } else if (cfg->topology == CHAOS_PG && pick >= 70) {
            if (!chaos_pg_hung_host(&rng, cfg)) {
                continue;
            }
        } else if (cfg->topology == CHAOS_PG && pick >= 50 && servers[i].pid > 0) {
            chaos_pg_network(&rng, cfg, i, servers[i].pid, pick >= 60);
#endif
        } else if (cfg->topology == CHAOS_LMDB && pick >= 75) {
            chaos_fault_fill(&rng, cfg);
#ifdef CHAOS_HAVE_GRPC
        } else if (pick >= 9 && pick < 12 && servers[i].pid > 0) {
            chaos_slow_grpc(&rng, i);
#endif
        } else if (pick >= 6 && pick < 12 && servers[i].pid > 0) {
            chaos_slow_http(&rng, i);
        } else if (pick < 6) {
            if (!chaos_undo_crash(&rng, cfg)) {
                continue; /* no compensation reached its undo meanwhile */
            }
        } else if (pick % 2 == 0 && servers[i].pid > 0) {
            chaos_fault_kill(&rng, i, "kill");
        } else if (servers[i].pid > 0) {
            fault_stop(&rng, i);
        } else {
            continue;
        }
        faults++;
        fault_wait(chaos_between(&rng, 1000, 3000), stop);
    }
    return faults;
}

void chaos_faults_heal(const chaos_cfg *cfg)
{
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        if (servers[i].pid > 0 && servers[i].stopped) {
            kill(servers[i].pid, SIGCONT);
            servers[i].stopped = false;
        }
    }
    reap_crashed();
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        if (servers[i].pid <= 0) {
            server_start(i);
        }
    }
    if (cfg->topology == CHAOS_LMDB) {
        chaos_agent_free_all();
    }
}

void chaos_servers_stop(void)
{
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        if (servers[i].pid > 0) {
            kill(servers[i].pid, SIGTERM);
        }
    }
    for (size_t i = 0; i < CHAOS_SERVERS; i++) {
        int st = 0;
        pid_t pid = servers[i].pid;
        uint64_t end = chaos_now_ms() + 10000;
        while (pid > 0 && waitpid(pid, &st, WNOHANG) == 0) {
            if (chaos_now_ms() > end) {
                kill(pid, SIGKILL); /* hung at shutdown: a crash too */
                waitpid(pid, &st, 0);
                break;
            }
            chaos_sleep_ms(50);
        }
        if (pid > 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
            chaos_server_event("fault", "crash", i, pid);
        } else if (pid > 0) {
            chaos_server_event("stop", "exit", i, pid);
        }
        servers[i].pid = 0;
    }
    chaos_agent_stop();
#ifdef CHAOS_HAVE_PG
    chaos_pg_stop();
#endif
}

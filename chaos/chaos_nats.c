/* The broker topology's processes and faults (chaos_nats_run.c runs the campaign):
 *
 *   broker        nats-server -js on 127.0.0.1, a free port, its store in DIR/nats
 *   producer-0/1  payments servers on one LMDB store (DIR/producer), each with its outbox
 *                 relay (chaos_nats_proc.c): killing one is the "relay kill"
 *   consumer-0/1  the commission service on one LMDB store (DIR/consumer), one durable
 *
 * Faults, one at a time every 1-3 s, drawn from the seed: SIGKILL of a consumer then a
 * restart 0.1-0.8 s later (consumer_kill); SIGSTOP of a consumer for 1.5-2.5 ack waits
 * (its deliveries go to the other one meanwhile) then SIGCONT (consumer_stop); SIGKILL of
 * a producer and its relay, restarted 0.1-0.8 s later (relay_kill); SIGKILL of the
 * broker (broker_kill) or SIGTERM (broker_term), started again 0.2-1.5 s later on the
 * same port and store dir, so JetStream's state survives; the power cut of the broker's
 * host (broker_amnesia): its store dir copied while it is stopped (SIGSTOP, cp -a,
 * SIGCONT), 0.5-2 s of load acked past that point, SIGKILL, the copy put back and the
 * broker started on it, so what it acked since the copy is gone. A process that exits without
 * being killed is a "crash" event (a violation). Every process is recorded in
 * children[] so that a SIGTERM or SIGINT of the campaign kills them all. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chaos.h"
#include "chaos_nats.h"

typedef struct proc {
    pid_t pid; /* 0: not running */
    bool stopped;
} proc;

static proc procs[NP_COUNT];
static const char *const names[NP_COUNT] = {"producer-0", "producer-1", "consumer-0", "consumer-1",
                                            "broker"};
static char self_exe[PATH_MAX], producer_urls[2][600], broker_url[64];
static int broker_port;
static const chaos_cfg *run_cfg;
static volatile pid_t children[NP_COUNT]; /* for the signal handler */

const char *chaos_nats_url(void)
{
    return broker_url;
}

const char *chaos_nats_producer_url(size_t i)
{
    return producer_urls[i];
}

static void on_signal(int sig)
{
    for (size_t i = 0; i < NP_COUNT; i++) {
        if (children[i] > 0) {
            kill(children[i], SIGKILL);
        }
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void proc_event(const char *ev, const char *kind, size_t i, pid_t pid)
{
    char p[16];
    snprintf(p, sizeof(p), "%d", (int)pid);
    const char *f[] = {"kind", kind, "proc", names[i], "pid", p};
    chaos_history_event(ev, 3, f);
}

/* A free loopback TCP port (the broker keeps it across restarts). */
/* True once the broker accepts a TCP connection. */
static bool broker_listens(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                            .sin_port = htons((uint16_t)broker_port)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    if (fd >= 0) {
        close(fd);
    }
    return ok;
}

/* The argument vector of process i (static storage). */
static const char *const *proc_argv(size_t i)
{
    static char db[NP_COUNT][600], port[24], store[600], lease[24], events[600];
    static const char *argv[NP_COUNT][16];
    const chaos_cfg *cfg = run_cfg;
    snprintf(lease, sizeof(lease), "%" PRIu64, cfg->lease_ms);
    snprintf(events, sizeof(events), "%s/events.log", cfg->dir);
    if (i == NP_BROKER) {
        snprintf(port, sizeof(port), "%d", broker_port);
        snprintf(store, sizeof(store), "%s/nats", cfg->dir);
        const char *a[] = {"nats-server", "-js", "-a", "127.0.0.1", "-p", port, "-sd", store, NULL};
        memcpy(argv[i], a, sizeof(a));
    } else if (i <= NP_PRODUCER1) {
        snprintf(db[i], sizeof(db[i]), "%s/producer", cfg->dir);
        const char *a[] = {
            self_exe,   "--nats-producer", "--listen", producer_urls[i], "--db", db[i], "--nats",
            broker_url, "--events",        events,     "--lease-ms",     lease,  NULL};
        memcpy(argv[i], a, sizeof(a));
    } else {
        snprintf(db[i], sizeof(db[i]), "%s/consumer", cfg->dir);
        const char *a[] = {self_exe,   "--nats-consumer", "--db", db[i], "--nats",
                           broker_url, "--events",        events, NULL};
        memcpy(argv[i], a, sizeof(a));
    }
    return argv[i];
}

/* Waits up to 40 s for "ready" on fd (our processes) or for the broker's port. */
static bool wait_ready(size_t i, int fd)
{
    if (i == NP_BROKER) {
        for (int k = 0; k < 400 && !broker_listens(); k++) {
            chaos_sleep_ms(100);
        }
        return broker_listens();
    }
    char line[8] = {0};
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    return poll(&pfd, 1, 40000) == 1 && read(fd, line, 6) == 6 && strncmp(line, "ready\n", 6) == 0;
}

/* Starts process i (its stdout and stderr in DIR/NAME.log, the ready line on a pipe). */
bool chaos_nats_start(size_t i)
{
    char log[700];
    int fds[2];
    const char *const *argv = proc_argv(i);
    snprintf(log, sizeof(log), "%s/%s.log", run_cfg->dir, names[i]);
    int err = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (err < 0 || pipe2(fds, O_CLOEXEC) != 0) {
        perror(log);
        return false;
    }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(i == NP_BROKER ? err : fds[1], STDOUT_FILENO);
        dup2(err, STDERR_FILENO);
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(err);
    close(fds[1]);
    bool ready = pid > 0 && wait_ready(i, fds[0]);
    close(fds[0]);
    if (pid <= 0) {
        return false;
    }
    procs[i].pid = children[i] = pid;
    procs[i].stopped = false;
    proc_event("start", ready ? "ready" : "not_ready", i, pid);
    return ready;
}

bool chaos_nats_setup(const chaos_cfg *cfg)
{
    run_cfg = cfg;
    ssize_t n = readlink("/proc/self/exe", self_exe, sizeof(self_exe) - 1);
    if (n <= 0 || (broker_port = chaos_free_port()) <= 0) {
        return false;
    }
    self_exe[n] = '\0';
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    snprintf(broker_url, sizeof(broker_url), "nats://127.0.0.1:%d", broker_port);
    for (size_t i = 0; i < 2; i++) {
        snprintf(producer_urls[i], sizeof(producer_urls[i]), "ipc://%s/p%zu.ipc", cfg->dir, i);
    }
    return chaos_nats_start(NP_BROKER);
}

/* SIGKILL (or SIGTERM) process i and reap it; restart it after lo..hi ms. */
/* Sends sig to pid and reaps it; SIGKILL after 10 s (a shutdown that hangs). Returns
 * its wait status; *hung: it had to be killed. */
static int end_process(pid_t pid, int sig, bool *hung)
{
    int st = 0;
    uint64_t end = chaos_now_ms() + 10000;
    *hung = false;
    kill(pid, sig);
    kill(pid, SIGCONT);
    while (waitpid(pid, &st, WNOHANG) == 0) {
        if (chaos_now_ms() > end) {
            *hung = true;
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            break;
        }
        chaos_sleep_ms(10);
    }
    return st;
}

static void fault_kill(uint64_t *rng, size_t i, const char *kind, int sig, uint64_t lo, uint64_t hi)
{
    pid_t pid = procs[i].pid;
    bool hung;
    proc_event("fault", kind, i, pid);
    end_process(pid, sig, &hung);
    if (hung) {
        proc_event("fault", "crash", i, pid); /* it did not stop on SIGTERM */
    }
    procs[i].pid = children[i] = 0;
    proc_event("fault_end", kind, i, pid);
    chaos_sleep_ms(chaos_between(rng, lo, hi));
    chaos_nats_start(i);
}

/* Runs argv (cp, rm, mv) and waits for it; true when it exited 0. */
static bool run_tool(const char *const *argv)
{
    int st = 0;
    pid_t pid = fork();
    if (pid == 0) {
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static void fault_amnesia(uint64_t *rng, const volatile bool *stop)
{
    char store[600], copy[620];
    pid_t pid = procs[NP_BROKER].pid;
    bool hung, copied;
    snprintf(store, sizeof(store), "%s/nats", run_cfg->dir);
    snprintf(copy, sizeof(copy), "%s/nats.frozen", run_cfg->dir);
    const char *rm_copy[] = {"rm", "-rf", copy, NULL}, *rm_store[] = {"rm", "-rf", store, NULL};
    const char *cp[] = {"cp", "-a", store, copy, NULL}, *mv[] = {"mv", copy, store, NULL};
    proc_event("fault", "broker_amnesia", NP_BROKER, pid);
    kill(pid, SIGSTOP); /* what its disk holds at one instant */
    copied = run_tool(rm_copy) && run_tool(cp);
    kill(pid, SIGCONT);
    for (uint64_t end = chaos_now_ms() + chaos_between(rng, 500, 2000);
         chaos_now_ms() < end && !*stop;) {
        chaos_sleep_ms(50); /* the relays publish, the broker acks past the copy */
    }
    end_process(pid, SIGKILL, &hung);
    procs[NP_BROKER].pid = children[NP_BROKER] = 0;
    if (!copied || !run_tool(rm_store) || !run_tool(mv)) {
        fprintf(stderr, "chaos: broker_amnesia: copying %s failed; started on its own\n", store);
    }
    proc_event("fault_end", "broker_amnesia", NP_BROKER, pid);
    chaos_sleep_ms(chaos_between(rng, 200, 1500));
    chaos_nats_start(NP_BROKER);
}

static void fault_stop(uint64_t *rng, size_t i)
{
    proc_event("fault", "consumer_stop", i, procs[i].pid);
    procs[i].stopped = true;
    kill(procs[i].pid, SIGSTOP);
    chaos_sleep_ms(
        chaos_between(rng, CHAOS_NATS_ACK_WAIT_MS * 3 / 2, CHAOS_NATS_ACK_WAIT_MS * 5 / 2));
    kill(procs[i].pid, SIGCONT);
    procs[i].stopped = false;
    proc_event("fault_end", "consumer_stop", i, procs[i].pid);
}

/* A process that exited without our kill: a crash. Restarts it. */
static void reap_crashed(void)
{
    for (size_t i = 0; i < NP_COUNT; i++) {
        int st;
        if (procs[i].pid > 0 && waitpid(procs[i].pid, &st, WNOHANG) == procs[i].pid) {
            proc_event("fault", "crash", i, procs[i].pid);
            procs[i].pid = children[i] = 0;
            chaos_nats_start(i);
        }
    }
}

static void fault_wait(uint64_t ms, const volatile bool *stop)
{
    for (uint64_t end = chaos_now_ms() + ms; chaos_now_ms() < end && !*stop;) {
        chaos_sleep_ms(100);
        reap_crashed();
    }
}

uint64_t chaos_nats_faults(const chaos_cfg *cfg, const volatile bool *stop)
{
    uint64_t rng = cfg->seed * 0x9e3779b97f4a7c15ull + 7, faults = 0;
    fault_wait(1500, stop);
    while (!*stop) {
        uint64_t pick = chaos_between(&rng, 0, 99);
        size_t side = (size_t)chaos_between(&rng, 0, 1);
        size_t consumer = NP_CONSUMER0 + side, producer = NP_PRODUCER0 + side;
        if (pick < 30 && procs[consumer].pid > 0) {
            fault_kill(&rng, consumer, "consumer_kill", SIGKILL, 100, 800);
        } else if (pick < 50 && procs[consumer].pid > 0) {
            fault_stop(&rng, consumer);
        } else if (pick < 75 && procs[producer].pid > 0) {
            fault_kill(&rng, producer, "relay_kill", SIGKILL, 100, 800);
        } else if (pick < 85 && procs[NP_BROKER].pid > 0) {
            fault_kill(&rng, NP_BROKER, "broker_kill", SIGKILL, 200, 4000);
        } else if (pick < 93 && procs[NP_BROKER].pid > 0) {
            fault_amnesia(&rng, stop);
        } else if (procs[NP_BROKER].pid > 0) {
            fault_kill(&rng, NP_BROKER, "broker_term", SIGTERM, 200, 4000);
        } else {
            continue;
        }
        faults++;
        fault_wait(chaos_between(&rng, 1000, 3000), stop);
    }
    return faults;
}

void chaos_nats_heal(void)
{
    for (size_t i = 0; i < NP_COUNT; i++) {
        if (procs[i].pid > 0 && procs[i].stopped) {
            kill(procs[i].pid, SIGCONT);
            procs[i].stopped = false;
        }
    }
    reap_crashed();
    for (size_t i = 0; i < NP_COUNT; i++) {
        if (procs[i].pid <= 0) {
            chaos_nats_start(i);
        }
    }
}

/* SIGTERM, then SIGKILL after 10 s (a "crash": it did not stop); reaps it. */
static void stop_one(size_t i)
{
    pid_t pid = procs[i].pid;
    bool hung;
    if (pid <= 0) {
        return;
    }
    int st = end_process(pid, SIGTERM, &hung);
    /* nats-server exits 1 after a clean shutdown on SIGTERM ("Server Exiting..") */
    bool clean = !hung && WIFEXITED(st) && (WEXITSTATUS(st) == 0 || i == NP_BROKER);
    proc_event(clean ? "stop" : "fault", clean ? "exit" : "crash", i, pid);
    procs[i].pid = children[i] = 0;
}

void chaos_nats_stop(bool broker_too)
{
    for (size_t i = 0; i < NP_BROKER; i++) {
        stop_one(i);
    }
    if (broker_too) {
        stop_one(NP_BROKER);
    }
}

/* The lmdb topology's store agent, seen from the campaign (the agent itself is
 * chaos_agent.c): started before the servers, it writes its ballast once (the whole map
 * but CHAOS_HEADROOM_BYTES); a fill fault then writes what is left of the headroom and
 * its end gives the headroom back; the heal frees the ballast. One line per command on
 * the agent's stdin, one answer line on its stdout. Only the fault thread talks to it. */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chaos_faults.h"

/* The store agent (lmdb): its pid, its stdin and stdout. */
static struct {
    pid_t pid;
    FILE *to, *from;
} agent;

/* One command line to the agent (none: only read) and its one answer line. */
static bool agent_ask(const char *cmd, char *answer, size_t cap)
{
    if (agent.pid <= 0) {
        return false;
    }
    if (cmd != NULL && (fprintf(agent.to, "%s\n", cmd) < 0 || fflush(agent.to) != 0)) {
        return false;
    }
    return fgets(answer, (int)cap, agent.from) != NULL;
}

/* The agent's answer "WORD BYTES FREE" to cmd: BYTES (-1 when it failed) and FREE. */
static long long agent_bytes(const char *cmd, const char *word, long long *free_now)
{
    char answer[96], got[16];
    long long n;
    if (!agent_ask(cmd, answer, sizeof(answer)) ||
        sscanf(answer, "%15s %lld %lld", got, &n, free_now) != 3 || strcmp(got, word) != 0) {
        fprintf(stderr, "idemrpc-chaos: the store agent did not do '%s'\n", cmd);
        return -1;
    }
    return n;
}

/* Starts the store agent (lmdb) on the store, before the servers, and writes its ballast:
 * the whole map but CHAOS_HEADROOM_BYTES. */
bool chaos_agent_start(const chaos_cfg *cfg)
{
    char store[600], map[24], err_log[700], answer[16] = "", cmd[48], bytes[24];
    int in[2], out[2];
    snprintf(store, sizeof(store), "%s/store", cfg->dir);
    snprintf(map, sizeof(map), "%" PRIu64, cfg->map_mib << 20);
    snprintf(err_log, sizeof(err_log), "%s/agent.log", cfg->dir);
    const char *argv[] = {chaos_self_exe(), "--agent",      "--db", store, "--map-size", map,
                          "--log",          cfg->agent_log, NULL};
    int err = open(err_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
        return false;
    }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(in[0], STDIN_FILENO);
        chaos_exec(argv, out[1], err);
    }
    close(in[0]);
    close(out[1]);
    if (err >= 0) {
        close(err);
    }
    agent.pid = pid;
    agent.to = fdopen(in[1], "w");
    agent.from = fdopen(out[0], "r");
    if (pid <= 0 || agent.to == NULL || agent.from == NULL ||
        !agent_ask(NULL, answer, sizeof(answer)) || strcmp(answer, "ready\n") != 0) {
        return false;
    }
    long long free_now = 0;
    snprintf(cmd, sizeof(cmd), "ballast %llu", CHAOS_HEADROOM_BYTES);
    long long ballast = agent_bytes(cmd, "ballast", &free_now);
    snprintf(bytes, sizeof(bytes), "%lld", ballast);
    const char *f[] = {"bytes", bytes};
    chaos_history_event("ballast", 1, f);
    printf("chaos: store map %" PRIu64 " MiB, ballast %lld MiB, %lld MiB free\n", cfg->map_mib,
           ballast >> 20, free_now >> 20);
    fflush(stdout);
    return ballast >= 0;
}

/* Closes the agent's stdin (it frees nothing more) and reaps it. */
void chaos_agent_stop(void)
{
    if (agent.pid <= 0) {
        return;
    }
    fclose(agent.to);
    fclose(agent.from);
    waitpid(agent.pid, NULL, 0);
    agent.pid = 0;
}

/* The store fills up: the agent pins LMDB's pages and writes until MDB_MAP_FULL; the
 * store stays full for 1-4 leases (no write txn can commit meanwhile), then the agent
 * ends the pin and deletes ballast until CHAOS_HEADROOM_BYTES are free again.
 * "fill_full" marks the moment the map was full. */
void chaos_fault_fill(uint64_t *rng, const chaos_cfg *cfg)
{
    char cmd[48], bytes[24], freed[24], left[24];
    long long free_now = 0;
    const char *f[] = {"kind", "fill", "bytes", bytes, "free", left};
    chaos_history_event("fault", 1, f);
    snprintf(bytes, sizeof(bytes), "%lld", agent_bytes("fill", "full", &free_now));
    snprintf(left, sizeof(left), "%lld", free_now);
    chaos_history_event("fill_full", 3, f);
    chaos_sleep_ms(chaos_between(rng, cfg->lease_ms, 4 * cfg->lease_ms));
    snprintf(cmd, sizeof(cmd), "free %llu", CHAOS_HEADROOM_BYTES);
    snprintf(freed, sizeof(freed), "%lld", agent_bytes(cmd, "freed", &free_now));
    snprintf(left, sizeof(left), "%lld", free_now);
    f[3] = freed;
    chaos_history_event("fault_end", 3, f);
    if (free_now < (long long)CHAOS_HEADROOM_BYTES / 2) {
        fprintf(stderr, "idemrpc-chaos: the ballast is used up, %lld MiB free: raise --map-mib\n",
                free_now >> 20);
    }
}

void chaos_agent_free_all(void)
{
    char freed[24];
    long long free_now;
    snprintf(freed, sizeof(freed), "%lld", agent_bytes("free all", "freed", &free_now));
    const char *f[] = {"bytes", freed};
    chaos_history_event("ballast_freed", 1, f);
}

/* A crash during a compensation (chaos_faults.h), on both store topologies: the campaign
 * creates EFFECTS.undo-crash; the first undo of a declined Book to remove it
 * (chaos_server.c, hold_undo) has written its effect line, writes its pid to
 * EFFECTS.undo-crash.pid and waits; this SIGKILLs that server there, before the undo is
 * journaled, and restarts it. The call's lease then runs out with its compensation half
 * done: a retry or the re-driver must finish it, running the undo again (its one excused
 * repeat: its process was killed after its effect). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "chaos_faults.h"

#define ARMED_FOR_MS 3000

/* The pid an undo wrote to path, waiting up to ARMED_FOR_MS for it; 0 if none. */
static pid_t wait_for_undo(const char *path)
{
    for (uint64_t end = chaos_now_ms() + ARMED_FOR_MS; chaos_now_ms() < end;) {
        FILE *f = fopen(path, "r");
        long pid = 0;
        if (f != NULL) {
            int got = fscanf(f, "%ld", &pid);
            fclose(f);
            return got == 1 ? (pid_t)pid : 0;
        }
        chaos_sleep_ms(10);
    }
    return 0;
}

bool chaos_undo_crash(uint64_t *rng, const chaos_cfg *cfg)
{
    char armed[640], told[660];
    snprintf(armed, sizeof(armed), "%s.undo-crash", cfg->effects);
    snprintf(told, sizeof(told), "%s.undo-crash.pid", cfg->effects);
    FILE *f = fopen(armed, "w");
    if (f == NULL || fclose(f) != 0) {
        perror(armed);
        return false;
    }
    pid_t pid = wait_for_undo(told);
    if (pid == 0 && unlink(armed) == 0) {
        return false; /* disarmed before any undo took it */
    }
    if (pid == 0) {
        pid = wait_for_undo(told); /* an undo took it just now */
    }
    unlink(told);
    size_t i = chaos_server_of(pid);
    if (i == CHAOS_SERVERS) {
        return false; /* its server died meanwhile: another fault's */
    }
    chaos_fault_kill(rng, i, "undo_crash");
    return true;
}

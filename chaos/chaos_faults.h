/* What the fault files of idemrpc-chaos share (chaos_faults.c owns the server table and
 * the schedule; the faults of one topology's new surface live in files of their own). */
#ifndef IDEMRPC_CHAOS_FAULTS_H
#define IDEMRPC_CHAOS_FAULTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "chaos.h"

/* The running program (for the server processes it starts). */
const char *chaos_self_exe(void);
/* In the forked child of a threaded process (everything prepared before the fork): makes
 * out_fd its stdout and err_fd (unless < 0) its stderr, and execs argv. Never returns. */
void chaos_exec(const char *const *argv, int out_fd, int err_fd);
/* ---- the lmdb store agent (chaos_faults_fill.c) ---- */
/* Starts it on the store, before the servers, and writes its ballast. */
bool chaos_agent_start(const chaos_cfg *cfg);
/* The store fills up for 1-4 leases, then the headroom is freed again (fault "fill"). */
void chaos_fault_fill(uint64_t *rng, const chaos_cfg *cfg);
/* Frees the whole ballast (the heal); then closes its stdin and reaps it. */
void chaos_agent_free_all(void);
void chaos_agent_stop(void);
/* A history event about server i (pid): {"ev":ev,"kind":kind,"server":i,"pid":pid}. */
void chaos_server_event(const char *ev, const char *kind, size_t i, pid_t pid);
/* The index of the server whose process is pid (CHAOS_SERVERS: none). */
size_t chaos_server_of(pid_t pid);
/* SIGKILL of server i, recorded as fault kind, and its restart 0.1-0.8 s later. */
void chaos_fault_kill(uint64_t *rng, size_t i, const char *kind);
/* A crash during a compensation (chaos_faults_undo.c): arms the servers, and kills the
 * one whose undo took it between the undo's effect and its record; false (nothing
 * recorded) when no undo took it within 3 s. */
bool chaos_undo_crash(uint64_t *rng, const chaos_cfg *cfg);
/* Server i's process (0: not running). */
pid_t chaos_server_pid(size_t i);
/* Server i's HTTP front, http://127.0.0.1:PORT. */
const char *chaos_server_http(size_t i);
/* Slow and trickling HTTP clients against server i's HTTP front (chaos_faults_http.c). */
void chaos_slow_http(uint64_t *rng, size_t i);
/* Trickling, silent and resetting HTTP/2 clients against server i's gRPC front
 * (chaos_faults_grpc.c, in a build with the gRPC front). */
void chaos_slow_grpc(uint64_t *rng, size_t i);
/* Runs "$IDEMRPC_SERVICES what" (scripts/services.sh), complaining on failure. */
void chaos_services(const chaos_cfg *cfg, const char *what);

#ifdef CHAOS_HAVE_PG
/* ---- pg (chaos_faults_pg.c) ---- */
/* Sets up server i's way to the database: a fault proxy of its own, listed after the
 * run's hung host (the first host of every server's conninfo); writes the conninfo into
 * via. False when a proxy or the hung host could not be made. */
bool chaos_pg_route(const chaos_cfg *cfg, size_t i, char *via, size_t cap);
/* Server i's database connections go silent (cut: a partition) or slow for a while. */
void chaos_pg_network(uint64_t *rng, const chaos_cfg *cfg, size_t i, pid_t pid, bool cut);
/* The first host of the conninfo accepts TCP and never answers (a partitioned ex-leader)
 * while PostgreSQL restarts: every connection is made again through the list. False
 * (nothing recorded) when the hung host cannot listen. */
bool chaos_pg_hung_host(uint64_t *rng, const chaos_cfg *cfg);
/* Stops the proxies and closes the hung host. */
void chaos_pg_stop(void);
#endif

#endif

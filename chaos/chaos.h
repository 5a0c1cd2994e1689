/* idemrpc-chaos: a randomised fault campaign against real server processes, recorded in
 * a history that a checker verifies afterwards (Jepsen-style).
 *
 *   chaos.c          options, the run: servers up, clients and faults, settle, check
 *   chaos_server.c   the server under test (the same binary, run with --serve)
 *   chaos_workload.c client threads: logical operations retried until decided
 *   chaos_faults.c   server processes, SIGKILL/SIGSTOP, a full store, PostgreSQL and
 *                    Redis faults
 *   chaos_agent.c    the store agent (lmdb): fills and frees the store, logs commit stalls
 *   chaos_history.c  the history file (one JSON line per event) and its reader
 *   chaos_check*.c   the checker: history + final store + effect log → violations
 *                    (chaos_check.h: its parts)
 *   chaos_nats*.c    the broker topology (a build with libnats): a JetStream broker, two
 *                    payment servers with their outbox relays, two consumers on one
 *                    durable; consumer kill and stop, relay kill, broker restart; its
 *                    checker counts the effects per message id
 *
 * Every time is CLOCK_MONOTONIC in ms, shared by the campaign and the servers (the
 * servers stamp the effect log with it). */
#ifndef IDEMRPC_CHAOS_H
#define IDEMRPC_CHAOS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include <idemrpc/idemrpc.h>

#define CHAOS_SERVERS 2
#define CHAOS_ACCOUNTS 8
#define CHAOS_INITIAL_BALANCE 1000
#define CHAOS_METHOD_TRANSFER "chaos.Ledger/Transfer"
#define CHAOS_METHOD_ORDER "chaos.Order/Submit"
#define CHAOS_METHOD_ADD "chaos.Counter/Add"
#define CHAOS_METHOD_BOOK "chaos.Trip/Book"
/* The re-driver's interval in the servers (idem_server_opts.redrive_interval_ms) unless
 * --redrive-ms says otherwise (0: off, to see the liveness check fail). */
#define CHAOS_REDRIVE_MS 100
/* lmdb: the free space a "fill" fault hands back when it ends (the rest of the map is
 * the agent's ballast, written once at the start). */
#define CHAOS_HEADROOM_BYTES (16ull << 20)
/* The servers' HTTP front (the slow_http fault): a request must arrive whole within this
 * (idem_server_opts.http_request_timeout_ms), and at most this many connections at once
 * (http_max_conns: a few slow clients can fill it, as on a busy front). */
#define CHAOS_HTTP_REQUEST_TIMEOUT_MS 1000
#define CHAOS_HTTP_MAX_CONNS 4
/* The servers' gRPC front (the slow_grpc fault, in a build with it): a request's HEADERS
 * to its last DATA within this (idem_server_opts.grpc_request_timeout_ms). */
#define CHAOS_GRPC_REQUEST_TIMEOUT_MS 1000

typedef enum chaos_topology { CHAOS_LMDB, CHAOS_PG, CHAOS_NATS } chaos_topology;

typedef struct chaos_cfg {
    chaos_topology topology;
    uint64_t seconds, seed, lease_ms, clients;
    uint64_t map_mib;    /* lmdb: the servers' and the agent's map size */
    uint64_t redrive_ms; /* the servers' re-driver interval; 0 = off */
    bool check_only;     /* --check: only the checker, on the files of a finished run */
    char dir[512];       /* work dir: store, effect log, server logs, history */
    char history[600];   /* history file (kept) */
    char effects[600];   /* the effect log the servers append to */
    char agent_log[600]; /* lmdb: the store agent's commit stalls */
    char run[32];        /* prefix of every caller of this run; on pg its schema chaos_RUN */
    const char *pg;      /* IDEMRPC_TEST_PG with this run's schema (pg topology) */
    char pg_conninfo[1024];
    /* --slow-http-pct: P in 100 faults are slow_http (lmdb, pg); 0 = the usual mix */
    uint64_t slow_http_pct;
    /* --slow-grpc-pct: G in 100 faults are slow_grpc (a build with the gRPC front) */
    uint64_t slow_grpc_pct;
    const char *redis;    /* IDEMRPC_TEST_REDIS (pg topology) */
    const char *services; /* IDEMRPC_SERVICES: "bash …/services.sh" (pg faults) */
} chaos_cfg;

uint64_t chaos_now_ms(void);
void chaos_sleep_ms(uint64_t ms);
/* xorshift64*: per-thread, seeded, never 0. */
uint64_t chaos_rand(uint64_t *state);
uint64_t chaos_between(uint64_t *state, uint64_t lo, uint64_t hi); /* [lo, hi] */
/* A port of 127.0.0.1 that was free a moment ago (-1: none). */
int chaos_free_port(void);
/* A blocking TCP connection to 127.0.0.1:port (-1: refused or no socket). */
int chaos_connect_local(int port);
/* FNV-1a 64 of bytes, for the payload digests of the history. */
uint64_t chaos_digest(const void *p, size_t n);

/* ---- the server under test (chaos_server.c) ---- */
int chaos_serve(int argc, char **argv);

/* ---- the store agent (chaos_agent.c) ---- */
int chaos_agent(int argc, char **argv);

/* ---- the history (chaos_history.c) ----
 * Events: {"t":MS,"ev":"send"|"recv"|"fault"|"start"|"rss"|"settle", ...string fields}.
 * Writers are serialised by a mutex; every line is flushed. */
bool chaos_history_open(const char *path);
void chaos_history_close(void);
/* Writes one event; fields are name/value string pairs, n pairs. */
void chaos_history_event(const char *ev, size_t n, const char *const *fields);
/* Reads field name of a history line into buf (unescaping \" and \\); false if absent. */
bool chaos_history_field(const char *line, const char *name, char *buf, size_t cap);

/* ---- the servers and the faults (chaos_faults.c) ---- */
bool chaos_servers_start(const chaos_cfg *cfg);
/* The i-th server's URL (ipc under cfg->dir). */
const char *chaos_server_url(size_t i);
/* Server i's gRPC front, tcp://127.0.0.1:PORT ("" on the nats topology). */
const char *chaos_server_grpc(size_t i);
#ifdef CHAOS_HAVE_GRPC
/* One unary call of q through the gRPC front on 127.0.0.1:port (chaos_grpc_client.c),
 * answered as idem_client_call answers (attempts 1); the caller clears r. */
idem_code chaos_grpc_call(int port, const idem_request *q, idem_result *r);
#endif
/* Runs the seeded fault schedule until *stop; returns the number of faults injected. */
uint64_t chaos_faults_run(const chaos_cfg *cfg, const volatile bool *stop);

/* A thread running a topology's faults (run: chaos_faults_run or chaos_nats_faults)
 * until *stop; faults: how many it made. Start it with chaos_fault_thread_main. */
typedef struct chaos_fault_thread {
    uint64_t (*run)(const chaos_cfg *cfg, const volatile bool *stop);
    const chaos_cfg *cfg;
    const volatile bool *stop;
    uint64_t faults;
} chaos_fault_thread;
void *chaos_fault_thread_main(void *arg);
/* Ends every fault in effect (SIGCONT, restarts dead servers, starts Redis). */
void chaos_faults_heal(const chaos_cfg *cfg);
/* Samples each server's VmRSS into the history (called by the fault thread too). */
void chaos_servers_sample_rss(void);
/* SIGTERM, then SIGKILL after 10 s; reaps them. */
void chaos_servers_stop(void);

/* ---- the workload (chaos_workload.c) ---- */
typedef struct chaos_totals {
    uint64_t calls, ops, decided, undecided;
    uint64_t abandoned; /* Books whose client gave up, undecided: not settled */
} chaos_totals;
/* Runs cfg->clients threads until *stop, then lets their logical operations end. */
void chaos_workload_run(const chaos_cfg *cfg, const volatile bool *stop, chaos_totals *out);
/* Retries every undecided operation until it is decided (or 15 s per operation). */
void chaos_workload_settle(const chaos_cfg *cfg, chaos_totals *out);

/* ---- the checker (chaos_check.c) ---- */
/* Reads the history and the final state; prints each violation; returns their number. */
uint64_t chaos_check(const chaos_cfg *cfg);

/* ---- the broker topology (chaos_nats.c, chaos_nats_proc.c, chaos_nats_check.c) ---- */
#define CHAOS_METHOD_PAY "chaos.Pay/Charge"
#define CHAOS_NATS_STREAM "CHAOS"
#define CHAOS_NATS_SUBJECT "chaos.commission"
#define CHAOS_NATS_DEAD "chaos.dead"
#define CHAOS_NATS_DURABLE "commissions"
#define CHAOS_NATS_ACK_WAIT_MS 2000 /* a stopped consumer's delivery goes to the other */
#define CHAOS_NATS_MAX_DELIVER 5
/* The stream's duplicate window: far shorter than nats-server's default (2 min), so that
 * a copy a relay publishes again after a kill (or a second relay on the same outbox)
 * often gets past the broker's dedupe and reaches the consumers: the marker's case. */
#define CHAOS_NATS_DUP_WINDOW_MS 200
int chaos_nats_producer(int argc, char **argv); /* --nats-producer: payments + relay */
int chaos_nats_consumer(int argc, char **argv); /* --nats-consumer: the commissions */
/* --topology nats: broker, processes, load and faults, settling, the stream's dump, the
 * checker; returns the exit status. */
int chaos_nats_run(const chaos_cfg *cfg);
/* Reads the history, the stores and the stream's dump (stream.tsv); prints each
 * violation; returns their number. */
uint64_t chaos_nats_check(const chaos_cfg *cfg);

#endif

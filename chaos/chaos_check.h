/* The checker of idemrpc-chaos (lmdb and pg topologies), shared by its files:
 *   chaos_check.c        the state, the violations, claim-mode and transactional keys,
 *                        the ledger, the final store, memory, the report
 *   chaos_check_read.c   the history, the effect log, the agent's stalls, the re-runs
 *   chaos_check_book.c   chaos.Trip/Book: one outcome, each step's effect once (with the
 *                        evidence of an owner that could not record it), the re-driver
 * Single-threaded: it runs once, after the servers stopped. */
#ifndef IDEMRPC_CHAOS_CHECK_H
#define IDEMRPC_CHAOS_CHECK_H

#include <stdbool.h>
#include <stdint.h>

#include <idemrpc/idemrpc.h>

#include "chaos.h"

#define BUCKETS 65536
/* Effect lines kept per key and step: a declined Book its client retries runs hold and
 * undo once per retry (17 holds on one key in a 60 s pg run of seed 16016, so 12 read
 * as an undo of a hold no effect showed). */
#define MAX_EFFECTS 64
#define MAX_FAULTS 4096
#define MAX_STALLS 8192
#define FULL_GRACE_MS 1000 /* a refusal may arrive this long after a fill ended */
#define MAX_SHOWN 10

typedef struct execution {
    long pid;
    uint64_t fence, t;
} execution;

/* chaos.Trip/Book: per step, its effect lines and the server's notes of a step that ran
 * but was not recorded; "undo" is hold's undo (a declined Book's compensation). The
 * first N_OUT steps name an output in an OK answer. */
enum { S_HOLD, S_PAY, S_UNDO, N_STEPS, N_OUT = S_UNDO };
extern const char *const step_names[N_STEPS];

typedef struct step_note {
    long pid;
    uint64_t fence, t;
    bool recorded; /* "recorded" (else "unrecorded:CODE") */
    char code[48];
} step_note;

typedef struct step_log {
    size_t n, n_notes; /* n: effect lines (exec holds the first MAX_EFFECTS) */
    size_t n_recorded; /* notes "recorded", all of them (notes holds the first ones) */
    execution exec[MAX_EFFECTS];
    /* S_UNDO: the hold each undo line undoes ("undo=hold.PID.FENCE", the hold's recorded
     * output that the store hands the undo; pid 0: the line names none) */
    execution of[MAX_EFFECTS];
    step_note notes[MAX_EFFECTS];
} step_log;

typedef struct book {
    step_log steps[N_STEPS];
    bool abandoned;         /* its client gave up after one attempt; the settle pass left it */
    bool journaled;         /* its step journal is still in the store after the run */
    char ok_out[N_OUT][96]; /* the step outputs the first OK answer named */
} book;

typedef struct entry {
    struct entry *next;
    book *book; /* chaos.Trip/Book only */
    char method[48], caller[80], key[160], payload[64];
    int n_definitive;
    char code[32], digest[24], body[512];
    bool acked_ok, refused, undecided_checked;
    long long effects;
    size_t n_exec;
    execution exec[MAX_EFFECTS];
} entry;

typedef struct fault {
    uint64_t t;
    long pid;
    bool stop; /* SIGSTOP (else SIGKILL) */
} fault;

/* An interval in which the store committed nothing (the agent's no_commit). */
typedef struct stall {
    uint64_t from, to;
} stall;

/* A lease that ran out by its owner's own count (a server's log line naming the key's
 * hash and lapsed_at_ms): the owner could not renew in time (paused, starved, a slow
 * store). t: on the campaign's clock. */
typedef struct lapse {
    char hash[20];
    uint64_t t;
} lapse;

typedef struct rss_life {
    long pid;
    uint64_t first_t, last_t;
    size_t n;
    long *kib;
} rss_life;

/* Fault kinds as the history names them; the last, "other", counts any other. */
enum { F_N_KINDS = 12 };
extern const char *const f_names[F_N_KINDS];

typedef struct chaos_ck {
    entry *buckets[BUCKETS];
    fault faults[MAX_FAULTS];
    size_t n_faults;
    stall stalls[MAX_STALLS];
    size_t n_stalls;
    lapse *lapses; /* sorted by hash, then t */
    size_t n_lapses;
    uint64_t restart_from; /* the PostgreSQL restart under way (pg) */
    rss_life *lives;
    size_t n_lives;
    uint64_t calls, fault_count, violations;
    uint64_t grpc_calls;           /* of calls: answered through a gRPC front */
    uint64_t shown[8], excused[6]; /* excused: X_* */
    uint64_t kinds[F_N_KINDS];     /* faults by kind: f_names */
    uint64_t full_from, full_to;   /* the fill in effect (history order), or the last one */
    uint64_t exhausted, when_full; /* RESOURCE_EXHAUSTED answers, and during a fill */
    uint64_t load_end;             /* the clients stopped: the store idles until settling */
    struct {
        uint64_t calls, keys, abandoned, completed_ok, completed_other, no_record;
        uint64_t unstarted;     /* IN_PROGRESS, no step recorded, client gone */
        uint64_t held_released; /* no record, a journaled step: released, never finished */
        uint64_t excused[6], redrives[3];      /* X_*; re-runs in the logs: OK, replayed, other */
        uint64_t declined, undos, undos_again; /* declined keys, undo lines, lines beyond holds */
        uint64_t undo_transient;               /* undos that failed transiently (notes) */
        uint64_t given_back; /* holds of Books not declined, undone (the re-driver gave up) */
    } bk;
    idem_store *store; /* the final store, read-only, while check_store runs */
} chaos_ck;
extern chaos_ck ck;

enum { X_KILLED, X_STOPPED, X_NO_WRITE, X_STORE_REFUSED, X_STALE, X_LAPSED, X_N_KINDS };
enum { V_ANSWERS, V_EFFECTS, V_CALLERS, V_RECORDS, V_MEMORY, V_CRASHES, V_HTTP };

/* Counts a violation of kind V_* and prints the first MAX_SHOWN of each kind. */
void ck_violation(int kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The entry of (method, caller, key); created (with a book for a Book) if create. */
entry *ck_lookup(const char *method, const char *caller, const char *key, bool create);

/* chaos_check_read.c */
bool ck_read_history(const chaos_cfg *cfg);
void ck_read_effects(const chaos_cfg *cfg);
void ck_read_stalls(const chaos_cfg *cfg);
void ck_read_redrives(const chaos_cfg *cfg);
void ck_read_lapses(const chaos_cfg *cfg);
/* Whether the servers logged a lapse of key's lease in [from, to] (campaign clock). */
bool ck_lapsed(const char *key, uint64_t from, uint64_t to);

/* chaos_check_book.c */
void ck_book_answer(entry *e, const char *body);
void ck_check_book(entry *e, const chaos_cfg *cfg);
/* A Book whose card is declined (payload "decline N"): its hold is compensated. */
bool ck_declined(const entry *e);

#endif

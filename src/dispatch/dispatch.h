/* The dispatch layer: the work queue, the worker threads and the in-flight table.
 *
 * Both fronts (nng_front.c, http_front.c) turn what they receive into an idem_job and
 * hand it here; a worker decodes the frame, runs the chain, parks a duplicate that
 * must wait (inflight.c) and finally calls the job's answer. The fronts know the
 * dispatcher, never each other; the dispatcher knows no socket and no HTTP. */
#ifndef IDEMRPC_DISPATCH_H
#define IDEMRPC_DISPATCH_H

#include <stdatomic.h>

#include "call.h"
#include "identity.h"

/* A served call: the decoded request (in arena) and the call after the whole chain
 * ran. It must not move while req is set. */
typedef struct idem_served {
    Idem__V1__Request *req;
    idem_call call;
    uint64_t start_us;
    idem_arena arena;
} idem_served;

/* A unit of work for the workers: an nng context's call or an HTTP request. The front
 * fills answer, drop, frame, len and peer; the rest belongs to the dispatcher. */
typedef struct idem_job idem_job;
struct idem_job {
    /* On a worker: sends the response of s.call, calls idem__dispatch_done(d, &s) and
     * releases the job. */
    void (*answer)(idem_job *job);
    void (*drop)(idem_job *job); /* at shutdown, instead of answer */
    const void *frame;
    size_t len;
    idem_peer peer; /* what the transport says about the sender (identity.h) */
    /* answer sends a serialized Response (idem_call.wire_reply): the nng front. */
    bool wire_reply;
    /* frame is the front's own buffer, not read again once decoded: the decoder may
     * write into it (idem__decode_request_arena). */
    bool frame_writable;
    /* frame was built by a front (HTTP, gRPC) from a message it held to max_frame and
     * headers it bounded itself: not held to max_frame again (its envelope adds the
     * method, key and metadata to a message that may be max_frame bytes). */
    bool frame_built;
    /* Optional: the front's count of its parked jobs and its bound (a parked nng job
     * keeps its context: the nng front parks at most half of them). */
    atomic_size_t *parked;
    size_t max_parked;

    idem_job *next;
    idem_served s;
    /* s holds a call that waited, or that the fast path began: resume it at
     * s.call.resume_pos, do not decode it again. */
    bool parked_before;
    bool holds_slot; /* counted in *parked: parked, or woken and not yet resumed */
    uint32_t bucket; /* while parked (inflight.c) */
    uint64_t wake_ms;
};

typedef struct idem_dispatch idem_dispatch;

typedef struct idem_dispatch_cfg {
    const idem_chain *chain; /* read at every call: complete before the first */
    const idem_method *(*find_method)(void *arg, const char *name);
    void *find_arg;
    idem_runtime *rt;              /* rt->inflight is created here */
    idem_store *store;             /* where the in-flight table renews leases */
    const idem_identity *identity; /* NULL: callers are taken as they declare themselves */
    size_t workers, max_queue, max_frame, max_waiters;
} idem_dispatch_cfg;

idem_code idem__dispatch_create(idem_dispatch **out, const idem_dispatch_cfg *cfg);
/* Starts the workers. */
idem_code idem__dispatch_start(idem_dispatch *d);
/* Takes no more jobs, drops the parked and queued ones (their drop), lets running
 * handlers finish and joins the workers. */
void idem__dispatch_stop(idem_dispatch *d);
void idem__dispatch_destroy(idem_dispatch *d);
bool idem__dispatch_stopping(idem_dispatch *d);

/* IDEM_OK, IDEM_RESOURCE_EXHAUSTED (max_queue reached) or IDEM_UNAVAILABLE (stopping);
 * only on IDEM_OK does the job belong to the dispatcher. Safe from nng callbacks. */
idem_code idem__dispatch_enqueue(idem_dispatch *d, idem_job *job);
/* Frees the call and request in s (nothing is answered or counted): what a false
 * idem__dispatch_run kept; idem__dispatch_done is this after counting the call. */
void idem__dispatch_discard(idem_served *s);

/* How a front hands a frame over (idem__dispatch_run). */
typedef struct idem_run_opts {
    bool wire_reply;     /* the answer is sent as a serialized Response (idem_call) */
    bool frame_writable; /* as idem_job.frame_writable */
    bool frame_built;    /* as idem_job.frame_built */
    bool fast_only;      /* an nng callback: see below */
    /* fast_only on behalf of an idem_job (out is its s): a new key's claim may be queued
     * for the store's writer thread, which hands the job back (the nng front only). */
    bool fast_claim;
} idem_run_opts;

/* One request frame through decode + identity + chain, on the caller's thread; every
 * outcome has a code and request id. peer may be NULL. fast_only (an nng callback):
 * returns false when the call needs a worker: out then holds the call, suspended, for
 * idem__dispatch_enqueue of the job whose s it is (the worker resumes it), or for
 * idem__dispatch_discard; else true. */
bool idem__dispatch_run(idem_dispatch *d, const void *frame, size_t len, const idem_peer *peer,
                        idem_run_opts opts, idem_served *out);
/* A call a front turns away before decoding (cheap: for nng callbacks). */
void idem__dispatch_reject(idem_dispatch *d, idem_served *out, const char *reason, idem_code code,
                           const char *message);
/* The answer for a call turned away by back-pressure, with retry-after-ms. */
void idem__dispatch_busy(idem_dispatch *d, idem_served *out);
/* Counts and logs the call: before its answer leaves, so that what a client saw is
 * already in the metrics. */
void idem__dispatch_count(idem_dispatch *d, const idem_served *s);
/* idem__dispatch_count, then frees it. */
void idem__dispatch_done(idem_dispatch *d, idem_served *s);

#endif

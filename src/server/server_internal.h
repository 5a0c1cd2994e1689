/* Server internals shared with the HTTP front, tests and the fuzz target. */
#ifndef IDEMRPC_SERVER_INTERNAL_H
#define IDEMRPC_SERVER_INTERNAL_H

#include <nng/nng.h>

#include "call.h"

/* A served call: the decoded request and the call after the whole chain ran. */
typedef struct idem_served {
    Idem__V1__Request *req;
    idem_call call;
    uint64_t start_us;
} idem_served;

/* A unit of work for the worker threads: an nng context's call or an HTTP request.
 * The transport fills answer, drop, frame and len; the rest is the server's. */
typedef struct idem_job idem_job;
struct idem_job {
    /* On a worker: sends the response of s.call, calls idem__server_done(srv, &s) and
     * releases the job. */
    void (*answer)(idem_server *srv, idem_job *job);
    void (*drop)(idem_job *job); /* at shutdown, instead of answer */
    const void *frame;
    size_t len;

    idem_job *next;
    idem_served s;
    bool parked_before; /* s holds a call that waited: resume it, do not decode again */
    uint32_t bucket;    /* while parked (inflight.c) */
    uint64_t wake_ms;
};

/* IDEM_OK, IDEM_RESOURCE_EXHAUSTED (max_queue reached) or IDEM_UNAVAILABLE (stopping);
 * only on IDEM_OK does the job belong to the queue. Safe from nng callbacks. */
idem_code idem__server_enqueue(idem_server *srv, idem_job *job);

/* One request frame through decode + chain; every outcome has a code and request id.
 * fast_only (on an nng callback): returns false, with nothing left to free, when the
 * call needs a worker; otherwise true. */
bool idem__server_run(idem_server *srv, const void *frame, size_t len, bool fast_only,
                      idem_served *out);
/* A call the transport turns away before decoding (cheap: for nng callbacks). */
void idem__server_reject(idem_server *srv, idem_served *out, const char *reason, idem_code code,
                         const char *message);
/* The answer for a call turned away by back-pressure, with retry-after-ms. */
void idem__server_busy(idem_server *srv, idem_served *out);
/* Counts and logs the call, then frees it. */
void idem__server_done(idem_server *srv, idem_served *s);

/* One request frame in, one response message out (the whole chain, no transport).
 * Returns NULL only when not even an INTERNAL answer could be allocated. The caller
 * frees the message. Safe to call on a server that does not listen. */
nng_msg *idem__server_serve_frame(idem_server *srv, const void *frame, size_t len);

/* Prometheus text of the server's counters; malloc'd. */
char *idem__server_metrics(idem_server *srv);

/* Tests: the wall clock (ms since the epoch) of the server's lease and expiry
 * arithmetic, e.g. a skewed one. Before the first listen. */
void idem__server_set_clock(idem_server *srv, uint64_t (*now_ms)(void *arg), void *arg);

/* ---- http.c ---- */
typedef struct idem_http idem_http;
idem_code idem__http_start(idem_server *srv, const char *url, size_t max_body,
                           const char *caller_header, size_t max_pending, idem_http **out);
int idem__http_port(const idem_http *h);
/* Stops the listener and frees it; NULL is a no-op. */
void idem__http_stop(idem_http *h);

#endif

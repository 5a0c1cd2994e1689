/* libFuzzer target: the bytes a client sends on one gRPC connection, after the HTTP/2
 * client preface (added here), through the front's nghttp2 server session
 * (grpc_session.c's callbacks, the bounds they check, grpc_answer.c's answers).
 *
 * Each request the session completes goes through the front's translation
 * (idem__grpc_request_frame), whose frame must decode as an idem.v1.Request naming the
 * same method, and is answered (alternately OK with a message, and an error with a
 * message that needs percent-encoding); then everything the session has to send is
 * drained, every stream's deadline is made to pass, and the session is freed. Every
 * byte counted against max_buffered must have been given back by then; anything else
 * abort()s, and so does any ASan/UBSan report.
 *
 *   bash scripts/fuzz.sh 60 fuzz_grpc   # seeds from tests/fuzz/corpus_grpc */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_conn.h"
#include "idemrpc.pb-c.h"

static void check_frame(const idem_greq *r)
{
    const char *err;
    size_t len;
    uint8_t *frame = idem__grpc_request_frame(r, "X-Caller", &len, &err);
    if (frame == NULL) {
        if (err == NULL || err[0] == '\0') {
            abort(); /* a refusal says why (out of memory aside: not under the fuzzer) */
        }
        return;
    }
    Idem__V1__Request *q = idem__v1__request__unpack(NULL, len, frame);
    if (q == NULL || strcmp(q->method, r->method) != 0 || q->payload.len != r->len) {
        abort();
    }
    idem__v1__request__free_unpacked(q, NULL);
    free(frame);
}

/* What the front and idem__gstream_answer do, without a socket. The answer's metadata
 * is freed right after, as the call's is: the session must have copied what it sends. */
static void answer_ready(idem_gconn *c)
{
    static unsigned n;
    while (c->ready != NULL) {
        idem_gstream *s = c->ready;
        c->ready = s->next_ready;
        idem_greq r = {s->path + 1, s->meta, s->n_meta, s->body + 5, s->blen - 5};
        check_frame(&r);
        idem_gkv tr[2] = {{strdup("x-request-id"), strdup("r")},
                          {strdup("idempotent-replayed"), strdup("true")}};
        idem_gans a = {.status = n % 2 ? IDEM_FAILED_PRECONDITION : IDEM_OK,
                       .message = "caf\xc3\xa9 100%\n",
                       .payload = "ok",
                       .len = 2,
                       .trailers = tr,
                       .n_trailers = 2};
        n++;
        s->with_front = false;
        c->refs--;
        if (s->closed) {
            idem__gstream_free(s);
        } else {
            idem__gsession_answer(s, &a);
        }
        for (int i = 0; i < 2; i++) {
            free((char *)tr[i].name);
            free((char *)tr[i].value);
        }
    }
}

static void drain(idem_gconn *c)
{
    for (int i = 0; i < 10000; i++) {
        const uint8_t *p;
        if (nghttp2_session_mem_send(c->ss, &p) <= 0) {
            return;
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    idem_gsrv srv = {.cfg = {.max_msg = 4096,
                             .max_streams = 8,
                             .max_header_list = 2048,
                             .window = 65535,
                             .request_timeout_ms = 1000,
                             .answer_timeout_ms = 1000,
                             .max_buffered = 16384}};
    idem_gconn c = {.srv = &srv};
    if (idem__gsession_new(&c) != 0 ||
        nghttp2_session_mem_recv(c.ss, (const uint8_t *)preface, sizeof(preface) - 1) < 0) {
        abort();
    }
    (void)nghttp2_session_mem_recv(c.ss, data, size); /* < 0: the connection would end */
    answer_ready(&c);
    drain(&c);
    (void)idem__gsession_expire(&c, UINT64_MAX - 1);
    drain(&c);
    answer_ready(&c); /* none: nothing becomes ready without input */
    idem__gsession_free_streams(&c);
    nghttp2_session_del(c.ss);
    if (atomic_load(&srv.buffered) != 0 || c.refs != 0) {
        abort();
    }
    return 0;
}

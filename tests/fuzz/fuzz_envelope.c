/* libFuzzer target: one request frame through the whole server path.
 *
 * An input that starts with "HTTP\n" is the raw bytes of an HTTP connection instead:
 * the front's strict parser frames them (http_parse.c: request line, header lines,
 * Content-Length or chunked body, pipelined requests) exactly as a connection does,
 * and each request it accepts goes through the front's translation
 * (idem__http_request_frame) and, when that accepts it, through the same server path.
 * A refusal must carry a status and a message; a head must not parse without its last
 * byte; the chunked decoder must stay inside its buffer.
 *
 * Every input goes through idem__server_serve_frame(): decoder and envelope checks,
 * request id and key resolution, token, result cache (claim, replay, mismatch, wait),
 * a handler, response encoding. One server lives for the whole run, so an input that
 * repeats an earlier one replays or mismatches as on a live server. The answer must
 * be a decodable idem.v1.Response with a non-empty request_id and a code in 0..16;
 * anything else abort()s, and so does any ASan/UBSan report.
 *
 * Run it:
 *   bash scripts/fuzz.sh              # 60 s, seeds from tests/fuzz/corpus
 *   bash scripts/fuzz.sh 3600         # an hour
 * Longer or parallel runs by hand, once fuzz.sh has built build-fuzz:
 *   build-fuzz/tests/fuzz/fuzz_envelope -jobs=2 -workers=2 -max_total_time=3600 \
 *       -max_len=70000 -timeout=10 build-fuzz/corpus-work tests/fuzz/corpus
 * Reproduce a crash: build-fuzz/tests/fuzz/fuzz_envelope CRASH_FILE
 *
 * The store is a scratch LMDB directory under $TMPDIR (else /tmp), opened with
 * IDEM_STORE_NOSYNC (speed; durability is not under test), re-created when it is 3/4
 * full so that cached methods keep running instead of answering "store full", and
 * removed at exit. A crash leaves it behind (libFuzzer _exits). */
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "call.h"
#include "idemrpc.pb-c.h"
#include "http_front.h"
#include "server_internal.h"

#define FUZZ_MAP_SIZE ((size_t)64 << 20)
#define FUZZ_MAX_FRAME ((size_t)64 << 10)
#define FUZZ_MAX_WAIT_MS 20  /* a duplicate of a stuck claim must not hit -timeout */
#define FUZZ_CHECK_EVERY 512 /* inputs between two store-fill checks */
#define FUZZ_MAX_PIPELINED 4 /* requests of one HTTP input served */
#define FUZZ_TXN_DB "fuzz.balances"

/* Tokens a seed can use without calling idem.Token/Issue first (issued tokens are
 * random, the fuzzer could never guess one). Re-put before every input. */
static const struct {
    const char *token, *caller;
    uint64_t expires_ms; /* 0: far future */
} seed_tokens[] = {
    {"fuzz-token-anon", "", 0},
    {"fuzz-token-svc", "svc.checkout", 0},
    {"fuzz-token-expired", "", 1},
};

static struct {
    char dir[256];
    idem_store *store;
    idem_server *srv;
    unsigned long inputs;
} fz;

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_envelope: %s: %s\n", what, detail);
    abort();
}

/* ---- handlers ---- */

/* The first payload byte chooses the outcome when it is a code (final codes are stored,
 * transient ones release the claim); any other payload answers OK with an echo. */
static idem_code payload_code(const idem_call *call)
{
    size_t n;
    const uint8_t *p = idem_call_payload(call, &n);
    return n > 0 && p[0] < IDEM_CODE_COUNT ? (idem_code)p[0] : IDEM_OK;
}

/* Request metadata becomes response metadata: fills the response up to its bounds. */
static void echo_metadata(idem_call *call)
{
    for (size_t i = 0; i < idem_call_metadata_count(call); i++) {
        const char *name, *value;
        idem_call_metadata_at(call, i, &name, &value);
        idem_call_set_response_metadata(call, name, value);
    }
}

static idem_code answer(idem_call *call)
{
    idem_code code = payload_code(call);
    size_t n;
    const void *p = idem_call_payload(call, &n);
    echo_metadata(call);
    if (code != IDEM_OK) {
        return idem_call_fail(call, code, "fuzz handler answers %s", idem_code_name(code));
    }
    return idem_call_reply(call, IDEM_OK, p, n);
}

static idem_code plain_handler(idem_call *call, void *arg)
{
    (void)arg;
    return answer(call);
}

/* Keeps the payload per key in its own database, in the claim's write transaction. */
static idem_code transfer_handler(idem_call *call, void *arg)
{
    (void)arg;
    idem_txn *txn = idem_call_txn(call);
    const char *key = idem_call_key(call);
    const void *old;
    size_t old_len, n;
    const void *p = idem_call_payload(call, &n);
    idem_code code;

    if (txn == NULL || key == NULL) {
        /* No key, no claim, no transaction: result_cache passed the call through. */
        return idem_call_fail(call, IDEM_FAILED_PRECONDITION, "transfer needs a key");
    }
    code = idem_txn_get(txn, FUZZ_TXN_DB, key, strlen(key), &old, &old_len);
    if (code != IDEM_OK && code != IDEM_NOT_FOUND) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    if ((code = idem_txn_put(txn, FUZZ_TXN_DB, key, strlen(key), p, n)) != IDEM_OK) {
        return idem_call_fail(call, code, "%s", idem_errmsg());
    }
    return answer(call);
}

/* "<payload up to a NUL>@alipay", like out_trade_no + channel of a payment callback. */
static bool payload_extractor(const idem_call *call, char *buf, size_t cap, void *arg)
{
    size_t n;
    const char *p = idem_call_payload(call, &n);
    if (n == 0) {
        return false;
    }
    snprintf(buf, cap, "%.*s@%s", (int)(n < cap ? n : cap), p, (const char *)arg);
    return true;
}

/* ---- the server ---- */

static void put_seed_tokens(void)
{
    for (size_t i = 0; i < IDEM_ARRAY_LEN(seed_tokens); i++) {
        uint64_t exp = seed_tokens[i].expires_ms ? seed_tokens[i].expires_ms : UINT64_MAX / 2;
        /* ALREADY_EXISTS while unused; re-created once a call has consumed it. */
        idem_store_token_put(fz.store, seed_tokens[i].token, seed_tokens[i].caller, exp);
    }
}

static void register_methods(idem_server *srv)
{
    static const idem_method_opts charge = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    static const idem_method_opts submit = {.flags = IDEM_METHOD_TOKEN_REQUIRED};
    static const idem_method_opts transfer = {.flags = IDEM_METHOD_TRANSACTIONAL};
    static const idem_method_opts callback = {
        .flags = IDEM_METHOD_CACHED, .extractor = payload_extractor, .extractor_arg = "alipay"};
    /* Records expire at once and a NOT_FOUND releases: the TTL and release paths. */
    static const idem_method_opts shortlived = {.flags = IDEM_METHOD_CACHED,
                                                .result_ttl_ms = 1,
                                                .lease_ms = 1,
                                                .transient_mask = IDEM_CODE_BIT(IDEM_NOT_FOUND) |
                                                                  IDEM_CODE_BIT(IDEM_UNAVAILABLE)};
    static const struct {
        const char *name;
        idem_handler_fn fn;
        const idem_method_opts *opts;
    } methods[] = {
        {"fuzz.Ledger/Charge", plain_handler, &charge},
        {"fuzz.Counter/Get", plain_handler, NULL},
        {"fuzz.Order/Submit", plain_handler, &submit},
        {"fuzz.Account/Transfer", transfer_handler, &transfer},
        {"fuzz.Pay/Callback", plain_handler, &callback},
        {"fuzz.Cache/ShortLived", plain_handler, &shortlived},
    };
    for (size_t i = 0; i < IDEM_ARRAY_LEN(methods); i++) {
        if (idem_server_register(srv, methods[i].name, methods[i].fn, NULL, methods[i].opts) !=
            IDEM_OK) {
            die("register", idem_errmsg());
        }
    }
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void server_stop(void)
{
    idem_server_destroy(fz.srv);
    idem_store_close(fz.store);
    fz.srv = NULL;
    fz.store = NULL;
    if (fz.dir[0] != '\0') {
        nftw(fz.dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
}

/* Opens a fresh store in fz.dir (created here the first time) and a server on it. */
static void server_start(void)
{
    if (fz.dir[0] == '\0') {
        const char *tmp = getenv("TMPDIR");
        snprintf(fz.dir, sizeof(fz.dir), "%s/idemrpc-fuzz.XXXXXX",
                 tmp != NULL && *tmp != '\0' ? tmp : "/tmp");
        if (mkdtemp(fz.dir) == NULL) {
            die("mkdtemp", fz.dir);
        }
        atexit(server_stop);
    }
    if (idem_store_open_lmdb(&fz.store, fz.dir, FUZZ_MAP_SIZE, IDEM_STORE_NOSYNC) != IDEM_OK) {
        die("open store", idem_errmsg());
    }
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.db_path = fz.dir; /* ignored: o.store is set */
    o.store = fz.store;
    o.map_size = FUZZ_MAP_SIZE;
    o.max_frame = FUZZ_MAX_FRAME;
    o.contexts = 1;
    o.workers = 1;
    o.max_wait_ms = FUZZ_MAX_WAIT_MS;
    if (idem_server_create(&fz.srv, &o) != IDEM_OK) {
        die("create server", idem_errmsg());
    }
    register_methods(fz.srv);
}

/* A full store answers every cached call RESOURCE_EXHAUSTED: start over before that. */
static void server_refresh_if_full(void)
{
    idem_store_stats st;
    fz.inputs++;
    if (fz.inputs % FUZZ_CHECK_EVERY != 0 || idem_store_stats_get(fz.store, &st) != IDEM_OK ||
        st.map_used < st.map_size / 4 * 3) {
        return;
    }
    server_stop();
    server_start();
}

/* ---- the target ---- */

static void check_response(nng_msg *out)
{
    if (out == NULL) {
        die("serve_frame", "no response message");
    }
    Idem__V1__Response *r = idem__v1__response__unpack(NULL, nng_msg_len(out), nng_msg_body(out));
    if (r == NULL) {
        die("response", "does not decode as idem.v1.Response");
    }
    if (r->request_id == NULL || r->request_id[0] == '\0') {
        die("response", "request_id is empty");
    }
    if ((int)r->code < 0 || (int)r->code >= IDEM_CODE_COUNT) {
        die("response", "code outside 0..16");
    }
    idem__v1__response__free_unpacked(r, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* One request through the fast path, then the whole chain as a worker runs it. */
static void serve(const uint8_t *data, size_t size)
{
    /* The callback's fast path first (it must answer or defer, never fail). */
    idem_served fast;
    if (idem__server_run(fz.srv, data, size, true, &fast)) {
        if (fast.call.request_id[0] == '\0' || (unsigned)fast.call.code >= IDEM_CODE_COUNT) {
            die("fast path", "answer without request id or with a bad code");
        }
        idem__server_done(fz.srv, &fast);
    }
    nng_msg *out = idem__server_serve_frame(fz.srv, data, size);
    check_response(out);
    nng_msg_free(out);
}

static void http_refusal(const idem_hp_err *err)
{
    if (err->msg == NULL || err->msg[0] == '\0' ||
        (err->status != 400 && err->status != 413 && err->status != 414 && err->status != 417 &&
         err->status != 505)) {
        die("http", "a refusal without a message or with another status");
    }
}

/* The body of the request whose head is r, at buf[head_len..len): false when it is not
 * complete (or refused); else *used is the request's length. */
static bool http_body(char *buf, size_t len, const idem_hreq *r, size_t *blen, size_t *used)
{
    idem_hp_err err;
    if (!r->chunked) {
        if (r->content_length > len - r->head_len) {
            return false;
        }
        *blen = (size_t)r->content_length;
        *used = r->head_len + *blen;
        return true;
    }
    idem_hchunk ck = {0};
    idem_hp hp = idem__http_dechunk(buf + r->head_len, len - r->head_len, &ck, FUZZ_MAX_FRAME,
                                    &err);
    if (ck.wpos > ck.rpos || ck.rpos > len - r->head_len) {
        die("http", "the chunked decoder left its buffer");
    }
    if (hp == IDEM_HP_BAD) {
        http_refusal(&err);
    }
    *blen = ck.wpos;
    *used = r->head_len + ck.rpos;
    return hp == IDEM_HP_OK;
}

/* The head parsed as the front parses it, as its bytes arrive: resumed after every
 * step bytes (idem__http_parse_head_more) it must end as the parse of all of them did. */
static void http_head_in_steps(const char *buf, size_t len, idem_hp whole, const idem_hreq *w)
{
    idem_hreq r;
    idem_hp_err err;
    idem_hp hp = IDEM_HP_MORE;
    size_t step = len % 7 + 1, at = 0;
    memset(&r, 0, sizeof(r));
    while (hp == IDEM_HP_MORE && at < len) {
        at = at + step < len ? at + step : len;
        hp = idem__http_parse_head_more(buf, at, &r, &err);
    }
    if (hp != whole || (hp == IDEM_HP_OK && (r.head_len != w->head_len || r.nf != w->nf ||
                                             r.content_length != w->content_length))) {
        die("http", "a head parsed as it arrives ends otherwise than parsed at once");
    }
}

/* The next request framed from buf[0..len) as the HTTP front frames it (http_parse.c):
 * false when there is none (incomplete or refused: the connection would end); else
 * *frame is what the front hands to the workers (NULL: refused with a 400 by the
 * translation, the connection goes on) and *used its length in buf. */
static bool http_next(char *buf, size_t len, size_t *used, uint8_t **frame, size_t *flen)
{
    idem_hreq r, again;
    idem_hp_err err;
    size_t blen;
    idem_hp hp = idem__http_parse_head(buf, len, &r, &err);
    http_head_in_steps(buf, len, hp, &r);
    *frame = NULL;
    if (hp == IDEM_HP_BAD) {
        http_refusal(&err);
    }
    if (hp != IDEM_HP_OK) {
        return false;
    }
    if (r.head_len > len || (r.chunked && r.content_length != 0) ||
        idem__http_parse_head(buf, r.head_len - 1, &again, &err) == IDEM_HP_OK) {
        die("http", "a head longer than its input, framed twice, or complete without its end");
    }
    if (!http_body(buf, len, &r, &blen, used)) {
        return false;
    }
    const char *e = NULL;
    *frame = idem__http_request_frame(&r, "X-Caller", buf + r.head_len, blen, flen, &e);
    if (*frame == NULL && (e == NULL || e[0] == '\0')) {
        die("http", "a refused request without a message");
    }
    return true;
}

/* A copy of data[0..size) that ends where a PROT_NONE page begins, as a connection's
 * buffer may end where its allocation does: a read past the bytes faults whether or not
 * the reader is instrumented (a string search on the unterminated target read on to the
 * next NUL, and failed only when the heap happened to end there). NULL when out of maps. */
static char *at_page_end(const uint8_t *data, size_t size, void **map, size_t *maplen)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    *maplen = (size + page - 1) / page * page + page;
    *map = mmap(NULL, *maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (*map == MAP_FAILED) {
        return NULL;
    }
    char *guard = (char *)*map + *maplen - page;
    if (mprotect(guard, page, PROT_NONE) != 0) {
        munmap(*map, *maplen);
        return NULL;
    }
    memcpy(guard - size, data, size);
    return guard - size;
}

/* An "HTTP\n" input: the rest is the raw bytes of a connection; each request the front
 * would hand over (at most FUZZ_MAX_PIPELINED) goes through the server path. */
static void http_input(const uint8_t *data, size_t size)
{
    void *map;
    size_t maplen;
    char *buf = at_page_end(data, size, &map, &maplen);
    if (buf == NULL) {
        return;
    }
    size_t off = 0, used, flen;
    uint8_t *frame;
    for (int i = 0; i < FUZZ_MAX_PIPELINED && http_next(buf + off, size - off, &used, &frame, &flen);
         i++) {
        if (frame != NULL) {
            serve(frame, flen);
            free(frame);
        }
        off += used;
    }
    munmap(map, maplen);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char tag[] = "HTTP\n";
    if (fz.srv == NULL) {
        server_start();
    }
    server_refresh_if_full();
    put_seed_tokens();
    if (size >= sizeof(tag) - 1 && memcmp(data, tag, sizeof(tag) - 1) == 0) {
        http_input(data + sizeof(tag) - 1, size - (sizeof(tag) - 1));
    } else {
        serve(data, size);
    }
    return 0;
}

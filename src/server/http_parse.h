/* A strict HTTP/1.1 request parser (http_parse.c): pure functions over bytes, no I/O.
 *
 * The HTTP front reads the raw byte stream itself (http_conn.c) and frames every request
 * here, so that what a gateway in front frames as one request is one request here or
 * is refused: both Content-Length and Transfer-Encoding, a transfer coding other than
 * "chunked", a repeated or non-numeric Content-Length, obsolete line folding, a bare
 * CR or LF, a control byte, a space before a colon, a repeated or missing Host, lines
 * and header sections over the bounds below. README "Security" lists them. */
#ifndef IDEMRPC_HTTP_PARSE_H
#define IDEMRPC_HTTP_PARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define IDEM_HTTP_MAX_LINE 8192   /* request line, a header line, a chunk-size line */
#define IDEM_HTTP_MAX_HEAD 32768  /* request line and header section with their CRLFs */
#define IDEM_HTTP_MAX_FIELDS 64   /* header lines; trailer lines of a chunked body */
#define IDEM_HTTP_MAX_CHUNK_HEX 8 /* hex digits of a chunk size (below 4 GiB) */
/* Bytes of chunk-size lines (with extensions) and trailers of one body, beyond the data
 * bytes decoded so far. */
#define IDEM_HTTP_MAX_CHUNK_FRAMING 65536

typedef enum { IDEM_HP_MORE, IDEM_HP_OK, IDEM_HP_BAD } idem_hp;

typedef struct idem_hfield {
    const char *name, *value; /* into the parsed buffer, not NUL-terminated */
    size_t nlen, vlen;        /* value without its surrounding spaces and tabs */
} idem_hfield;

typedef struct idem_hreq {
    const char *method, *target;
    size_t mlen, tlen;
    int minor; /* HTTP/1.<minor> */
    idem_hfield f[IDEM_HTTP_MAX_FIELDS];
    size_t nf;
    size_t head_len; /* bytes up to and including the empty line */
    bool chunked;
    uint64_t content_length; /* 0 when chunked or absent */
    bool keep_alive;         /* HTTP/1.1 without "Connection: close" */
    bool expect_continue;
    /* Progress of a head parsed as its bytes arrive: the lines before pos are parsed,
     * seen bytes after it scanned (idem__http_parse_head_more). */
    size_t pos, seen;
} idem_hreq;

/* A refusal: the status to answer (400, 413, 414, 417, 505) and why. */
typedef struct idem_hp_err {
    int status;
    const char *msg;
} idem_hp_err;

/* Parses the head at buf[0..len): MORE when it is not complete yet (and within the
 * bounds), OK with *r filled (pointers into buf), BAD with *err. */
idem_hp idem__http_parse_head(const char *buf, size_t len, idem_hreq *r, idem_hp_err *err);
/* The same, resumed where the last call on r (zeroed before the head's first bytes) left
 * off when buf[0..len) is what it saw and more: each byte is scanned once, so a head
 * arriving a byte at a time costs what it costs at once. */
idem_hp idem__http_parse_head_more(const char *buf, size_t len, idem_hreq *r, idem_hp_err *err);
/* The target's path, without its query or fragment (*len bytes, into the buffer): of the
 * origin-form "/a/b?q", "/a/b"; of the absolute-form "http://host/a/b" (RFC 9112 3.2.2),
 * "/a/b", and "" when the authority ends at '?', '#' or the target's end (RFC 3986 3.3). */
const char *idem__http_target_path(const idem_hreq *r, size_t *len);
/* The head's bytes moved from `from` (still readable) to `to`: r points into `to`. */
void idem__http_head_moved(idem_hreq *r, const char *from, const char *to);

/* The state of a chunked body being decoded in place. */
typedef struct idem_hchunk {
    size_t rpos, wpos; /* raw bytes consumed; decoded bytes written at the start */
    uint64_t left;     /* data bytes left in the current chunk */
    int state;
    size_t trailers;
    size_t framing; /* bytes of size lines and trailer lines so far */
    size_t seen;    /* bytes of the line at rpos already scanned */
} idem_hchunk;

/* Decodes the chunked body at buf[0..len) in place: the data moves to buf[0..wpos).
 * MORE: needs more bytes (buf[wpos..rpos) is free, the caller may drop it by moving
 * buf[rpos..len) down to wpos and setting rpos = wpos); OK: the body is buf[0..wpos)
 * and the request ends at rpos; BAD with *err (413 once the data passes max_body). */
idem_hp idem__http_dechunk(char *buf, size_t len, idem_hchunk *c, uint64_t max_body,
                           idem_hp_err *err);

/* How many fields are named name (case-insensitive); the first one's value in *v. */
size_t idem__http_field(const idem_hreq *r, const char *name, const char **v, size_t *vlen);

#endif

/* A strict HTTP/1.1 request parser (RFC 9112), see http_parse.h.
 *
 * Where RFC 9112 lets a server choose between accepting and refusing, this refuses:
 * a bare LF is not a line end (§2.2), obsolete line folding is refused (§5.2), a
 * request with both Transfer-Encoding and Content-Length is refused rather than framed
 * by the former (§6.1, §6.3), a Content-Length list of equal values is refused like any
 * other list (§8.6). What is refused never becomes a request, and nothing after it on
 * the connection is read as one: the front closes the connection. */
#include <ctype.h>
#include <string.h>
#include <strings.h>

#include "http_parse.h"

enum { CK_SIZE, CK_DATA, CK_DATA_END, CK_TRAILER, CK_DONE };

static const char *const bad_cr = "a CR not followed by LF";
static const char *const too_long = "a line over the length bound";

static bool is_tchar(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

/* A field value byte: HTAB, SP, visible ASCII, obs-text. */
static bool is_vchar(unsigned char c)
{
    return c == '\t' || (c >= 0x20 && c != 0x7f);
}

static idem_hp bad(idem_hp_err *err, int status, const char *msg)
{
    err->status = status;
    err->msg = msg;
    return IDEM_HP_BAD;
}

/* The line at buf[pos..len): OK with *end at its CR (the LF follows), MORE, or BAD for a
 * bare CR or LF or a line over max bytes. *seen counts the bytes of the line already
 * scanned by an earlier call that returned MORE (they are not scanned again); it is
 * relative to pos, so it stays true when the line moves. OK sets it back to 0. */
static idem_hp find_line(const char *buf, size_t pos, size_t len, size_t max, size_t *end,
                         size_t *seen, idem_hp_err *err)
{
    for (size_t i = pos + *seen; i < len; i++) {
        if (i - pos > max) {
            return bad(err, 400, too_long);
        }
        if (buf[i] == '\n') {
            return bad(err, 400, "a bare LF (lines end with CRLF)");
        }
        if (buf[i] == '\r') {
            if (i + 1 == len) {
                *seen = i - pos; /* the CR is looked at again with the next byte */
                return IDEM_HP_MORE;
            }
            if (buf[i + 1] != '\n') {
                return bad(err, 400, bad_cr);
            }
            *end = i;
            *seen = 0;
            return IDEM_HP_OK;
        }
    }
    *seen = len - pos;
    return len - pos > max ? bad(err, 400, too_long) : IDEM_HP_MORE;
}

/* method SP request-target SP HTTP-version, exactly. */
static idem_hp request_line(const char *s, size_t n, idem_hreq *r, idem_hp_err *err)
{
    size_t i = 0;
    while (i < n && is_tchar((unsigned char)s[i])) {
        i++;
    }
    if (i == 0 || i > 32 || i == n || s[i] != ' ') {
        return bad(err, 400, "a malformed request line (method)");
    }
    r->method = s;
    r->mlen = i++;
    size_t t = i;
    while (i < n && (unsigned char)s[i] > 0x20 && (unsigned char)s[i] < 0x7f) {
        i++;
    }
    if (i == t || i == n || s[i] != ' ') {
        return bad(err, 400, "a malformed request line (target)");
    }
    r->target = s + t;
    r->tlen = i - t;
    const char *v = s + i + 1;
    if (n - i - 1 != 8 || strncmp(v, "HTTP/", 5) != 0 || v[5] < '0' || v[5] > '9' || v[6] != '.' ||
        v[7] < '0' || v[7] > '9') {
        return bad(err, 400, "a malformed request line (version)");
    }
    if (v[5] != '1') {
        return bad(err, 505, "only HTTP/1.x is served");
    }
    r->minor = v[7] - '0';
    return IDEM_HP_OK;
}

/* field-name ":" OWS field-value OWS; folding, a space before the colon, a control
 * byte are refused. */
static idem_hp field_line(const char *s, size_t n, idem_hfield *f, idem_hp_err *err)
{
    if (s[0] == ' ' || s[0] == '\t') {
        return bad(err, 400, "obsolete line folding");
    }
    size_t i = 0;
    while (i < n && is_tchar((unsigned char)s[i])) {
        i++;
    }
    if (i == 0 || i == n || s[i] != ':') {
        return bad(err, 400, "a malformed header line (name, or a space before the colon)");
    }
    f->name = s;
    f->nlen = i++;
    while (i < n && (s[i] == ' ' || s[i] == '\t')) {
        i++;
    }
    size_t e = n;
    while (e > i && (s[e - 1] == ' ' || s[e - 1] == '\t')) {
        e--;
    }
    for (size_t k = i; k < e; k++) {
        if (!is_vchar((unsigned char)s[k])) {
            return bad(err, 400, "a control byte in a header value");
        }
    }
    f->value = s + i;
    f->vlen = e - i;
    return IDEM_HP_OK;
}

size_t idem__http_field(const idem_hreq *r, const char *name, const char **v, size_t *vlen)
{
    size_t count = 0, nl = strlen(name);
    for (size_t i = 0; i < r->nf; i++) {
        if (r->f[i].nlen == nl && strncasecmp(r->f[i].name, name, nl) == 0 && count++ == 0) {
            *v = r->f[i].value;
            *vlen = r->f[i].vlen;
        }
    }
    return count;
}

/* A name that a lenient peer may take for name (e.g. Content_Length). */
static bool looks_like(const idem_hfield *f, const char *name)
{
    if (f->nlen != strlen(name) || memchr(f->name, '_', f->nlen) == NULL) {
        return false;
    }
    for (size_t i = 0; i < f->nlen; i++) {
        char c = f->name[i] == '_' ? '-' : f->name[i];
        if ((c | 0x20) != (name[i] | 0x20)) {
            return false;
        }
    }
    return true;
}

/* Does the comma-separated list v contain token tok (case-insensitive)? */
static bool has_token(const char *v, size_t n, const char *tok)
{
    size_t tl = strlen(tok);
    for (size_t i = 0; i < n;) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ',')) {
            i++;
        }
        size_t s = i;
        while (i < n && v[i] != ',' && v[i] != ' ' && v[i] != '\t') {
            i++;
        }
        if (i - s == tl && strncasecmp(v + s, tok, tl) == 0) {
            return true;
        }
    }
    return false;
}

/* Message framing (§6): exactly one of nothing, one plain Content-Length, or
 * Transfer-Encoding: chunked alone. */
static idem_hp framing(idem_hreq *r, idem_hp_err *err)
{
    const char *te = NULL, *cl = NULL;
    size_t tel = 0, cll = 0;
    size_t nte = idem__http_field(r, "Transfer-Encoding", &te, &tel);
    size_t ncl = idem__http_field(r, "Content-Length", &cl, &cll);
    for (size_t i = 0; i < r->nf; i++) {
        if (looks_like(&r->f[i], "Transfer-Encoding") || looks_like(&r->f[i], "Content-Length")) {
            return bad(err, 400,
                       "a header name that imitates Content-Length or "
                       "Transfer-Encoding");
        }
    }
    if (nte > 0 && ncl > 0) {
        return bad(err, 400, "both Transfer-Encoding and Content-Length");
    }
    if (nte > 1 || (nte == 1 && (r->minor == 0 || tel != 7 || strncasecmp(te, "chunked", 7)))) {
        return bad(err, 400,
                   "a Transfer-Encoding other than one \"chunked\" on HTTP/1.1 "
                   "(not implemented)");
    }
    r->chunked = nte == 1;
    if (ncl > 1) {
        return bad(err, 400, "more than one Content-Length");
    }
    r->content_length = 0;
    if (ncl == 1) {
        if (cll == 0 || cll > 18 || strspn(cl, "0123456789") < cll) {
            return bad(err, 400, "a Content-Length that is not one plain decimal number");
        }
        for (size_t i = 0; i < cll; i++) {
            r->content_length = r->content_length * 10 + (uint64_t)(cl[i] - '0');
        }
    }
    return IDEM_HP_OK;
}

/* Host, Connection, Expect. */
static idem_hp semantics(idem_hreq *r, idem_hp_err *err)
{
    const char *v;
    size_t vl;
    size_t hosts = idem__http_field(r, "Host", &v, &vl);
    if (hosts > 1 || (hosts == 0 && r->minor >= 1)) {
        return bad(err, 400, hosts > 1 ? "more than one Host" : "an HTTP/1.1 request without Host");
    }
    for (size_t i = 0; hosts == 1 && i < vl; i++) { /* uri-host [ ":" port ] (§3.2) */
        if (!isalnum((unsigned char)v[i]) && strchr("-._~%!$&'()*+,;=:[]", v[i]) == NULL) {
            return bad(err, 400, "a Host that is not a host and port");
        }
    }
    r->keep_alive = r->minor >= 1;
    for (size_t i = 0; i < r->nf; i++) {
        if (r->f[i].nlen == 10 && strncasecmp(r->f[i].name, "Connection", 10) == 0 &&
            has_token(r->f[i].value, r->f[i].vlen, "close")) {
            r->keep_alive = false;
        }
    }
    r->expect_continue = false;
    size_t expects = idem__http_field(r, "Expect", &v, &vl);
    if (expects > 1 || (expects == 1 && (vl != 12 || strncasecmp(v, "100-continue", 12) != 0))) {
        return bad(err, 417, "the only expectation served is one 100-continue");
    }
    r->expect_continue = expects == 1 && r->minor >= 1;
    return framing(r, err);
}

/* The request line, after the empty lines that may precede it. */
static idem_hp parse_request_line(const char *buf, size_t len, idem_hreq *r, idem_hp_err *err)
{
    size_t end;
    while (r->seen == 0 && len - r->pos >= 2 && buf[r->pos] == '\r' && buf[r->pos + 1] == '\n') {
        r->pos += 2; /* empty lines before a request are ignored (§2.2) */
    }
    idem_hp hp = find_line(buf, r->pos, len, IDEM_HTTP_MAX_LINE, &end, &r->seen, err);
    if (hp != IDEM_HP_OK) {
        if (hp == IDEM_HP_BAD && err->msg == too_long) {
            return bad(err, 414, "a request line over the length bound"); /* §3 */
        }
        return hp == IDEM_HP_MORE && len > IDEM_HTTP_MAX_HEAD
                   ? bad(err, 400, "a request head over the size bound")
                   : hp;
    }
    if ((hp = request_line(buf + r->pos, end - r->pos, r, err)) == IDEM_HP_OK) {
        r->pos = end + 2;
    }
    return hp;
}

idem_hp idem__http_parse_head_more(const char *buf, size_t len, idem_hreq *r, idem_hp_err *err)
{
    size_t end;
    idem_hp hp;
    if (r->method == NULL && (hp = parse_request_line(buf, len, r, err)) != IDEM_HP_OK) {
        return hp;
    }
    for (;;) {
        if (r->pos > IDEM_HTTP_MAX_HEAD) {
            return bad(err, 400, "a request head over the size bound");
        }
        hp = find_line(buf, r->pos, len, IDEM_HTTP_MAX_LINE, &end, &r->seen, err);
        if (hp != IDEM_HP_OK) {
            return hp;
        }
        if (end == r->pos) {
            break;
        }
        if (r->nf == IDEM_HTTP_MAX_FIELDS) {
            return bad(err, 400, "more header lines than the bound");
        }
        if ((hp = field_line(buf + r->pos, end - r->pos, &r->f[r->nf++], err)) != IDEM_HP_OK) {
            return hp;
        }
        r->pos = end + 2;
    }
    r->head_len = end + 2;
    if (r->head_len > IDEM_HTTP_MAX_HEAD) {
        return bad(err, 400, "a request head over the size bound");
    }
    return semantics(r, err);
}

idem_hp idem__http_parse_head(const char *buf, size_t len, idem_hreq *r, idem_hp_err *err)
{
    memset(r, 0, sizeof(*r));
    return idem__http_parse_head_more(buf, len, r, err);
}

void idem__http_head_moved(idem_hreq *r, const char *from, const char *to)
{
    if (r->method == NULL) {
        return;
    }
    r->method = to + (r->method - from);
    r->target = to + (r->target - from);
    for (size_t i = 0; i < r->nf; i++) {
        r->f[i].name = to + (r->f[i].name - from);
        r->f[i].value = to + (r->f[i].value - from);
    }
}

/* chunk-size [ chunk-ext ] CRLF: at most IDEM_HTTP_MAX_CHUNK_HEX hex digits. */
static idem_hp chunk_size(const char *s, size_t n, uint64_t *size, idem_hp_err *err)
{
    size_t i = 0;
    *size = 0;
    for (; i < n && strchr("0123456789abcdefABCDEF", s[i]) != NULL && s[i] != '\0'; i++) {
        if (i == IDEM_HTTP_MAX_CHUNK_HEX) {
            return bad(err, 400, "a chunk size over the bound");
        }
        char c = s[i];
        *size = *size * 16 + (uint64_t)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    if (i == 0 || (i < n && s[i] != ';' && s[i] != ' ' && s[i] != '\t')) {
        return bad(err, 400, "a malformed chunk size");
    }
    for (; i < n; i++) { /* extensions are ignored, but must be field bytes */
        if (!is_vchar((unsigned char)s[i])) {
            return bad(err, 400, "a control byte in a chunk extension");
        }
    }
    return IDEM_HP_OK;
}

/* One step of the decoder at buf[c->rpos..len). */
static idem_hp dechunk_step(char *buf, size_t len, idem_hchunk *c, uint64_t max_body,
                            idem_hp_err *err)
{
    size_t end;
    idem_hp hp;
    idem_hfield f;
    if (c->state == CK_DATA) {
        size_t n = len - c->rpos < c->left ? len - c->rpos : (size_t)c->left;
        if (n == 0) {
            return IDEM_HP_MORE;
        }
        memmove(buf + c->wpos, buf + c->rpos, n);
        c->wpos += n;
        c->rpos += n;
        c->left -= n;
        c->state = c->left == 0 ? CK_DATA_END : CK_DATA;
        return IDEM_HP_OK;
    }
    if (c->state == CK_DATA_END) {
        if (len - c->rpos < 2) {
            return IDEM_HP_MORE;
        }
        if (buf[c->rpos] != '\r' || buf[c->rpos + 1] != '\n') {
            return bad(err, 400, "chunk data not followed by CRLF");
        }
        c->rpos += 2;
        c->state = CK_SIZE;
        return IDEM_HP_OK;
    }
    hp = find_line(buf, c->rpos, len, IDEM_HTTP_MAX_LINE, &end, &c->seen, err);
    if (hp != IDEM_HP_OK) {
        return hp;
    }
    c->framing += end + 2 - c->rpos;
    if (c->framing > IDEM_HTTP_MAX_CHUNK_FRAMING + c->wpos) {
        return bad(err, 400,
                   "more chunk framing (size lines, extensions, trailers) than the bound");
    }
    if (c->state == CK_SIZE) {
        if ((hp = chunk_size(buf + c->rpos, end - c->rpos, &c->left, err)) != IDEM_HP_OK) {
            return hp;
        }
        if (c->left > max_body || c->wpos + c->left > max_body) {
            return bad(err, 413, "a chunked body over the size limit");
        }
        c->state = c->left == 0 ? CK_TRAILER : CK_DATA;
    } else if (end == c->rpos) {
        c->state = CK_DONE;
    } else if (++c->trailers > IDEM_HTTP_MAX_FIELDS) {
        return bad(err, 400, "more trailer lines than the bound");
    } else if ((hp = field_line(buf + c->rpos, end - c->rpos, &f, err)) != IDEM_HP_OK) {
        return hp; /* trailer fields are checked, then ignored */
    }
    c->rpos = end + 2;
    return IDEM_HP_OK;
}

idem_hp idem__http_dechunk(char *buf, size_t len, idem_hchunk *c, uint64_t max_body,
                           idem_hp_err *err)
{
    while (c->state != CK_DONE) {
        idem_hp hp = dechunk_step(buf, len, c, max_body, err);
        if (hp != IDEM_HP_OK) {
            return hp;
        }
    }
    return IDEM_HP_OK;
}

const char *idem__http_target_path(const idem_hreq *r, size_t *len)
{
    const char *t = r->target, *end = r->target + r->tlen;
    /* t is not NUL-terminated: the scheme by its length, never a string search */
    size_t scheme = r->tlen > 7 && strncasecmp(t, "http://", 7) == 0    ? 7
                    : r->tlen > 8 && strncasecmp(t, "https://", 8) == 0 ? 8
                                                                        : 0;
    if (scheme > 0) {
        for (t += scheme; t < end && *t != '/' && *t != '?' && *t != '#'; t++) {
        }
    }
    size_t n = 0;
    while (t + n < end && t[n] != '?' && t[n] != '#') {
        n++;
    }
    *len = n;
    return t;
}

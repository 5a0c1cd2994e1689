/* JSON string literals: what any text a client sent needs before it is echoed in JSON. */
#include <string.h>

#include "json.h"

/* The escaped form of byte c into buf (at most 7 bytes + NUL); its length. */
static size_t escape(unsigned char c, char buf[8])
{
    if (c == '"' || c == '\\') {
        buf[0] = '\\', buf[1] = (char)c, buf[2] = '\0';
        return 2;
    }
    if (c < 0x20) {
        return (size_t)snprintf(buf, 8, "\\u%04x", c);
    }
    buf[0] = (char)c, buf[1] = '\0';
    return 1;
}

bool idem__json_string(char *out, size_t cap, const char *s)
{
    size_t o = 0;
    char e[8];
    if (cap < 3) {
        return false;
    }
    out[o++] = '"';
    for (; *s != '\0'; s++) {
        size_t n = escape((unsigned char)*s, e);
        if (o + n + 2 > cap) {
            return false;
        }
        memcpy(out + o, e, n);
        o += n;
    }
    out[o++] = '"';
    out[o] = '\0';
    return true;
}

void idem__json_fputs(FILE *f, const char *s)
{
    char e[8];
    fputc('"', f);
    for (; *s != '\0'; s++) {
        escape((unsigned char)*s, e);
        fputs(e, f);
    }
    fputc('"', f);
}

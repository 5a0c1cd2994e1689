/* JSON string literals (json.c): the one escaper for the HTTP front, idemctl and bench.
 * Self-contained (no other idemrpc header), so the tools compile it too. */
#ifndef IDEMRPC_JSON_H
#define IDEMRPC_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

/* s as a JSON string literal, quotes included, into out (NUL-terminated); false when
 * it does not fit in cap bytes. Quotes, backslashes and control characters are
 * escaped; other bytes (UTF-8) pass through. */
bool idem__json_string(char *out, size_t cap, const char *s);
/* The same literal, written to f. */
void idem__json_fputs(FILE *f, const char *s);

#endif

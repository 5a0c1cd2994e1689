/* idemctl's parsed command line (idemctl_args.c), shared with the commands (idemctl.c). */
#ifndef IDEMCTL_H
#define IDEMCTL_H

#include <stdbool.h>
#include <stdio.h>

typedef struct args {
    /* The store: exactly one of db (an LMDB directory) and pg (a libpq conninfo). */
    const char *db, *pg, *cmd, *caller, *state, *method, *key;
    const char *digest; /* show --digest: lowercase hex prefix of SHA-256(key) */
    bool json, force, expired, caller_set, limit_set;
    bool lapsed;   /* list: IN_PROGRESS records whose lease has passed */
    long older_ms; /* list: IN_PROGRESS records claimed at least this long ago; -1 = any */
    long limit;
} args;

/* The outbox verb (idemctl_queues.c): exit status 0 or 1. */
struct idem_store;
int idemctl_outbox(struct idem_store *st, const args *a);

/* Prints the usage text to f. */
void idemctl_usage(FILE *f);
/* True to run; false with *status the exit status (0 after --help, 2 after a usage
 * error). */
bool idemctl_parse(int argc, char **argv, args *a, int *status);

#endif

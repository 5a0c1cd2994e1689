/* idemctl's parsed command line (idemctl_args.c), shared with the commands (idemctl.c). */
#ifndef IDEMCTL_H
#define IDEMCTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct args {
    /* The store: exactly one of db (an LMDB directory) and pg (a libpq conninfo). */
    const char *db, *pg, *cmd, *caller, *state, *method, *key;
    const char *digest; /* show --digest: lowercase hex prefix of SHA-256(key) */
    bool json, force, expired, caller_set, limit_set;
    bool pooler;   /* --pg through a transaction-mode pooler: idem_pg_opts.pooler */
    bool lapsed;   /* list: IN_PROGRESS records whose lease has passed */
    long older_ms; /* list: IN_PROGRESS records claimed at least this long ago; -1 = any */
    long limit;
} args;

/* The queue verbs (idemctl_queues.c): exit status 0 or 1. markers takes its GROUP in
 * a->method (the first positional argument). */
struct idem_store;
int idemctl_outbox(struct idem_store *st, const args *a);
int idemctl_markers(struct idem_store *st, const args *a);
/* The first `shown` bytes of bytes as text: printable ASCII as is, every other byte and
 * '\' as \xHH. out holds 4·shown + 1 (idemctl_queues.c). */
void idemctl_escape(const void *bytes, size_t len, size_t shown, char *out);
/* The dead-letter verbs (idemctl_dead.c): wanted when the command line names --nats;
 * main parses it itself and returns the exit status. */
bool idemctl_dead_wanted(int argc, char **argv);
int idemctl_dead_main(int argc, char **argv);
/* Tombstones (idemctl_tomb.c): show prints the key's (a->caller, method, key) and says
 * whether it has one; delete deletes it (exit status 0 or 1, reported). */
bool idemctl_show_tomb(struct idem_store *st, const args *a);
int idemctl_delete_tomb(struct idem_store *st, const args *a);
/* list --state tombstone: the tombstones (on LMDB named by their key's hash). */
int idemctl_list_tombs(struct idem_store *st, const args *a);
/* journals (idemctl_journal.c): the calls the re-driver holds; exit status 0 or 1. */
int idemctl_journals(struct idem_store *st, const args *a);
/* show: the journal of rec's request after its record (JSON: the value of "journal");
 * false when it could not be read (reported). */
struct idem_key_ref;
struct idem_record;
bool idemctl_show_journal(struct idem_store *st, const struct idem_key_ref *k,
                          const struct idem_record *rec, bool json);
/* show METHOD KEY of a key without a record: prints the journals the re-driver holds
 * under it (a call released with its journal); false when there are none. */
bool idemctl_show_listed(struct idem_store *st, const args *a);
/* The clock rec's times are judged on (the store's), and its lease: live, lapsed, "-". */
uint64_t idemctl_store_now(const struct idem_record *rec);
const char *idemctl_lease_name(const struct idem_record *rec);
/* A key's "caller":…,"method":…,"key":… members (JSON-escaped), to stdout. */
void idemctl_json_key(const char *caller, const char *method, const char *key);
/* ms since the epoch as an ISO 8601 UTC time, to stdout. */
void idemctl_print_time(uint64_t ms);

/* Prints the usage text to f. */
void idemctl_usage(FILE *f);
/* True to run; false with *status the exit status (0 after --help, 2 after a usage
 * error). */
bool idemctl_parse(int argc, char **argv, args *a, int *status);

#endif

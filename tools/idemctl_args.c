/* idemctl's command line: the options, the positional arguments (command, method, key)
 * and the checks of which command takes which; idemctl.c runs the command. */
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "idemctl.h"

void idemctl_usage(FILE *f)
{
    fprintf(f, "usage: idemctl STORE [--json] stats\n"
               "       idemctl STORE [--json] list [--caller C]"
               " [--state in_progress|completed|tombstone] [--limit N]\n"
               "                                   [--lapsed] [--older-ms MS]\n"
               "       idemctl STORE [--json] show METHOD KEY [--caller C]\n"
               "       idemctl STORE [--json] show --digest HEX [--caller C]\n"
               "       idemctl STORE [--json] outbox [--limit N]\n"
               "       idemctl STORE [--json] markers GROUP [--limit N]\n"
               "       idemctl STORE [--json] journals [--limit N]\n"
               "       idemctl --nats URL [--json] dead list STREAM [--limit N] [--from SEQ]\n"
               "       idemctl --nats URL [--json] dead replay|purge STREAM SEQ|--all [--yes]\n"
               "       idemctl STORE [--json] purge --expired\n"
               "       idemctl STORE [--json] delete METHOD KEY [--caller C] [--force]\n"
               "  STORE is --db DIR (LMDB) or --pg CONNINFO (PostgreSQL, a libpq conninfo as\n"
               "  the servers take it: 'host=H dbname=D' or postgres://...); --pooler: a pooler\n"
               "  in transaction mode (PgBouncer) is in front of it (no prepared statements);\n"
               "  options may come before or after the command; --limit defaults to 100;\n"
               "  show without --caller finds the record of any caller; --digest HEX finds\n"
               "  records by the key digest of a log line (key=HEX, a SHA-256 prefix);\n"
               "  show and delete with --caller: a key whose result expired and left a\n"
               "  tombstone shows it, and delete deletes it; list --state tombstone lists\n"
               "  tombstones (LMDB keeps only a hash of their key: KEY is that hash);\n"
               "  list --lapsed: calls in progress whose lease has passed (their owner stopped\n"
               "  renewing it); --older-ms MS: calls in progress claimed MS or more ago (both on\n"
               "  the store's clock: PostgreSQL's, this host's for LMDB);\n"
               "  outbox: messages not yet relayed, and the oldest (--limit N: the oldest N);\n"
               "  markers GROUP: the consume markers of a group not purged yet, and the oldest\n"
               "  (counts up to --limit N, default 100000, one read each);\n"
               "  dead: the dead letters a NATS consumer put in STREAM, with their reasons;\n"
               "  replay publishes one (or --all) again to its subject, purge removes it; both\n"
               "  ask on a terminal, else need --yes (exit 3 when not confirmed);\n"
               "  journals: the journaled calls the re-driver holds, their steps, compensation,\n"
               "  record, owner, lease and age (show prints a record's journal too);\n"
               "  idemctl --version prints the version\n");
}

/* The positional arguments each command takes after its name. */
static bool check_positionals(const args *a, int npos)
{
    bool show = strcmp(a->cmd, "show") == 0;
    if (a->digest != NULL && !show) {
        fprintf(stderr, "idemctl: --digest is an option of show\n");
        return false;
    }
    bool needs_key = (show && a->digest == NULL) || strcmp(a->cmd, "delete") == 0;
    if (strcmp(a->cmd, "markers") == 0) {
        if (npos != 2) {
            fprintf(stderr, "idemctl: markers needs GROUP\n");
        }
        return npos == 2;
    }
    if (needs_key && npos != 3) {
        fprintf(stderr, "idemctl: %s needs METHOD KEY%s\n", a->cmd,
                show ? " (or --digest HEX)" : "");
        return false;
    }
    if (!needs_key && npos != 1) {
        fprintf(stderr, "idemctl: %s takes no argument\n", a->cmd);
        return false;
    }
    return true;
}

/* What the options and arguments together must satisfy. */
static bool check_args(const args *a, int npos)
{
    if ((a->db == NULL) == (a->pg == NULL)) {
        fprintf(stderr, "idemctl: name one store: --db DIR or --pg CONNINFO\n");
        return false;
    }
    if (a->pooler && a->pg == NULL) {
        fprintf(stderr, "idemctl: --pooler is an option of --pg CONNINFO\n");
        return false;
    }
    if (a->cmd == NULL) {
        fprintf(stderr, "idemctl: no command (stats, list, show, outbox, markers, journals, "
                        "purge, delete)\n");
        return false;
    }
    if ((a->lapsed || a->older_ms >= 0) &&
        (strcmp(a->cmd, "list") != 0 || (a->state && strcmp(a->state, "in_progress") != 0))) {
        fprintf(stderr, "idemctl: --lapsed and --older-ms are options of list (calls in "
                        "progress)\n");
        return false;
    }
    if (a->state != NULL && strcmp(a->state, "in_progress") != 0 &&
        strcmp(a->state, "completed") != 0 && strcmp(a->state, "tombstone") != 0) {
        fprintf(stderr, "idemctl: --state: '%s' is not in_progress, completed or tombstone\n",
                a->state);
        return false;
    }
    return check_positionals(a, npos);
}

/* One option (getopt_long's opt) and its value v into a; false on a bad value. */
static bool parse_option(int opt, const char *v, args *a)
{
    uint64_t num;
    switch (opt) {
    case 'd':
        a->db = v;
        return true;
    case 'p':
        a->pg = v;
        return true;
    case 'P':
        a->pooler = true;
        return true;
    case 'c':
        a->caller = v;
        a->caller_set = true;
        return true;
    case 'g':
        if (strlen(v) == 0 || strlen(v) > 64 || strspn(v, "0123456789abcdefABCDEF") != strlen(v)) {
            fprintf(stderr, "idemctl: --digest: '%s' is not 1 to 64 hex digits\n", v);
            return false;
        }
        a->digest = v;
        return true;
    case 's':
        a->state = v;
        return true;
    case 'n':
        if (!cli_parse_u64("idemctl", "--limit", v, 0, LONG_MAX, &num)) {
            return false;
        }
        a->limit = (long)num;
        a->limit_set = true;
        return true;
    case 'j':
        a->json = true;
        return true;
    case 'f':
        a->force = true;
        return true;
    case 'e':
        a->expired = true;
        return true;
    case 'l':
        a->lapsed = true;
        return true;
    case 'o':
        if (!cli_parse_u64("idemctl", "--older-ms", v, 0, LONG_MAX, &num)) {
            return false;
        }
        a->older_ms = (long)num;
        return true;
    default:
        return false; /* getopt_long said which option */
    }
}

/* The long options of parse. */
static const struct option longs[] = {{"db", required_argument, NULL, 'd'},
                                      {"pg", required_argument, NULL, 'p'},
                                      {"pooler", no_argument, NULL, 'P'},
                                      {"caller", required_argument, NULL, 'c'},
                                      {"state", required_argument, NULL, 's'},
                                      {"limit", required_argument, NULL, 'n'},
                                      {"json", no_argument, NULL, 'j'},
                                      {"force", no_argument, NULL, 'f'},
                                      {"expired", no_argument, NULL, 'e'},
                                      {"lapsed", no_argument, NULL, 'l'},
                                      {"older-ms", required_argument, NULL, 'o'},
                                      {"digest", required_argument, NULL, 'g'},
                                      {"help", no_argument, NULL, 'h'},
                                      {"version", no_argument, NULL, CLI_OPT_VERSION},
                                      {NULL, 0, NULL, 0}};

/* Options and positional arguments in any order (getopt_long's "-" mode hands the
 * positionals over in place, whatever POSIXLY_CORRECT says); after "--" all are
 * positional. */
bool idemctl_parse(int argc, char **argv, args *a, int *status)
{
    const char *pos[4] = {0};
    int npos = 0, opt;

    *a = (args){.caller = "", .limit = 100, .older_ms = -1};
    *status = CLI_USAGE_ERROR;
    while ((opt = getopt_long(argc, argv, "-h", longs, NULL)) != -1) {
        if (opt == 'h' || opt == CLI_OPT_VERSION) {
            opt == 'h' ? idemctl_usage(stdout) : cli_print_version("idemctl");
            *status = 0;
            return false;
        }
        if (opt == 1 && npos < 4) {
            pos[npos++] = optarg; /* a positional argument */
        } else if (opt != 1 && !parse_option(opt, optarg, a)) {
            goto bad;
        }
    }
    for (; optind < argc && npos < 4; optind++) {
        pos[npos++] = argv[optind]; /* after "--" */
    }
    a->cmd = pos[0], a->method = pos[1], a->key = pos[2];
    if (npos == 4) {
        fprintf(stderr, "idemctl: unexpected argument '%s'\n", pos[3]);
    } else if (check_args(a, npos)) {
        return true;
    }
bad:
    idemctl_usage(stderr);
    return false;
}

/* idemctl's dead-letter verbs: the dead letters a NATS consumer published into a stream
 * (nats.h, idem_nats_dead_*), listed with their reasons, replayed to the subject they came
 * from, or purged. They talk to a broker (--nats URL), not to a store, so they have a
 * command line of their own:
 *   idemctl --nats URL [--json] dead list STREAM [--limit N] [--from SEQ]
 *   idemctl --nats URL [--json] dead replay|purge STREAM SEQ|--all [--yes]
 * replay and purge change the stream: they ask first on a terminal, and without one they
 * act only with --yes (exit 3 otherwise). */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>
#include <idemrpc/nats.h>

#include "cli.h"
#include "idemctl.h"
#include "json.h"

#define DATA_SHOWN 256      /* bytes of a dead letter's payload printed */
#define ALL_MAX 100000      /* dead letters one --all acts on */
#define NOT_CONFIRMED 3     /* the exit status of a change nobody confirmed */
#define TEXT_MAX (4 * 1024) /* a header value, escaped, as printed */

typedef struct dead_args {
    const char *url, *verb, *stream, *seq_arg;
    bool json, all, yes;
    uint64_t seq, from, limit;
} dead_args;

bool idemctl_dead_wanted(int argc, char **argv)
{
    for (int i = 1; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (strcmp(argv[i], "--nats") == 0 || strncmp(argv[i], "--nats=", 7) == 0) {
            return true;
        }
    }
    return false;
}

/* A header of a dead letter as printed: escaped, "" when absent. */
static const char *field(const idem_nats_msg *m, const char *name, char *out)
{
    const char *v = idem_nats_msg_header(m, name);
    v = v != NULL ? v : "";
    idemctl_escape(v, strlen(v), TEXT_MAX / 4 - 1, out);
    return out;
}

static void print_text(const idem_nats_msg *m)
{
    char reason[TEXT_MAX], subject[TEXT_MAX], key[TEXT_MAX], cut[TEXT_MAX], seq[TEXT_MAX];
    char data[4 * DATA_SHOWN + 1];
    idemctl_escape(m->data, m->len, DATA_SHOWN, data);
    printf("dead letter %" PRIu64 "\n  reason     %s\n  subject    %s (stream seq %s, delivered "
           "%" PRIu64 ")\n  key        %s\n  data       %zu bytes%s%s: %s%s\n",
           m->stream_seq, field(m, IDEM_NATS_DEAD_REASON, reason),
           field(m, IDEM_NATS_DEAD_SUBJECT, subject), field(m, IDEM_NATS_DEAD_SEQ, seq),
           m->delivered, field(m, IDEM_NATS_KEY_HEADER, key), m->len,
           idem_nats_msg_header(m, IDEM_NATS_DEAD_TRUNCATED) ? ", cut from " : "",
           field(m, IDEM_NATS_DEAD_TRUNCATED, cut), data, m->len > DATA_SHOWN ? " ..." : "");
}

static void json_field(const char *name, const char *value, bool last)
{
    printf("\"%s\":", name);
    idem__json_fputs(stdout, value);
    fputs(last ? "}" : ",", stdout);
}

static void print_json(const idem_nats_msg *m, bool first)
{
    char text[TEXT_MAX], data[4 * DATA_SHOWN + 1];
    const char *cut = idem_nats_msg_header(m, IDEM_NATS_DEAD_TRUNCATED);
    idemctl_escape(m->data, m->len, DATA_SHOWN, data);
    printf("%s{\"seq\":%" PRIu64 ",", first ? "" : ",", m->stream_seq);
    json_field("reason", field(m, IDEM_NATS_DEAD_REASON, text), false);
    json_field("subject", field(m, IDEM_NATS_DEAD_SUBJECT, text), false);
    printf("\"stream_seq\":%" PRIu64 ",\"delivered\":%" PRIu64 ",",
           (uint64_t)strtoull(field(m, IDEM_NATS_DEAD_SEQ, text), NULL, 10), m->delivered);
    if (m->key != NULL) {
        json_field("key", field(m, IDEM_NATS_KEY_HEADER, text), false);
    }
    printf("\"truncated_from\":%s,\"data_bytes\":%zu,", cut != NULL ? cut : "null", m->len);
    json_field("data", data, true);
}

typedef struct listing {
    const dead_args *a;
    size_t n;
    uint64_t *seqs; /* collecting (replay, purge --all), else printing */
} listing;

static bool on_dead(const idem_nats_msg *m, void *arg)
{
    listing *l = arg;
    if (l->seqs != NULL) {
        l->seqs[l->n++] = m->stream_seq;
    } else if (l->a->json) {
        print_json(m, l->n++ == 0);
    } else {
        l->n++;
        print_text(m);
    }
    return true;
}

static int cmd_list(idem_nats_dead_letters *d, const dead_args *a)
{
    listing l = {a, 0, NULL};
    uint64_t next;
    if (a->json) {
        printf("{\"stream\":");
        idem__json_fputs(stdout, a->stream);
        printf(",\"dead\":[");
    }
    if (idem_nats_dead_list(d, a->from, (size_t)a->limit, on_dead, &l, &next) != IDEM_OK) {
        fprintf(stderr, "%sidemctl: %s\n", a->json ? "\n" : "", idem_errmsg());
        return 1;
    }
    if (a->json) {
        printf("],\"next\":%" PRIu64 "}\n", next);
    } else if (next != 0) {
        printf("%zu dead letters shown; more from --from %" PRIu64 "\n", l.n, next);
    } else {
        printf("%zu dead letters\n", l.n);
    }
    return 0;
}

/* The dead letters replay or purge acts on: SEQ, or every one the stream holds now. */
static int targets(idem_nats_dead_letters *d, const dead_args *a, uint64_t **seqs, size_t *n)
{
    listing l = {a, 0, calloc(a->all ? ALL_MAX : 1, sizeof(uint64_t))};
    uint64_t next = 0;
    *seqs = l.seqs;
    if (l.seqs == NULL) {
        fprintf(stderr, "idemctl: out of memory\n");
        return 1;
    }
    if (!a->all) {
        l.seqs[l.n++] = a->seq;
    }
    do { /* all: in rounds, a long stream of gaps ends a round early */
        if (a->all && idem_nats_dead_list(d, next, ALL_MAX - l.n, on_dead, &l, &next) != IDEM_OK) {
            fprintf(stderr, "idemctl: %s\n", idem_errmsg());
            return 1;
        }
    } while (a->all && next != 0 && l.n < ALL_MAX);
    *n = l.n;
    return 0;
}

/* Asks on the terminal; true when the answer is y or yes. */
static bool confirmed(const dead_args *a, size_t n)
{
    char line[16];
    if (a->yes) {
        return true;
    }
    if (!isatty(STDIN_FILENO)) {
        fprintf(stderr,
                "idemctl: dead %s changes stream %s: confirm on a terminal, or give "
                "--yes\n",
                a->verb, a->stream);
        return false;
    }
    fprintf(stderr, "%s %zu dead letter%s of stream %s%s%s (%s)? [y/N] ", a->verb, n,
            n == 1 ? "" : "s", a->stream, a->all ? "" : ", seq ", a->all ? "" : a->seq_arg,
            strcmp(a->verb, "replay") == 0 ? "publish again to the original subject"
                                           : "remove for good");
    if (fgets(line, sizeof(line), stdin) == NULL) {
        return false;
    }
    line[strcspn(line, "\r\n")] = '\0';
    return strcmp(line, "y") == 0 || strcmp(line, "yes") == 0;
}

/* replay or purge each target; the others go on after one fails. */
static int cmd_change(idem_nats_dead_letters *d, const dead_args *a)
{
    uint64_t *seqs;
    size_t n = 0, failed = 0;
    bool replay = strcmp(a->verb, "replay") == 0;
    int rc = targets(d, a, &seqs, &n);
    if (rc == 0 && n > 0 && !confirmed(a, n)) {
        rc = NOT_CONFIRMED;
    }
    for (size_t i = 0; rc == 0 && i < n; i++) {
        idem_code code =
            replay ? idem_nats_dead_replay(d, seqs[i]) : idem_nats_dead_purge(d, seqs[i]);
        if (code != IDEM_OK) {
            failed++;
            fprintf(stderr, "idemctl: %s: %s\n", idem_code_name(code), idem_errmsg());
        } else if (!a->json) {
            printf("%s %" PRIu64 "\n", replay ? "replayed" : "purged", seqs[i]);
        }
    }
    if (rc == 0 && a->json) {
        printf("{\"stream\":");
        idem__json_fputs(stdout, a->stream);
        printf(",\"verb\":\"%s\",\"done\":%zu,\"failed\":%zu}\n", a->verb, n - failed, failed);
    } else if (rc == 0 && n == 0) {
        printf("no dead letters\n");
    }
    free(seqs);
    return rc != 0 ? rc : failed > 0 ? 1 : 0;
}

static const struct option longs[] = {{"nats", required_argument, NULL, 'u'},
                                      {"json", no_argument, NULL, 'j'},
                                      {"limit", required_argument, NULL, 'n'},
                                      {"from", required_argument, NULL, 'f'},
                                      {"all", no_argument, NULL, 'a'},
                                      {"yes", no_argument, NULL, 'y'},
                                      {NULL, 0, NULL, 0}};

/* One option into a; false on a bad value or an option of the store verbs. */
static bool parse_option(int opt, const char *v, dead_args *a)
{
    switch (opt) {
    case 'u':
        a->url = v;
        return true;
    case 'j':
        a->json = true;
        return true;
    case 'n':
        return cli_parse_u64("idemctl", "--limit", v, 1, ALL_MAX, &a->limit);
    case 'f':
        return cli_parse_u64("idemctl", "--from", v, 0, UINT64_MAX, &a->from);
    case 'a':
        a->all = true;
        return true;
    case 'y':
        a->yes = true;
        return true;
    default:
        return false; /* getopt_long said which option */
    }
}

/* What the positionals (dead VERB STREAM [SEQ]) and options together must satisfy. */
static bool check(dead_args *a, const char *const *pos, int npos)
{
    bool list = npos >= 2 && strcmp(pos[1], "list") == 0;
    bool change = npos >= 2 && (strcmp(pos[1], "replay") == 0 || strcmp(pos[1], "purge") == 0);
    if (npos < 3 || strcmp(pos[0], "dead") != 0 || (!list && !change)) {
        fprintf(stderr, "idemctl: with --nats the command is dead list|replay|purge STREAM\n");
        return false;
    }
    a->verb = pos[1], a->stream = pos[2], a->seq_arg = npos == 4 ? pos[3] : NULL;
    if (list && (npos != 3 || a->all || a->yes)) {
        fprintf(stderr, "idemctl: dead list takes STREAM, --limit N and --from SEQ\n");
        return false;
    }
    if (change && (npos == 4) == a->all) {
        fprintf(stderr, "idemctl: dead %s takes SEQ or --all\n", a->verb);
        return false;
    }
    return !change || a->all || cli_parse_u64("idemctl", "SEQ", a->seq_arg, 1, UINT64_MAX, &a->seq);
}

static bool parse(int argc, char **argv, dead_args *a)
{
    const char *pos[5] = {0};
    int npos = 0, opt;
    *a = (dead_args){.limit = 100};
    optind = 1;
    while ((opt = getopt_long(argc, argv, "-", longs, NULL)) != -1) {
        if (opt == 1 && npos < 5) {
            pos[npos++] = optarg;
        } else if (opt != 1 && !parse_option(opt, optarg, a)) {
            return false;
        }
    }
    for (; optind < argc && npos < 5; optind++) {
        pos[npos++] = argv[optind]; /* after "--" */
    }
    if (npos == 5) {
        fprintf(stderr, "idemctl: unexpected argument '%s'\n", pos[4]);
        return false;
    }
    return check(a, pos, npos);
}

int idemctl_dead_main(int argc, char **argv)
{
    dead_args a;
    idem_nats_dead_letters *d;
    if (!parse(argc, argv, &a)) {
        idemctl_usage(stderr);
        return CLI_USAGE_ERROR;
    }
    if (idem_nats_dead_open(&d, a.url, a.stream) != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return 1;
    }
    int rc = strcmp(a.verb, "list") == 0 ? cmd_list(d, &a) : cmd_change(d, &a);
    idem_nats_dead_close(d);
    return rc;
}

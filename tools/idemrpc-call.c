/* idemrpc-call: one logical call (with retries) through idem_client, printed as
 *   code: OK
 *   replayed: false
 *   payload: 42
 * idem.Token/Issue prints the issued token instead of its protobuf payload.
 * Exit status: 0 for OK, 1 for any other code, 2 for bad usage. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idemrpc/idemrpc.h>

#include "cli.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: idemrpc-call URL METHOD PAYLOAD [--key K] [--token T] "
               "[--caller C] [--secret S [--signer P]] [--timeout-ms N]\n"
               "       [--tls-ca FILE [--tls-cert FILE] [--tls-server-name NAME]]\n"
               "  URL METHOD PAYLOAD come first, whatever they look like; the options follow\n"
               "  --key K         the idempotency key (default: none)\n"
               "  --token T       a token from idem.Token/Issue\n"
               "  --caller C      the caller the key belongs to\n"
               "  --secret S      sign every attempt as the caller with secret S (16..256\n"
               "                  bytes; visible to ps: for trying things out)\n"
               "  --signer P      sign as proxy P for the caller (P's secret in --secret)\n"
               "  --timeout-ms N  one attempt's reply wait (default 2000)\n"
               "  --tls-ca FILE   tls+tcp:// URLs: the CA of the server's certificate (PEM)\n"
               "  --tls-cert FILE this client's certificate and key (PEM)\n"
               "  --tls-server-name NAME  the name the server's certificate must carry\n"
               "  idemrpc-call --version prints the version\n");
}

/* The three positional arguments, taken by place so that a payload such as "-5" is not
 * read as an option (and --help/--version in their place). True to go on; false with
 * *status the exit status (0 after --help, 2 after a usage error). */
static bool take_positionals(int argc, char **argv, idem_request *req, int *status)
{
    *status = CLI_USAGE_ERROR;
    if (argc >= 2 && strcmp(argv[1], "--version") == 0) {
        cli_print_version("idemrpc-call");
        *status = 0;
        return false;
    }
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        usage(stdout);
        *status = 0;
        return false;
    }
    if (argc >= 2 && argv[1][0] == '-') { /* no URL starts with '-' */
        fprintf(stderr, "idemrpc-call: '%s': URL METHOD PAYLOAD come first\n", argv[1]);
        usage(stderr);
        return false;
    }
    if (argc < 4) {
        fprintf(stderr, "idemrpc-call: URL METHOD PAYLOAD are required\n");
        usage(stderr);
        return false;
    }
    *req = (idem_request){.method = argv[2], .payload = argv[3], .payload_len = strlen(argv[3])};
    return true;
}

/* One option from getopt_long (its argument in optarg). True to go on; false with
 * *status the exit status, as for take_positionals. */
static bool take_option(int opt, idem_request *req, idem_client_opts *opts, int *status)
{
    uint64_t ms;
    switch (opt) {
    case 'k':
        req->idempotency_key = optarg;
        return true;
    case 't':
        req->token = optarg;
        return true;
    case 'c':
        req->caller = optarg;
        opts->caller = optarg; /* idem.Token/Issue signs as it too */
        return true;
    case 's':
        opts->signing_secret = optarg;
        return true;
    case 'p':
        opts->signer = optarg;
        return true;
    case 'a':
        opts->tls_ca_file = optarg;
        return true;
    case 'e':
        opts->tls_cert_key_file = optarg;
        return true;
    case 'n':
        opts->tls_server_name = optarg;
        return true;
    case 'T':
        if (!cli_parse_u64("idemrpc-call", "--timeout-ms", optarg, 0, UINT32_MAX, &ms)) {
            usage(stderr);
            return false;
        }
        opts->attempt_timeout_ms = (uint32_t)ms;
        return true;
    case 'h':
        usage(stdout);
        *status = 0;
        return false;
    case CLI_OPT_VERSION:
        cli_print_version("idemrpc-call");
        *status = 0;
        return false;
    default:
        usage(stderr); /* getopt_long said which option */
        return false;
    }
}

/* The positional arguments first (take_positionals); getopt_long then parses what
 * follows them, in order (a stray argument among the options is an error, as an option
 * before them is). True to run; false with *status the exit status (0 after --help, 2
 * after a usage error). */
static bool parse(int argc, char **argv, idem_request *req, idem_client_opts *opts, int *status)
{
    static const struct option longs[] = {{"key", required_argument, NULL, 'k'},
                                          {"token", required_argument, NULL, 't'},
                                          {"caller", required_argument, NULL, 'c'},
                                          {"timeout-ms", required_argument, NULL, 'T'},
                                          {"secret", required_argument, NULL, 's'},
                                          {"signer", required_argument, NULL, 'p'},
                                          {"tls-ca", required_argument, NULL, 'a'},
                                          {"tls-cert", required_argument, NULL, 'e'},
                                          {"tls-server-name", required_argument, NULL, 'n'},
                                          {"help", no_argument, NULL, 'h'},
                                          {"version", no_argument, NULL, CLI_OPT_VERSION},
                                          {NULL, 0, NULL, 0}};
    int opt;

    if (!take_positionals(argc, argv, req, status)) {
        return false;
    }
    argv[3] = argv[0]; /* getopt_long sees "idemrpc-call [options]" and names it in errors */
    argc -= 3, argv += 3;
    while ((opt = getopt_long(argc, argv, "+h", longs, NULL)) != -1) {
        if (!take_option(opt, req, opts, status)) {
            return false;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "idemrpc-call: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return false;
    }
    return true;
}

static void print_payload(const void *p, size_t n)
{
    const unsigned char *b = p;
    fputs("payload: ", stdout);
    for (size_t i = 0; i < n; i++) {
        if (b[i] >= 0x20 && b[i] < 0x7f) {
            putchar(b[i]);
        } else {
            printf("\\x%02x", b[i]);
        }
    }
    putchar('\n');
}

int main(int argc, char **argv)
{
    idem_request req;
    idem_client_opts opts;
    int status;
    idem_client_opts_init(&opts);
    if (!parse(argc, argv, &req, &opts, &status)) {
        return status;
    }
    idem_client *c;
    const char *url = argv[1];
    if (idem_client_open(&c, &url, 1, &opts) != IDEM_OK) {
        fprintf(stderr, "idemrpc-call: %s\n", idem_errmsg());
        return 1;
    }
    if (strcmp(req.method, "idem.Token/Issue") == 0) {
        char token[64];
        uint64_t expires = 0;
        idem_code code = idem_client_issue_token(c, req.caller, token, sizeof(token), &expires);
        printf("code: %s\n", idem_code_name(code));
        if (code == IDEM_OK) {
            printf("token: %s\nexpires_unix_ms: %llu\n", token, (unsigned long long)expires);
        } else {
            printf("message: %s\n", idem_errmsg());
        }
        status = code == IDEM_OK ? 0 : 1;
    } else {
        idem_result res;
        idem_code code = idem_client_call(c, &req, &res);
        printf("code: %s\nreplayed: %s\n", idem_code_name(code), res.replayed ? "true" : "false");
        if (res.message != NULL && res.message[0] != '\0') {
            printf("message: %s\n", res.message);
        }
        print_payload(res.payload, res.payload_len);
        printf("key: %s\nattempts: %u\n", res.key[0] ? res.key : "(the token)", res.attempts);
        idem_result_clear(&res);
        status = code == IDEM_OK ? 0 : 1;
    }
    idem_client_close(c);
    return status;
}

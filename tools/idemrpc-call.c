/* idemrpc-call: one logical call (with retries) through idem_client, printed as
 *   code: OK
 *   replayed: false
 *   payload: 42
 * idem.Token/Issue prints the issued token instead of its protobuf payload.
 * Exit status: 0 for OK, 1 for any other code, 2 for bad usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <idemrpc/idemrpc.h>

static int usage(void)
{
    fprintf(stderr, "usage: idemrpc-call URL METHOD PAYLOAD [--key K] [--token T] "
                    "[--caller C] [--timeout-ms N]\n");
    return 2;
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
    if (argc < 4) {
        return usage();
    }
    idem_request req = {.method = argv[2], .payload = argv[3], .payload_len = strlen(argv[3])};
    idem_client_opts opts;
    idem_client_opts_init(&opts);
    for (int i = 4; i < argc; i++) {
        if (i + 1 >= argc) {
            return usage();
        }
        if (strcmp(argv[i], "--key") == 0) {
            req.idempotency_key = argv[++i];
        } else if (strcmp(argv[i], "--token") == 0) {
            req.token = argv[++i];
        } else if (strcmp(argv[i], "--caller") == 0) {
            req.caller = argv[++i];
        } else if (strcmp(argv[i], "--timeout-ms") == 0) {
            opts.attempt_timeout_ms = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else {
            return usage();
        }
    }
    idem_client *c;
    const char *url = argv[1];
    if (idem_client_open(&c, &url, 1, &opts) != IDEM_OK) {
        fprintf(stderr, "idemrpc-call: %s\n", idem_errmsg());
        return 1;
    }
    int status;
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

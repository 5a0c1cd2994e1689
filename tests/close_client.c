/* A client process for harden/client::closes_even_when_late_replies_race_its_close:
 * rounds of open, one call whose first attempt times out, close. Usage:
 *   close_client URL ROUNDS
 * Each round's first attempt (8 ms) times out against the 20 ms handler of method
 * t.Slow/Do, its retry (1 ms later) waits as a duplicate, and the server answers both
 * together, as the client closes. Exits 0 after ROUNDS rounds, or after the first close
 * that took IDEM_NNG_CLOSE_WAIT_MS (nng's reaper is then stuck for this process, and
 * every later close would wait as long); prints how it ended. */
#include <stdio.h>
#include <stdlib.h>

#include <idemrpc/idemrpc.h>

#include "nng_close.h"
#include "supplemental.h"

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: close_client URL ROUNDS\n");
        return 2;
    }
    const char *url = argv[1];
    int rounds = atoi(argv[2]);
    for (int round = 0; round < rounds; round++) {
        idem_client_opts o;
        idem_client_opts_init(&o);
        o.attempt_timeout_ms = 8;
        o.retry.period_ms = 1;
        o.retry.max_period_ms = 1;
        idem_client *c;
        if (idem_client_open(&c, &url, 1, &o) != IDEM_OK) {
            fprintf(stderr, "close_client: open: %s\n", idem_errmsg());
            return 1;
        }
        char key[32];
        snprintf(key, sizeof(key), "late-%d", round);
        idem_request q = {
            .method = "t.Slow/Do", .idempotency_key = key, .payload = "p", .payload_len = 1};
        idem_result r;
        if (idem_client_call(c, &q, &r) == IDEM_OK) {
            idem_result_clear(&r);
        }
        uint64_t began = idem__mono_ms();
        idem_client_close(c);
        if (idem__mono_ms() - began >= IDEM_NNG_CLOSE_WAIT_MS) {
            printf("close_client: round %d's close met a stuck nng and returned\n", round);
            return 0;
        }
    }
    printf("close_client: %d rounds\n", rounds);
    return 0;
}

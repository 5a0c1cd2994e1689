/* A lock holder in a process of its own, for tests/test_lock.c: acquires a lease lock
 * (scope "shop"), renewed by its store's keeper, prints "ready" and the token, then
 * waits until it is killed.
 *
 *   lock_holder (--lmdb DIR | --pg CONNINFO) --name NAME [--lease-ms N] */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>

int main(int argc, char **argv)
{
    const char *lmdb = NULL, *pg = NULL, *name = NULL;
    /* A test that fails before it kills this holder must not leave it running. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() == 1) {
        return 1;
    }
    idem_lock_opts o = {.wait_ms = 5000};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--lmdb") == 0) {
            lmdb = argv[i + 1];
        } else if (strcmp(argv[i], "--pg") == 0) {
            pg = argv[i + 1];
        } else if (strcmp(argv[i], "--name") == 0) {
            name = argv[i + 1];
        } else if (strcmp(argv[i], "--lease-ms") == 0) {
            o.lease_ms = strtoull(argv[i + 1], NULL, 10);
        }
    }
    idem_store *st;
    idem_lock *l;
    idem_code code = pg != NULL ? idem_store_open_postgres(&st, pg, 2)
                                : idem_store_open_lmdb(&st, lmdb, 0, IDEM_STORE_NOSYNC);
    if (code != IDEM_OK || (code = idem_lock_acquire(st, "shop", name, &o, &l)) != IDEM_OK) {
        fprintf(stderr, "lock_holder: %s: %s\n", idem_code_name(code), idem_errmsg());
        return 1;
    }
    printf("ready\n%llu\n", (unsigned long long)idem_lock_token(l));
    fflush(stdout);
    for (;;) {
        pause(); /* holding, renewed by the keeper thread, until SIGKILL */
    }
}

/* The server of the power-cut test (test_power_cut.c): the default chain and one cached
 * method over an LMDB store, its writes recorded for a power cut when the undo log is set
 * (power_cut.c, linked in: $IDEMRPC_UNDO_LOG, $IDEMRPC_UNDO_DATA).
 *
 *   power_cut_server --listen URL --db DIR
 *   cut.Note/Put  answers "<key>@<pid>#<n>": a run again after a lost record answers
 *                 something else (another pid, or another n) */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <idemrpc/idemrpc.h>

static atomic_ulong runs;

static idem_code put(idem_call *call, void *arg)
{
    (void)arg;
    char out[IDEM_MAX_KEY + 64];
    int n = snprintf(out, sizeof(out), "%s@%ld#%lu", idem_call_key(call), (long)getpid(),
                     atomic_fetch_add(&runs, 1));
    return idem_call_reply(call, IDEM_OK, out, (size_t)n);
}

int main(int argc, char **argv)
{
    const char *listen = NULL, *db = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--listen") == 0) {
            listen = argv[i + 1];
        } else if (strcmp(argv[i], "--db") == 0) {
            db = argv[i + 1];
        }
    }
    if (listen == NULL || db == NULL) {
        fprintf(stderr, "usage: power_cut_server --listen URL --db DIR\n");
        return 2;
    }
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    idem_server_opts o;
    idem_server_opts_init(&o);
    o.db_path = db;
    idem_server *srv;
    idem_method_opts m = {.flags = IDEM_METHOD_CACHED | IDEM_METHOD_KEY_REQUIRED};
    if (idem_server_create(&srv, &o) != IDEM_OK ||
        idem_server_register(srv, "cut.Note/Put", put, NULL, &m) != IDEM_OK ||
        idem_server_listen(srv, listen) != IDEM_OK) {
        fprintf(stderr, "power_cut_server: %s\n", idem_errmsg());
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    int sig;
    sigwait(&stop, &sig);
    idem_server_destroy(srv);
    return 0;
}

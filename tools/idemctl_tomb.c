/* Tombstones in idemctl: show prints a key's tombstone when it has no record, delete
 * deletes it (a late duplicate then runs again). */
#include <inttypes.h>
#include <stdio.h>

#include <idemrpc/idemrpc.h>

#include "idemctl.h"

static void print_tomb(const idem_key_ref *k, const idem_tombstone *t, bool json)
{
    char fp[2 * IDEM_TOMBSTONE_FP_LEN + 1];
    for (size_t i = 0; i < IDEM_TOMBSTONE_FP_LEN; i++) {
        snprintf(fp + 2 * i, 3, "%02x", t->fingerprint[i]);
    }
    if (!json) {
        printf("caller: %s\nmethod: %s\nkey: %s\nstate: TOMBSTONE (result expired)\n"
               "outcome: %s\nfingerprint: %s…\nfirst_at_ms: %" PRIu64 "\nexpired_at_ms: %" PRIu64
               "\nuntil_ms: %" PRIu64 "\n",
               k->caller, k->method, k->key, idem_code_name(t->code), fp, t->first_at_ms,
               t->expired_at_ms, t->until_ms);
        return;
    }
    fputs("{", stdout);
    idemctl_json_key(k->caller, k->method, k->key);
    printf(",\"state\":\"TOMBSTONE\",\"outcome\":\"%s\",\"fingerprint_prefix\":\"%s\","
           "\"first_at_ms\":%" PRIu64 ",\"expired_at_ms\":%" PRIu64 ",\"until_ms\":%" PRIu64 "}\n",
           idem_code_name(t->code), fp, t->first_at_ms, t->expired_at_ms, t->until_ms);
}

bool idemctl_show_tomb(struct idem_store *st, const args *a)
{
    idem_key_ref k = {a->caller, a->method, a->key};
    idem_tombstone t;
    if (idem_store_tombstone_get(st, &k, &t) != IDEM_OK) {
        return false;
    }
    print_tomb(&k, &t, a->json);
    return true;
}

int idemctl_delete_tomb(struct idem_store *st, const args *a)
{
    idem_key_ref k = {a->caller, a->method, a->key};
    if (idem_store_tombstone_delete(st, &k) != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return 1;
    }
    if (a->json) {
        fputs("{\"deleted_tombstone\":{", stdout);
        idemctl_json_key(a->caller, a->method, a->key);
        puts("}}");
    } else {
        printf("deleted the tombstone of %s %s\n", a->method, a->key);
    }
    return 0;
}

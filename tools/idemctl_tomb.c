/* Tombstones in idemctl: show prints a key's tombstone when it has no record, delete
 * deletes it (a late duplicate then runs again), list --state tombstone lists them. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <idemrpc/idemrpc.h>

#include "idemctl.h"

/* n bytes as lowercase hex into out (2n + 1). */
static void hex(const uint8_t *b, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++) {
        snprintf(out + 2 * i, 3, "%02x", b[i]);
    }
}

static void print_tomb(const idem_key_ref *k, const idem_tombstone *t, bool json)
{
    char fp[2 * IDEM_TOMBSTONE_FP_LEN + 1];
    size_t kept = t->fingerprint_len; /* 0: all */
    hex(t->fingerprint, kept > 0 && kept < IDEM_TOMBSTONE_FP_LEN ? kept : IDEM_TOMBSTONE_FP_LEN,
        fp);
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

typedef struct tomb_list {
    const args *a;
    long shown;
} tomb_list;

/* One row of list --state tombstone. LMDB keeps only a hash of the key: the row names
 * it (key_hash) instead of caller, method and key, and --caller cannot select it. */
static bool list_tomb(void *arg, const idem_key_ref *k, const uint8_t *key_hash,
                      const idem_tombstone *t)
{
    tomb_list *l = arg;
    char kh[2 * IDEM_TOMBSTONE_KEY_HASH_LEN + 1] = "";
    if (l->a->caller_set && (k == NULL || strcmp(k->caller, l->a->caller) != 0)) {
        return true;
    }
    if (l->shown >= l->a->limit) {
        return false;
    }
    if (key_hash != NULL) {
        hex(key_hash, IDEM_TOMBSTONE_KEY_HASH_LEN, kh);
    }
    if (l->a->json) {
        fputs(l->shown ? ",\n {" : "[\n {", stdout);
        if (k != NULL) {
            idemctl_json_key(k->caller, k->method, k->key);
        } else {
            printf("\"key_hash\":\"%s\"", kh);
        }
        printf(",\"state\":\"TOMBSTONE\",\"outcome\":\"%s\",\"first_at_ms\":%" PRIu64
               ",\"expired_at_ms\":%" PRIu64 ",\"until_ms\":%" PRIu64 "}",
               idem_code_name(t->code), t->first_at_ms, t->expired_at_ms, t->until_ms);
    } else {
        if (l->shown == 0) {
            printf("%-16s %-32s %-32s %-11s %-20s %-20s %s\n", "CALLER", "METHOD", "KEY", "STATE",
                   "FIRST_AT", "UNTIL", "OUTCOME");
        }
        printf("%-16s %-32s %-32s %-11s ",
               k == NULL      ? "?"
               : k->caller[0] ? k->caller
                              : "-",
               k == NULL ? "?" : k->method, k == NULL ? kh : k->key, "TOMBSTONE");
        idemctl_print_time(t->first_at_ms);
        putchar(' ');
        idemctl_print_time(t->until_ms);
        printf(" %s\n", idem_code_name(t->code));
    }
    l->shown++;
    return true;
}

int idemctl_list_tombs(struct idem_store *st, const args *a)
{
    tomb_list l = {a, 0};
    idem_code code = idem_store_tombstone_foreach(st, list_tomb, &l);
    if (a->json) {
        fputs(l.shown ? "\n]\n" : "[]\n", stdout);
    } else if (l.shown == 0) {
        puts("no tombstones");
    }
    if (code != IDEM_OK) {
        fprintf(stderr, "idemctl: %s\n", idem_errmsg());
        return 1;
    }
    return 0;
}

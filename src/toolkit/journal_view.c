/* The journals as an operator sees them (downstream.h, idem_journal_*): read-only views
 * of the entries steps.c's header lays out. The re-driver's own walk, which also drops
 * a listing nobody can read, is idem__steps_next_call (steps_redrive.c). */
#include <stdlib.h>
#include <string.h>

#include "steps_internal.h"

#define STEPS_DB IDEM__STEPS_DB
#define JKEY IDEM__JKEY
_Static_assert(IDEM_JOURNAL_CURSOR == JKEY, "a cursor is a journal key");
_Static_assert(IDEM_JOURNAL_MAX_MESSAGE == IDEM_MAX_MESSAGE, "a compensation's failure is a "
                                                             "call's message");

const char *idem_journal_state_name(idem_journal_state s)
{
    switch (s) {
    case IDEM_JOURNAL_STEPS:
        return "steps";
    case IDEM_JOURNAL_COMPENSATING:
        return "compensating";
    case IDEM_JOURNAL_COMPENSATED:
        return "compensated";
    }
    return "unknown";
}

/* The head ('j'): the fence of the last run that recorded, the steps it lists; and, per
 * step, whether its undo ran ('u'). */
static idem_code read_head(idem_store *st, const idem__journal *j, idem_journal_info *out,
                           bool *found)
{
    void *v;
    size_t n;
    idem_code code = idem_store_app_get(st, STEPS_DB, j->head_key, JKEY, &v, &n);
    if (code != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    *found = true;
    if (n < 8 || (n - 8) % 32 != 0 || n > 8 + IDEM_MAX_STEPS * 32) {
        free(v);
        return idem__err(IDEM_DATA_LOSS, "step journal head has an unknown format");
    }
    out->fence = idem__get_be64(v);
    out->steps = (unsigned)((n - 8) / 32);
    uint8_t key[JKEY] = {'u'};
    for (size_t off = 8; off < n && code == IDEM_OK; off += 32) {
        bool undone;
        memcpy(key + 1, (const uint8_t *)v + off, 32);
        code = idem__journal_entry_exists(st, key, &undone);
        out->undone += code == IDEM_OK && undone;
    }
    free(v);
    return code;
}

/* The compensation's failure ('c': be32 code ‖ message), when one started. */
static idem_code read_failure(idem_store *st, const idem__journal *j, idem_journal_info *out,
                              bool *found)
{
    void *v;
    size_t n;
    idem_code code = idem_store_app_get(st, STEPS_DB, j->saga_key, JKEY, &v, &n);
    if (code != IDEM_OK) {
        return code == IDEM_NOT_FOUND ? IDEM_OK : code;
    }
    *found = true;
    uint32_t c = n >= 4 ? idem__get_be32(v) : IDEM_UNKNOWN;
    size_t len = n >= 4 ? n - 4 : 0;
    len = len < IDEM_MAX_MESSAGE ? len : IDEM_MAX_MESSAGE;
    memcpy(out->failure_msg, (const uint8_t *)v + 4 * (n >= 4), len);
    out->failure_msg[len] = '\0';
    out->failure = c == IDEM_OK || c >= IDEM_CODE_COUNT ? IDEM_UNKNOWN : (idem_code)c;
    free(v);
    return IDEM_OK;
}

/* The listing's fields ('r') into out. */
static idem_code read_listing(const idem_app_entry *e, idem_journal_info *out)
{
    idem__journaled_call jc;
    memset(&jc, 0, sizeof(jc));
    idem_code code = idem__journal_parse_call(e, &jc);
    if (code == IDEM_OK) {
        out->listed = true;
        out->runs = jc.runs;
        memcpy(out->fingerprint, jc.fingerprint, IDEM_FINGERPRINT_LEN);
        memcpy(out->caller, jc.key_ref.caller, sizeof(out->caller));
        memcpy(out->method, jc.key_ref.method, sizeof(out->method));
        memcpy(out->key, jc.key_ref.key, sizeof(out->key));
    }
    idem__journaled_call_clear(&jc);
    return code;
}

/* Head and compensation of the journal of base; *found when either is there. */
static idem_code read_journal(idem_store *st, const uint8_t base[32], idem_journal_info *out,
                              bool *found)
{
    idem__journal j;
    idem__journal_of_base(base, &j);
    idem_code code = read_head(st, &j, out, found);
    if (code == IDEM_OK) {
        code = read_failure(st, &j, out, found);
    }
    out->state = out->failure == IDEM_OK    ? IDEM_JOURNAL_STEPS
                 : out->undone < out->steps ? IDEM_JOURNAL_COMPENSATING
                                            : IDEM_JOURNAL_COMPENSATED;
    return code;
}

idem_code idem_journal_next(idem_store *st, uint8_t cursor[IDEM_JOURNAL_CURSOR],
                            idem_journal_info *out)
{
    if (st == NULL || cursor == NULL || out == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "idem_journal_next needs a store, a cursor "
                                                "and an out");
    }
    memset(out, 0, sizeof(*out));
    /* The first 'r' key after the cursor's ('r' alone: the first of all). */
    idem_app_entry e = {0};
    size_t clen = cursor[0] == 'r' ? JKEY : 1;
    idem_code code =
        idem__store_app_next(st, STEPS_DB, clen == 1 ? "r" : (const char *)cursor, clen, &e);
    if (code == IDEM_OK && (e.klen != JKEY || ((const uint8_t *)e.key)[0] != 'r')) {
        code = idem__err(IDEM_NOT_FOUND, "no more journals");
    }
    if (code == IDEM_OK) {
        memcpy(cursor, e.key, JKEY);
        code = read_listing(&e, out);
    }
    idem__app_entry_clear(&e);
    bool found; /* listed: a journal even before its first step */
    return code == IDEM_OK ? read_journal(st, cursor + 1, out, &found) : code;
}

idem_code idem_journal_get(idem_store *st, const idem_key_ref *key,
                           const uint8_t fingerprint[IDEM_FINGERPRINT_LEN], idem_journal_info *out)
{
    const char *caller = key != NULL && key->caller != NULL ? key->caller : "";
    if (st == NULL || key == NULL || key->method == NULL || key->key == NULL ||
        fingerprint == NULL || out == NULL || strlen(caller) > IDEM_MAX_CALLER ||
        strlen(key->method) > IDEM_MAX_METHOD || strlen(key->key) > IDEM_MAX_KEY) {
        return idem__err(IDEM_INVALID_ARGUMENT, "idem_journal_get needs a store, a record key "
                                                "within its bounds, a fingerprint and an out");
    }
    memset(out, 0, sizeof(*out));
    uint8_t base[32];
    if (!idem__journal_base(caller, key->method, key->key, fingerprint, base)) {
        return idem__err(IDEM_INTERNAL, "sha256 failed");
    }
    idem__journal j;
    idem__journal_of_base(base, &j);
    idem_app_entry e = {.key = j.call_key, .klen = JKEY};
    bool found = false;
    idem_code code = idem_store_app_get(st, STEPS_DB, j.call_key, JKEY, &e.val, &e.vlen);
    if (code == IDEM_OK) {
        found = true;
        code = read_listing(&e, out);
        free(e.val);
    } else if (code == IDEM_NOT_FOUND) {
        strcpy(out->caller, caller), strcpy(out->method, key->method), strcpy(out->key, key->key);
        memcpy(out->fingerprint, fingerprint, IDEM_FINGERPRINT_LEN);
        code = IDEM_OK;
    }
    if (code == IDEM_OK) {
        code = read_journal(st, base, out, &found);
    }
    return code == IDEM_OK && !found ? idem__err(IDEM_NOT_FOUND, "no journal for this request")
                                     : code;
}

/* The chain a server runs, checked at its first listen: the built-ins appear at most
 * once and in their one order (request_id, token, debounce, result_cache), and every
 * registered method's flags have the built-ins that enforce them, so that a custom
 * chain (default_chain = false) cannot silently weaken a guarantee. And whether a
 * waiting call may leave the chain and resume at result_cache. */
#include "server_setup.h"

#include "internal.h"
#include "store.h"

/* The built-ins in the only order that keeps their guarantees: the key is resolved
 * before anything uses it, a token is checked before a claim can replay, the debounce
 * window sits in front of the claim. */
static const idem_builtin builtin_order[] = {IDEM_BUILTIN_REQUEST_ID, IDEM_BUILTIN_TOKEN,
                                             IDEM_BUILTIN_DEBOUNCE, IDEM_BUILTIN_RESULT_CACHE};
static const char *const builtin_names[] = {"request_id", "token", "result_cache", "debounce"};

/* Where each built-in sits (by idem_builtin); -1 when absent. Refuses one twice. */
static idem_code builtin_positions(const idem_chain *c, long pos[4])
{
    for (int b = 0; b < 4; b++) {
        pos[b] = -1;
    }
    for (size_t i = 0; i < c->n; i++) {
        const idem_interceptor *it = &c->items[i];
        if (!it->builtin) {
            continue;
        }
        if (pos[it->kind] >= 0) {
            return idem__err(IDEM_FAILED_PRECONDITION, "the chain has %s twice",
                             builtin_names[it->kind]);
        }
        pos[it->kind] = (long)i;
    }
    return IDEM_OK;
}

/* A custom chain (default_chain = false) may leave built-ins out, but never reorder them. */
static idem_code chain_order_check(const long pos[4])
{
    for (size_t i = 0; i < IDEM_ARRAY_LEN(builtin_order); i++) {
        for (size_t j = i + 1; j < IDEM_ARRAY_LEN(builtin_order); j++) {
            long a = pos[builtin_order[i]], b = pos[builtin_order[j]];
            if (a < 0 || b < 0 || a < b) {
                continue;
            }
            return idem__err(IDEM_FAILED_PRECONDITION,
                             "the chain runs %s before %s%s; the built-ins must run in the "
                             "order request_id, token, debounce, result_cache",
                             builtin_names[builtin_order[j]], builtin_names[builtin_order[i]],
                             builtin_order[i] == IDEM_BUILTIN_TOKEN &&
                                     builtin_order[j] == IDEM_BUILTIN_RESULT_CACHE
                                 ? " (a token-protected call would be claimed and replayed "
                                   "before its token is checked)"
                                 : "");
        }
    }
    return IDEM_OK;
}

/* One method's flags need the built-ins that enforce them. */
static idem_code method_guard_check(idem_store *store, const idem_method *m, const long pos[4])
{
    unsigned f = m->opts.flags;
    if ((f & IDEM_METHOD_KEY_REQUIRED) && pos[IDEM_BUILTIN_REQUEST_ID] < 0) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "%s requires a key but the chain has no request_id (which resolves "
                         "keys and refuses calls without one)",
                         m->name);
    }
    if ((f & IDEM_METHOD_TOKEN_REQUIRED) && pos[IDEM_BUILTIN_TOKEN] < 0) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "%s requires a token but the chain has no token interceptor: calls "
                         "would pass without one",
                         m->name);
    }
    if ((f & (IDEM_METHOD_CACHED | IDEM_METHOD_TRANSACTIONAL)) &&
        pos[IDEM_BUILTIN_RESULT_CACHE] < 0) {
        return idem__err(IDEM_FAILED_PRECONDITION, "%s is %s but the chain has no result_cache",
                         m->name, (f & IDEM_METHOD_TRANSACTIONAL) ? "transactional" : "cached");
    }
    if ((f & IDEM_METHOD_TRANSACTIONAL) && !idem__store_has(store, IDEM__STORE_CAP_TXN)) {
        return idem__err(IDEM_FAILED_PRECONDITION,
                         "%s is transactional: the %s store has no handler transactions", m->name,
                         idem_store_backend(store));
    }
    return IDEM_OK;
}

idem_code idem__chain_check(const idem_chain *chain, const idem_method *methods, size_t n,
                            idem_store *store)
{
    long pos[4];
    idem_code code;
    if ((code = builtin_positions(chain, pos)) != IDEM_OK ||
        (code = chain_order_check(pos)) != IDEM_OK) {
        return code;
    }
    for (size_t i = 0; i < n; i++) {
        if ((code = method_guard_check(store, &methods[i], pos)) != IDEM_OK) {
            return code;
        }
    }
    return IDEM_OK;
}

bool idem__chain_can_park(const idem_chain *chain)
{
    bool all_builtin = true;
    for (size_t i = 0; i < chain->n; i++) {
        const idem_interceptor *it = &chain->items[i];
        if (it->builtin && it->kind == IDEM_BUILTIN_RESULT_CACHE) {
            return all_builtin;
        }
        all_builtin = all_builtin && it->builtin;
    }
    return false;
}

/* One-way state machines: an entity's state is a compare-and-set inside the caller's txn.
 *
 * The declaration is data (states + allowed transitions), checked on every call, so a
 * typo in a state name is an error and never a write. The stored value is the state
 * name itself: readable with idem_store_app_get() and stable across declaration edits
 * that keep the names. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "toolkit_internal.h"

#include "idemrpc/toolkit.h"

static idem_code sm_bad(const char *what, const char *name)
{
    return idem__err(IDEM_INVALID_ARGUMENT, "state machine: %s%s%s%s", what,
                     name != NULL ? " \"" : "", name != NULL ? name : "", name != NULL ? "\"" : "");
}

/* Index of a declared state, or -1. */
static int sm_state_index(const idem_state_machine *m, const char *name)
{
    if (name == NULL) {
        return -1;
    }
    for (size_t i = 0; i < m->n_states; i++) {
        if (strcmp(m->states[i], name) == 0) {
            return (int)i;
        }
    }
    return -1;
}

static idem_code sm_validate_states(const idem_state_machine *m)
{
    if (m->n_states == 0 || m->n_states > IDEM_SM_MAX_STATES || m->states == NULL) {
        return sm_bad("needs 1..32 states", NULL);
    }
    for (size_t i = 0; i < m->n_states; i++) {
        if (idem__bounded_len(m->states[i], IDEM_SM_MAX_STATE) == 0) {
            return sm_bad("state names must be 1..31 bytes", NULL);
        }
        if (sm_state_index(m, m->states[i]) != (int)i) {
            return sm_bad("repeated state", m->states[i]);
        }
    }
    return IDEM_OK;
}

/* Depth-first from state s over the declared moves: the index of a state that lies on a
 * cycle reachable from s, or -1. color: 0 unseen, 1 on the current path, 2 done. The
 * depth is at most IDEM_SM_MAX_STATES. */
static int sm_cycle_from(const idem_state_machine *m, int s, unsigned char *color)
{
    color[s] = 1;
    for (size_t i = 0; i < m->n_transitions; i++) {
        if (sm_state_index(m, m->transitions[i].from) != s) {
            continue;
        }
        int to = sm_state_index(m, m->transitions[i].to), at;
        if (color[to] == 1) {
            return to;
        }
        if (color[to] == 0 && (at = sm_cycle_from(m, to, color)) >= 0) {
            return at;
        }
    }
    color[s] = 2;
    return -1;
}

/* A one-way machine never comes back to a state it left: with a cycle (open → closed →
 * open) a retried "close" arriving after the reopen would find `from` again and take
 * effect twice. Transitions name declared states (checked before). */
static idem_code sm_validate_acyclic(const idem_state_machine *m)
{
    unsigned char color[IDEM_SM_MAX_STATES] = {0};
    for (size_t s = 0; s < m->n_states; s++) {
        int at = color[s] == 0 ? sm_cycle_from(m, (int)s, color) : -1;
        if (at >= 0) {
            return sm_bad("transitions form a cycle (a retried move would take effect again) "
                          "through",
                          m->states[at]);
        }
    }
    return IDEM_OK;
}

static idem_code sm_validate_transitions(const idem_state_machine *m)
{
    if (m->n_transitions > IDEM_SM_MAX_TRANSITIONS ||
        (m->n_transitions > 0 && m->transitions == NULL)) {
        return sm_bad("at most 64 transitions", NULL);
    }
    for (size_t i = 0; i < m->n_transitions; i++) {
        const idem_sm_transition *tr = &m->transitions[i];
        int from = sm_state_index(m, tr->from), to = sm_state_index(m, tr->to);
        if (from < 0 || to < 0) {
            return sm_bad("transition names an undeclared state", from < 0 ? tr->from : tr->to);
        }
        if (from == to) {
            return sm_bad("self-loop", tr->from);
        }
        for (size_t j = 0; j < i; j++) {
            if (strcmp(m->transitions[j].from, tr->from) == 0 &&
                strcmp(m->transitions[j].to, tr->to) == 0) {
                return sm_bad("repeated transition from", tr->from);
            }
        }
    }
    return sm_validate_acyclic(m);
}

idem_code idem_sm_validate(const idem_state_machine *m)
{
    idem_code code;
    if (m == NULL || idem__bounded_len(m->db, IDEM_MAX_DB_NAME) == 0) {
        return sm_bad("needs a database name of 1..64 bytes", NULL);
    }
    if ((code = sm_validate_states(m)) != IDEM_OK) {
        return code;
    }
    return sm_validate_transitions(m);
}

/* from → to is declared; m is valid and both names are non-NULL. */
static bool sm_declared(const idem_state_machine *m, const char *from, const char *to)
{
    for (size_t i = 0; i < m->n_transitions; i++) {
        if (strcmp(m->transitions[i].from, from) == 0 && strcmp(m->transitions[i].to, to) == 0) {
            return true;
        }
    }
    return false;
}

bool idem_sm_allowed(const idem_state_machine *m, const char *from, const char *to)
{
    return idem_sm_validate(m) == IDEM_OK && from != NULL && to != NULL && sm_declared(m, from, to);
}

/* Validates the machine, the entity id and n required state names. */
static idem_code sm_check(const idem_state_machine *m, const char *entity,
                          const char *const *states, size_t n)
{
    idem_code code = idem_sm_validate(m);
    if (code != IDEM_OK) {
        return code;
    }
    if (idem__bounded_len(entity, IDEM_SM_MAX_ENTITY) == 0) {
        return sm_bad("entity id must be 1..255 bytes", NULL);
    }
    for (size_t i = 0; i < n; i++) {
        if (states[i] == NULL) {
            return sm_bad("a state name is required", NULL);
        }
        if (sm_state_index(m, states[i]) < 0) {
            return sm_bad("undeclared state", states[i]);
        }
    }
    return IDEM_OK;
}

/* The stored state of entity into buf; IDEM_DATA_LOSS for a value that is no state. */
static idem_code sm_state_copy(const idem_state_machine *m, const void *v, size_t n, char *buf,
                               size_t cap)
{
    if (n == 0 || n > IDEM_SM_MAX_STATE || memchr(v, 0, n) != NULL) {
        return idem__err(IDEM_DATA_LOSS, "state machine: stored state is not a state name");
    }
    if (cap <= n) {
        return idem__err(IDEM_INVALID_ARGUMENT, "state machine: buffer below %d bytes",
                         IDEM_SM_MAX_STATE + 1);
    }
    memcpy(buf, v, n);
    buf[n] = '\0';
    if (sm_state_index(m, buf) < 0) {
        return idem__err(IDEM_DATA_LOSS, "state machine: stored state \"%s\" is undeclared", buf);
    }
    return IDEM_OK;
}

/* The state of entity in t, for arguments already checked. */
static idem_code sm_read(idem_txn *t, const idem_state_machine *m, const char *entity, char *buf,
                         size_t cap)
{
    const void *v;
    size_t n;
    idem_code code = idem_txn_get(t, m->db, entity, strlen(entity), &v, &n);
    if (code == IDEM_NOT_FOUND) {
        return idem__err(IDEM_NOT_FOUND, "state machine: no entity \"%s\"", entity);
    }
    return code != IDEM_OK ? code : sm_state_copy(m, v, n, buf, cap);
}

idem_code idem_sm_get(idem_txn *t, const idem_state_machine *m, const char *entity, char *buf,
                      size_t cap)
{
    idem_code code = sm_check(m, entity, NULL, 0);
    return code != IDEM_OK ? code : sm_read(t, m, entity, buf, cap);
}

idem_code idem_store_sm_get(idem_store *st, const idem_state_machine *m, const char *entity,
                            char *buf, size_t cap)
{
    void *v;
    size_t n;
    idem_code code = sm_check(m, entity, NULL, 0);
    if (code != IDEM_OK) {
        return code;
    }
    if ((code = idem_store_app_get(st, m->db, entity, strlen(entity), &v, &n)) != IDEM_OK) {
        return code;
    }
    code = sm_state_copy(m, v, n, buf, cap);
    free(v);
    return code;
}

idem_code idem_sm_create(idem_txn *t, const idem_state_machine *m, const char *entity,
                         const char *state)
{
    char cur[IDEM_SM_MAX_STATE + 1];
    idem_code code = sm_check(m, entity, &state, 1);
    if (code != IDEM_OK) {
        return code;
    }
    code = sm_read(t, m, entity, cur, sizeof(cur));
    if (code == IDEM_OK) {
        return idem__err(IDEM_ALREADY_EXISTS, "state machine: \"%s\" exists (in %s)", entity, cur);
    }
    if (code != IDEM_NOT_FOUND) {
        return code;
    }
    return idem_txn_put(t, m->db, entity, strlen(entity), state, strlen(state));
}

idem_code idem_sm_advance(idem_txn *t, const idem_state_machine *m, const char *entity,
                          const char *from, const char *to, idem_sm_outcome *outcome)
{
    char cur[IDEM_SM_MAX_STATE + 1];
    idem_code code = sm_check(m, entity, (const char *const[]){from, to}, 2);
    if (code != IDEM_OK) {
        return code;
    }
    if (!sm_declared(m, from, to)) {
        return idem__err(IDEM_FAILED_PRECONDITION, "illegal transition %s -> %s", from, to);
    }
    if ((code = sm_read(t, m, entity, cur, sizeof(cur))) != IDEM_OK) {
        return code;
    }
    if (strcmp(cur, to) == 0) {
        if (outcome != NULL) {
            *outcome = IDEM_SM_DUPLICATE;
        }
        return IDEM_OK;
    }
    if (strcmp(cur, from) != 0) {
        return idem__err(IDEM_FAILED_PRECONDITION, "\"%s\" is %s, not %s: cannot move to %s",
                         entity, cur, from, to);
    }
    if ((code = idem_txn_put(t, m->db, entity, strlen(entity), to, strlen(to))) != IDEM_OK) {
        return code;
    }
    if (outcome != NULL) {
        *outcome = IDEM_SM_ADVANCED;
    }
    return IDEM_OK;
}

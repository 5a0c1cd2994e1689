/* Tests of the business toolkit (toolkit.h): store txns, the one-way state machine,
 * versioned records with the conflict-retry helper, and message-consume dedupe. One
 * suite for both stores: meson runs it as `toolkit` on LMDB and as `toolkit_pg` on
 * PostgreSQL (IDEMRPC_TEST_BACKEND=postgres). Every test gets a fresh store: its own
 * temp dir, or its own schema. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "testutil.h"

static tu_backend backend;
static idem_store *st;

static void store_setup(void)
{
    st = tu_backend_open(&backend, "toolkit");
}

static void store_teardown(void)
{
    tu_backend_close(&backend);
    st = NULL;
}

TestSuite(store_txn, .init = store_setup, .fini = store_teardown);
TestSuite(state_machine, .init = store_setup, .fini = store_teardown);
TestSuite(versioned, .init = store_setup, .fini = store_teardown);
TestSuite(conflict_retry, .init = store_setup, .fini = store_teardown);
TestSuite(consume, .init = store_setup, .fini = store_teardown);

/* ---- helpers ---- */

/* The value of db/key as a string ("" when absent), read outside any txn. */
static const char *app_value(const char *db, const char *key)
{
    return tu_app_value(st, db, key);
}

typedef struct put_args {
    const char *db, *key, *val;
    idem_code then; /* what the txn function returns after its write */
} put_args;

static idem_code put_then(idem_txn *t, void *arg)
{
    put_args *a = arg;
    idem_code code = idem_txn_put(t, a->db, a->key, strlen(a->key), a->val, strlen(a->val));
    return code != IDEM_OK ? code : a->then;
}

/* ---- store txn ---- */

Test(store_txn, commits_when_the_function_returns_ok)
{
    put_args a = {"ledger", "acct-1", "100", IDEM_OK};
    cr_assert_eq(idem_store_run_txn(st, put_then, &a), IDEM_OK, "%s", idem_errmsg());
    cr_expect_str_eq(app_value("ledger", "acct-1"), "100");
}

Test(store_txn, rolls_back_every_write_when_the_function_fails)
{
    put_args ok = {"ledger", "acct-1", "100", IDEM_OK};
    put_args fail = {"ledger", "acct-1", "999", IDEM_FAILED_PRECONDITION};
    cr_assert_eq(idem_store_run_txn(st, put_then, &ok), IDEM_OK);
    cr_expect_eq(idem_store_run_txn(st, put_then, &fail), IDEM_FAILED_PRECONDITION,
                 "the function's code is returned");
    cr_expect_str_eq(app_value("ledger", "acct-1"), "100", "the failed write is gone");
}

Test(store_txn, needs_a_store_and_a_function)
{
    cr_expect_eq(idem_store_run_txn(st, NULL, NULL), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem_store_run_txn(NULL, put_then, NULL), IDEM_INVALID_ARGUMENT);
}

/* ---- state machine ---- */

static const char *const order_states[] = {"CREATED", "PAID", "REFUNDED", "CANCELLED"};
static const idem_sm_transition order_moves[] = {
    {"CREATED", "PAID"}, {"PAID", "REFUNDED"}, {"CREATED", "CANCELLED"}};
static const idem_state_machine orders = {"order_state", order_states, 4, order_moves, 3};

typedef struct sm_args {
    const idem_state_machine *m;
    const char *entity, *from, *to;
    idem_sm_outcome outcome;
    idem_code then; /* returned after a successful step */
} sm_args;

static idem_code sm_create_fn(idem_txn *t, void *arg)
{
    sm_args *a = arg;
    return idem_sm_create(t, a->m, a->entity, a->from);
}

static idem_code sm_advance_fn(idem_txn *t, void *arg)
{
    sm_args *a = arg;
    idem_code code = idem_sm_advance(t, a->m, a->entity, a->from, a->to, &a->outcome);
    return code != IDEM_OK ? code : a->then;
}

static idem_code create_order(const char *entity, const char *state)
{
    sm_args a = {.m = &orders, .entity = entity, .from = state};
    return idem_store_run_txn(st, sm_create_fn, &a);
}

static idem_code advance(const char *entity, const char *from, const char *to,
                         idem_sm_outcome *outcome)
{
    sm_args a = {.m = &orders, .entity = entity, .from = from, .to = to};
    idem_code code = idem_store_run_txn(st, sm_advance_fn, &a);
    if (outcome != NULL) {
        *outcome = code == IDEM_OK ? a.outcome : 0;
    }
    return code;
}

static const char *state_of(const char *entity)
{
    static char buf[IDEM_SM_MAX_STATE + 1];
    idem_code code = idem_store_sm_get(st, &orders, entity, buf, sizeof(buf));
    return code == IDEM_OK ? buf : idem_code_name(code);
}

Test(state_machine, the_order_machine_is_a_valid_declaration)
{
    cr_expect_eq(idem_sm_validate(&orders), IDEM_OK, "%s", idem_errmsg());
}

Test(state_machine, bad_declarations_are_invalid_argument)
{
    static const char *const dup[] = {"A", "A"};
    static const char *const empty[] = {"A", ""};
    static const char *const long_name[] = {"A", "THIS_STATE_NAME_IS_LONGER_THAN_31B"};
    static const char *const ab[] = {"A", "B"};
    static const idem_sm_transition undeclared[] = {{"A", "C"}};
    static const idem_sm_transition self[] = {{"A", "A"}};
    static const idem_sm_transition twice[] = {{"A", "B"}, {"A", "B"}};
    static const char *many[IDEM_SM_MAX_STATES + 1];
    const idem_state_machine bad[] = {
        {NULL, ab, 2, NULL, 0},
        {"db", NULL, 0, NULL, 0},
        {"db", dup, 2, NULL, 0},
        {"db", empty, 2, NULL, 0},
        {"db", long_name, 2, NULL, 0},
        {"db", ab, 2, undeclared, 1},
        {"db", ab, 2, self, 1},
        {"db", ab, 2, twice, 2},
        {"db", many, IDEM_SM_MAX_STATES + 1, NULL, 0},
    };
    for (size_t i = 0; i < IDEM_ARRAY_LEN(bad); i++) {
        cr_expect_eq(idem_sm_validate(&bad[i]), IDEM_INVALID_ARGUMENT, "declaration %zu", i);
    }
    sm_args a = {.m = &bad[5], .entity = "e-1", .from = "A"};
    cr_expect_eq(idem_store_run_txn(st, sm_create_fn, &a), IDEM_INVALID_ARGUMENT,
                 "a bad declaration never writes");
}

Test(state_machine, transitions_that_form_a_cycle_are_refused_and_never_write)
{
    static const char *const door[] = {"open", "closed"};
    static const idem_sm_transition back_and_forth[] = {{"open", "closed"}, {"closed", "open"}};
    static const char *const abcd[] = {"A", "B", "C", "D"};
    static const idem_sm_transition ring[] = {{"A", "B"}, {"B", "C"}, {"C", "D"}, {"D", "B"}};
    static const idem_sm_transition diamond[] = {{"A", "B"}, {"A", "C"}, {"B", "D"}, {"C", "D"}};
    const idem_state_machine two = {"doors", door, 2, back_and_forth, 2};
    const idem_state_machine three = {"rings", abcd, 4, ring, 4};
    const idem_state_machine joins = {"diamonds", abcd, 4, diamond, 4};
    cr_expect_eq(idem_sm_validate(&two), IDEM_INVALID_ARGUMENT, "open -> closed -> open");
    cr_expect(strstr(idem_errmsg(), "cycle") != NULL, "%s", idem_errmsg());
    cr_expect_eq(idem_sm_validate(&three), IDEM_INVALID_ARGUMENT, "B -> C -> D -> B");
    cr_expect(strstr(idem_errmsg(), "\"B\"") != NULL, "names a state on it: %s", idem_errmsg());
    cr_expect_eq(idem_sm_validate(&joins), IDEM_OK, "two paths to one state are no cycle: %s",
                 idem_errmsg());
    /* The retried "close" of a redelivered message after a reopen: refused before it can
     * answer ADVANCED a second time, because the machine itself is refused. */
    sm_args a = {.m = &two, .entity = "door-7", .from = "open"};
    cr_expect_eq(idem_store_run_txn(st, sm_create_fn, &a), IDEM_INVALID_ARGUMENT);
    char buf[IDEM_SM_MAX_STATE + 1];
    const idem_state_machine doors = {"doors", door, 2, NULL, 0};
    cr_expect_eq(idem_store_sm_get(st, &doors, "door-7", buf, sizeof(buf)), IDEM_NOT_FOUND,
                 "nothing written");
}

Test(state_machine, only_declared_transitions_are_allowed)
{
    cr_expect(idem_sm_allowed(&orders, "CREATED", "PAID"));
    cr_expect(idem_sm_allowed(&orders, "PAID", "REFUNDED"));
    cr_expect_not(idem_sm_allowed(&orders, "PAID", "CREATED"), "one-way");
    cr_expect_not(idem_sm_allowed(&orders, "CREATED", "REFUNDED"), "no jumps");
    cr_expect_not(idem_sm_allowed(&orders, "CANCELLED", "PAID"));
}

Test(state_machine, create_writes_the_state_once_and_refuses_a_second_create)
{
    cr_assert_eq(create_order("ord-1", "CREATED"), IDEM_OK, "%s", idem_errmsg());
    cr_expect_str_eq(state_of("ord-1"), "CREATED");
    cr_assert_eq(advance("ord-1", "CREATED", "PAID", NULL), IDEM_OK);
    cr_expect_eq(create_order("ord-1", "CREATED"), IDEM_ALREADY_EXISTS);
    cr_expect_str_eq(state_of("ord-1"), "PAID", "the second create wrote nothing");
}

Test(state_machine, advance_from_the_current_state_moves_it)
{
    idem_sm_outcome out;
    cr_assert_eq(create_order("ord-1", "CREATED"), IDEM_OK);
    cr_assert_eq(advance("ord-1", "CREATED", "PAID", &out), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(out, IDEM_SM_ADVANCED);
    cr_expect_str_eq(state_of("ord-1"), "PAID");
    cr_assert_eq(advance("ord-1", "PAID", "REFUNDED", &out), IDEM_OK);
    cr_expect_eq(out, IDEM_SM_ADVANCED);
    cr_expect_str_eq(state_of("ord-1"), "REFUNDED");
}

Test(state_machine, advance_to_the_current_state_is_a_duplicate_no_op)
{
    idem_sm_outcome out;
    cr_assert_eq(create_order("ord-1", "CREATED"), IDEM_OK);
    cr_assert_eq(advance("ord-1", "CREATED", "PAID", &out), IDEM_OK);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(advance("ord-1", "CREATED", "PAID", &out), IDEM_OK);
        cr_expect_eq(out, IDEM_SM_DUPLICATE, "replay %d is a duplicate", i);
    }
    cr_expect_str_eq(state_of("ord-1"), "PAID");
}

Test(state_machine, illegal_jump_is_failed_precondition_and_writes_nothing)
{
    cr_assert_eq(create_order("ord-1", "CREATED"), IDEM_OK);
    cr_expect_eq(advance("ord-1", "CREATED", "REFUNDED", NULL), IDEM_FAILED_PRECONDITION);
    cr_expect_eq(advance("ord-1", "PAID", "CREATED", NULL), IDEM_FAILED_PRECONDITION, "backwards");
    cr_expect_str_eq(state_of("ord-1"), "CREATED");
}

Test(state_machine, advance_from_a_state_the_entity_is_not_in_is_failed_precondition)
{
    cr_assert_eq(create_order("ord-1", "CREATED"), IDEM_OK);
    cr_assert_eq(advance("ord-1", "CREATED", "CANCELLED", NULL), IDEM_OK);
    cr_expect_eq(advance("ord-1", "CREATED", "PAID", NULL), IDEM_FAILED_PRECONDITION,
                 "a late payment of a cancelled order");
    cr_expect(strstr(idem_errmsg(), "CANCELLED") != NULL, "names the state: %s", idem_errmsg());
    cr_expect_str_eq(state_of("ord-1"), "CANCELLED");

    cr_assert_eq(create_order("ord-2", "CREATED"), IDEM_OK);
    cr_expect_eq(advance("ord-2", "PAID", "REFUNDED", NULL), IDEM_FAILED_PRECONDITION,
                 "a refund of an unpaid order");
    cr_expect_str_eq(state_of("ord-2"), "CREATED");
}

Test(state_machine, advance_of_an_unknown_entity_is_not_found)
{
    cr_expect_eq(advance("ord-404", "CREATED", "PAID", NULL), IDEM_NOT_FOUND);
    cr_expect_str_eq(state_of("ord-404"), "NOT_FOUND", "and creates nothing");
}

Test(state_machine, undeclared_states_and_bad_entity_ids_are_invalid_argument)
{
    char long_id[IDEM_SM_MAX_ENTITY + 2];
    memset(long_id, 'x', sizeof(long_id) - 1);
    long_id[sizeof(long_id) - 1] = '\0';
    cr_assert_eq(create_order("ord-1", "CREATED"), IDEM_OK);
    cr_expect_eq(advance("ord-1", "CREATED", "SHIPPED", NULL), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(create_order("ord-2", "NEW"), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(advance("ord-1", NULL, "PAID", NULL), IDEM_INVALID_ARGUMENT, "a missing state");
    cr_expect_eq(create_order("ord-2", NULL), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(create_order(long_id, "CREATED"), IDEM_INVALID_ARGUMENT, "256-byte id");
    cr_expect_eq(create_order("", "CREATED"), IDEM_INVALID_ARGUMENT);
    long_id[IDEM_SM_MAX_ENTITY] = '\0';
    cr_expect_eq(create_order(long_id, "CREATED"), IDEM_OK, "255 bytes is allowed");
    cr_expect_str_eq(state_of("ord-1"), "CREATED");
    cr_expect_str_eq(state_of("ord-2"), "NOT_FOUND");
}

Test(state_machine, a_stored_value_that_is_no_declared_state_is_data_loss)
{
    put_args a = {"order_state", "ord-1", "SHIPPED", IDEM_OK};
    cr_assert_eq(idem_store_run_txn(st, put_then, &a), IDEM_OK);
    cr_expect_eq(advance("ord-1", "CREATED", "PAID", NULL), IDEM_DATA_LOSS);
    cr_expect_str_eq(app_value("order_state", "ord-1"), "SHIPPED", "left as found");
}

Test(state_machine, an_aborted_txn_takes_the_advance_with_it)
{
    sm_args a = {
        .m = &orders, .entity = "ord-1", .from = "CREATED", .to = "PAID", .then = IDEM_UNAVAILABLE};
    cr_assert_eq(create_order("ord-1", "CREATED"), IDEM_OK);
    cr_expect_eq(idem_store_run_txn(st, sm_advance_fn, &a), IDEM_UNAVAILABLE);
    cr_expect_eq(a.outcome, IDEM_SM_ADVANCED, "it had advanced inside the txn");
    cr_expect_str_eq(state_of("ord-1"), "CREATED", "and the abort undid it");
}

#define RACERS 8

static atomic_int advanced, duplicates;

static void *race_advance(void *arg)
{
    (void)arg;
    idem_sm_outcome out;
    if (advance("ord-1", "CREATED", "PAID", &out) == IDEM_OK) {
        atomic_fetch_add(out == IDEM_SM_ADVANCED ? &advanced : &duplicates, 1);
    }
    return NULL;
}

Test(state_machine, of_concurrent_advances_exactly_one_wins)
{
    pthread_t th[RACERS];
    atomic_store(&advanced, 0);
    atomic_store(&duplicates, 0);
    cr_assert_eq(create_order("ord-1", "CREATED"), IDEM_OK);
    for (int i = 0; i < RACERS; i++) {
        cr_assert_eq(pthread_create(&th[i], NULL, race_advance, NULL), 0);
    }
    for (int i = 0; i < RACERS; i++) {
        pthread_join(th[i], NULL);
    }
    cr_expect_eq(atomic_load(&advanced), 1);
    cr_expect_eq(atomic_load(&duplicates), RACERS - 1);
}

/* ---- versioned records ---- */

typedef struct ver_args {
    const char *key;
    uint64_t expected;
    const void *val;
    size_t len;
    uint64_t new_version;
} ver_args;

static idem_code ver_put_fn(idem_txn *t, void *arg)
{
    ver_args *a = arg;
    return idem_versioned_put(t, "accounts", a->key, strlen(a->key), a->expected, a->val, a->len,
                              &a->new_version);
}

static idem_code ver_put(const char *key, uint64_t expected, const char *val, uint64_t *new_version)
{
    ver_args a = {key, expected, val, strlen(val), 0};
    idem_code code = idem_store_run_txn(st, ver_put_fn, &a);
    if (new_version != NULL) {
        *new_version = a.new_version;
    }
    return code;
}

/* "value@version" of a versioned record, or the code name. */
static const char *ver_read(const char *key)
{
    static char buf[128];
    void *v;
    size_t n;
    uint64_t version;
    idem_code code = idem_store_versioned_get(st, "accounts", key, strlen(key), &v, &n, &version);
    if (code != IDEM_OK) {
        snprintf(buf, sizeof(buf), "%s@%llu", idem_code_name(code), (unsigned long long)version);
        return buf;
    }
    snprintf(buf, sizeof(buf), "%.*s@%llu", (int)n, (const char *)v, (unsigned long long)version);
    free(v);
    return buf;
}

Test(versioned, an_absent_record_reads_not_found_at_version_zero)
{
    cr_expect_str_eq(ver_read("acct-1"), "NOT_FOUND@0");
}

Test(versioned, the_first_put_expects_zero_and_makes_version_one)
{
    uint64_t v;
    cr_assert_eq(ver_put("acct-1", 0, "100", &v), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(v, 1);
    cr_expect_str_eq(ver_read("acct-1"), "100@1");
}

Test(versioned, a_put_with_the_version_read_succeeds_and_bumps_it)
{
    uint64_t v;
    cr_assert_eq(ver_put("acct-1", 0, "100", NULL), IDEM_OK);
    cr_assert_eq(ver_put("acct-1", 1, "150", &v), IDEM_OK);
    cr_expect_eq(v, 2);
    cr_assert_eq(ver_put("acct-1", 2, "120", &v), IDEM_OK);
    cr_expect_str_eq(ver_read("acct-1"), "120@3");
}

Test(versioned, a_put_with_a_stale_version_is_aborted_and_writes_nothing)
{
    cr_assert_eq(ver_put("acct-1", 0, "100", NULL), IDEM_OK);
    cr_assert_eq(ver_put("acct-1", 1, "150", NULL), IDEM_OK);
    cr_expect_eq(ver_put("acct-1", 1, "50", NULL), IDEM_ABORTED, "read at 1, now at 2");
    cr_expect(strstr(idem_errmsg(), "version conflict") != NULL, "%s", idem_errmsg());
    cr_expect_eq(ver_put("acct-1", 7, "50", NULL), IDEM_ABORTED, "a version from the future");
    cr_expect_str_eq(ver_read("acct-1"), "150@2");
}

Test(versioned, creating_what_exists_or_updating_what_is_absent_is_aborted)
{
    cr_assert_eq(ver_put("acct-1", 0, "100", NULL), IDEM_OK);
    cr_expect_eq(ver_put("acct-1", 0, "999", NULL), IDEM_ABORTED, "a second create");
    cr_expect_eq(ver_put("acct-2", 1, "999", NULL), IDEM_ABORTED, "absent is version 0");
    cr_expect_str_eq(ver_read("acct-1"), "100@1");
    cr_expect_str_eq(ver_read("acct-2"), "NOT_FOUND@0");
}

Test(versioned, a_read_modify_write_over_two_txns_cannot_lose_an_update)
{
    void *v;
    size_t n;
    uint64_t seen;
    cr_assert_eq(ver_put("acct-1", 0, "100", NULL), IDEM_OK);
    cr_assert_eq(idem_store_versioned_get(st, "accounts", "acct-1", 6, &v, &n, &seen), IDEM_OK);
    free(v);
    cr_assert_eq(ver_put("acct-1", seen, "130", NULL), IDEM_OK, "a concurrent +30 commits");
    cr_expect_eq(ver_put("acct-1", seen, "90", NULL), IDEM_ABORTED,
                 "the -10 computed from 100 is refused");
    cr_expect_str_eq(ver_read("acct-1"), "130@2");
}

Test(versioned, values_are_bounded_and_may_be_empty)
{
    ver_args a = {"acct-1", 0, NULL, 0, 0};
    char *big = calloc(1, IDEM_VERSIONED_MAX_VALUE + 1);
    cr_assert_not_null(big);
    cr_expect_eq(idem_store_run_txn(st, ver_put_fn, &a), IDEM_OK, "empty value");
    cr_expect_str_eq(ver_read("acct-1"), "@1");
    a = (ver_args){"acct-2", 0, big, IDEM_VERSIONED_MAX_VALUE + 1, 0};
    cr_expect_eq(idem_store_run_txn(st, ver_put_fn, &a), IDEM_INVALID_ARGUMENT);
    a.len = IDEM_VERSIONED_MAX_VALUE;
    cr_expect_eq(idem_store_run_txn(st, ver_put_fn, &a), IDEM_OK, "%s", idem_errmsg());
    free(big);
}

Test(versioned, a_plain_value_is_not_a_versioned_record)
{
    put_args p = {"accounts", "acct-1", "100", IDEM_OK};
    cr_assert_eq(idem_store_run_txn(st, put_then, &p), IDEM_OK);
    cr_expect_str_eq(ver_read("acct-1"), "DATA_LOSS@0");
    cr_expect_eq(ver_put("acct-1", 0, "5", NULL), IDEM_DATA_LOSS, "and is not overwritten");
    cr_expect_str_eq(app_value("accounts", "acct-1"), "100");
}

/* ---- conflict retry ---- */

typedef struct script {
    int conflicts;   /* attempts that return ABORTED first */
    idem_code final; /* then this */
    atomic_int calls;
    uint32_t last_attempt;
    int hook_calls;
    uint32_t hook_attempts;
    void *hook_fn_arg, *hook_arg;
} script;

static idem_code scripted(void *arg, uint32_t attempt)
{
    script *s = arg;
    int n = atomic_fetch_add(&s->calls, 1);
    s->last_attempt = attempt;
    return n < s->conflicts ? IDEM_ABORTED : s->final;
}

static void exhausted(void *fn_arg, uint32_t attempts, void *hook_arg)
{
    script *s = fn_arg;
    s->hook_calls++;
    s->hook_attempts = attempts;
    s->hook_fn_arg = fn_arg;
    s->hook_arg = hook_arg;
}

static const idem_conflict_policy fast = {
    .max_attempts = 4, .base_ms = 1, .max_ms = 2, .on_exhausted = exhausted, .hook_arg = "pager"};

Test(conflict_retry, a_first_success_runs_once)
{
    script s = {.conflicts = 0, .final = IDEM_OK};
    cr_expect_eq(idem_retry_on_conflict(&fast, scripted, &s), IDEM_OK);
    cr_expect_eq(atomic_load(&s.calls), 1);
    cr_expect_eq(s.hook_calls, 0);
}

Test(conflict_retry, conflicts_rerun_the_function_until_it_succeeds)
{
    script s = {.conflicts = 3, .final = IDEM_OK};
    cr_expect_eq(idem_retry_on_conflict(&fast, scripted, &s), IDEM_OK);
    cr_expect_eq(atomic_load(&s.calls), 4);
    cr_expect_eq(s.last_attempt, 4, "attempts are numbered from 1");
    cr_expect_eq(s.hook_calls, 0);
}

Test(conflict_retry, other_errors_are_returned_at_once)
{
    script s = {.conflicts = 1, .final = IDEM_FAILED_PRECONDITION};
    cr_expect_eq(idem_retry_on_conflict(&fast, scripted, &s), IDEM_FAILED_PRECONDITION);
    cr_expect_eq(atomic_load(&s.calls), 2, "one conflict, then the final error");
}

Test(conflict_retry, exhaustion_is_aborted_and_calls_the_hook_once)
{
    script s = {.conflicts = 1000, .final = IDEM_OK};
    cr_expect_eq(idem_retry_on_conflict(&fast, scripted, &s), IDEM_ABORTED);
    cr_expect_eq(atomic_load(&s.calls), 4);
    cr_expect_eq(s.hook_calls, 1);
    cr_expect_eq(s.hook_attempts, 4);
    cr_expect_eq(s.hook_fn_arg, &s);
    cr_expect_str_eq(s.hook_arg, "pager");
    cr_expect(strstr(idem_errmsg(), "gave up after 4 attempts") != NULL, "%s", idem_errmsg());
}

Test(conflict_retry, attempts_are_capped)
{
    idem_conflict_policy p = {.max_attempts = 100000, .base_ms = 1, .max_ms = 1};
    script s = {.conflicts = 1000000, .final = IDEM_OK};
    cr_expect_eq(idem_retry_on_conflict(&p, scripted, &s), IDEM_ABORTED);
    cr_expect_eq(atomic_load(&s.calls), IDEM_CONFLICT_MAX_ATTEMPTS);
}

Test(conflict_retry, one_attempt_means_no_retry_and_defaults_allow_five)
{
    idem_conflict_policy once = {.max_attempts = 1};
    script s = {.conflicts = 10, .final = IDEM_OK};
    cr_expect_eq(idem_retry_on_conflict(&once, scripted, &s), IDEM_ABORTED);
    cr_expect_eq(atomic_load(&s.calls), 1);
    script d = {.conflicts = 10, .final = IDEM_OK};
    cr_expect_eq(idem_retry_on_conflict(NULL, scripted, &d), IDEM_ABORTED);
    cr_expect_eq(atomic_load(&d.calls), 5);
    cr_expect_eq(idem_retry_on_conflict(NULL, NULL, NULL), IDEM_INVALID_ARGUMENT);
}

/* A counter incremented by read-snapshot-then-CAS from several threads at once. */
#define INCREMENTERS 4
#define INCREMENTS 40

static atomic_int hook_fired, increments_failed;

static void count_hook(void *fn_arg, uint32_t attempts, void *hook_arg)
{
    (void)fn_arg, (void)attempts, (void)hook_arg;
    atomic_fetch_add(&hook_fired, 1);
}

static idem_code increment_once(void *arg, uint32_t attempt)
{
    (void)arg, (void)attempt;
    void *v;
    size_t n;
    long long count = 0;
    uint64_t seen;
    idem_code code = idem_store_versioned_get(st, "accounts", "counter", 7, &v, &n, &seen);
    if (code == IDEM_OK) {
        memcpy(&count, v, sizeof(count));
        free(v);
    } else if (code != IDEM_NOT_FOUND) {
        return code;
    }
    count++;
    ver_args a = {"counter", seen, &count, sizeof(count), 0};
    return idem_store_run_txn(st, ver_put_fn, &a);
}

static void *incrementer(void *arg)
{
    idem_conflict_policy p = {.max_attempts = IDEM_CONFLICT_MAX_ATTEMPTS,
                              .base_ms = 1,
                              .max_ms = 4,
                              .on_exhausted = count_hook};
    for (int i = 0; i < INCREMENTS; i++) {
        if (idem_retry_on_conflict(&p, increment_once, arg) != IDEM_OK) {
            atomic_fetch_add(&increments_failed, 1);
        }
    }
    return NULL;
}

Test(conflict_retry, concurrent_optimistic_increments_lose_no_update)
{
    pthread_t th[INCREMENTERS];
    atomic_store(&hook_fired, 0);
    atomic_store(&increments_failed, 0);
    for (int i = 0; i < INCREMENTERS; i++) {
        cr_assert_eq(pthread_create(&th[i], NULL, incrementer, NULL), 0);
    }
    for (int i = 0; i < INCREMENTERS; i++) {
        pthread_join(th[i], NULL);
    }
    void *v;
    size_t n;
    uint64_t version;
    long long count;
    cr_assert_eq(idem_store_versioned_get(st, "accounts", "counter", 7, &v, &n, &version), IDEM_OK);
    memcpy(&count, v, sizeof(count));
    free(v);
    cr_expect_eq(count, INCREMENTERS * INCREMENTS);
    cr_expect_eq(version, INCREMENTERS * INCREMENTS, "one version per committed increment");
    cr_expect_eq(atomic_load(&hook_fired), 0);
    cr_expect_eq(atomic_load(&increments_failed), 0);
}

/* ---- consume ---- */

typedef struct consumer {
    const char *credit_key; /* fn's effect: ledger/<credit_key> += 1 */
    idem_code result;       /* what fn returns after its write */
    atomic_int runs;
} consumer;

static idem_code credit_fn(idem_txn *t, void *arg)
{
    consumer *c = arg;
    const void *v;
    size_t n;
    long long balance = 0;
    atomic_fetch_add(&c->runs, 1);
    if (idem_txn_get(t, "ledger", c->credit_key, strlen(c->credit_key), &v, &n) == IDEM_OK) {
        memcpy(&balance, v, sizeof(balance));
    }
    balance++;
    idem_code code =
        idem_txn_put(t, "ledger", c->credit_key, strlen(c->credit_key), &balance, sizeof(balance));
    return code != IDEM_OK ? code : c->result;
}

static long long credits(const char *key)
{
    void *v;
    size_t n;
    long long balance = 0;
    if (idem_store_app_get(st, "ledger", key, strlen(key), &v, &n) == IDEM_OK) {
        memcpy(&balance, v, sizeof(balance));
        free(v);
    }
    return balance;
}

Test(consume, the_first_delivery_runs_fn_and_acks)
{
    consumer c = {.credit_key = "acct-1", .result = IDEM_OK};
    idem_consume_info info;
    uint64_t at;
    cr_expect_eq(idem_consume_ex(st, "commission", "msg-1", credit_fn, &c, &info),
                 IDEM_CONSUME_ACK);
    cr_expect_not(info.duplicate);
    cr_expect_eq(info.code, IDEM_OK);
    cr_expect_eq(atomic_load(&c.runs), 1);
    cr_expect_eq(credits("acct-1"), 1);
    cr_assert_eq(idem_consume_lookup(st, "commission", "msg-1", &at), IDEM_OK);
    cr_expect_eq(at, info.consumed_at_ms);
}

Test(consume, a_redelivery_acks_as_duplicate_without_running_fn)
{
    consumer c = {.credit_key = "acct-1", .result = IDEM_OK};
    idem_consume_info first, again;
    cr_assert_eq(idem_consume_ex(st, "commission", "msg-1", credit_fn, &c, &first),
                 IDEM_CONSUME_ACK);
    for (int i = 0; i < 5; i++) {
        cr_expect_eq(idem_consume_ex(st, "commission", "msg-1", credit_fn, &c, &again),
                     IDEM_CONSUME_ACK);
        cr_expect(again.duplicate);
        cr_expect_eq(again.consumed_at_ms, first.consumed_at_ms, "when it was first consumed");
    }
    cr_expect_eq(atomic_load(&c.runs), 1);
    cr_expect_eq(credits("acct-1"), 1);
}

Test(consume, a_failing_fn_is_retry_with_nothing_recorded_and_its_writes_rolled_back)
{
    consumer c = {.credit_key = "acct-1", .result = IDEM_UNAVAILABLE};
    idem_consume_info info;
    cr_expect_eq(idem_consume_ex(st, "commission", "msg-1", credit_fn, &c, &info),
                 IDEM_CONSUME_RETRY);
    cr_expect_eq(info.code, IDEM_UNAVAILABLE, "fn's code");
    cr_expect_eq(credits("acct-1"), 0, "fn's write is gone");
    cr_expect_eq(idem_consume_lookup(st, "commission", "msg-1", NULL), IDEM_NOT_FOUND);

    c.result = IDEM_OK; /* the redelivery succeeds */
    cr_expect_eq(idem_consume(st, "commission", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK);
    cr_expect_eq(idem_consume(st, "commission", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK);
    cr_expect_eq(atomic_load(&c.runs), 2, "the failed run and the successful one");
    cr_expect_eq(credits("acct-1"), 1, "one effect");
}

Test(consume, groups_consume_the_same_key_independently)
{
    consumer c = {.credit_key = "acct-1", .result = IDEM_OK};
    cr_expect_eq(idem_consume(st, "commission", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK);
    cr_expect_eq(idem_consume(st, "audit", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK);
    cr_expect_eq(idem_consume(st, "audit", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK);
    cr_expect_eq(atomic_load(&c.runs), 2);
    cr_expect_eq(credits("acct-1"), 2);
}

Test(consume, groups_and_keys_are_bounded)
{
    char key[IDEM_MAX_MSG_KEY + 2], group[IDEM_MAX_CONSUMER_GROUP + 2];
    consumer c = {.credit_key = "acct-1", .result = IDEM_OK};
    idem_consume_info info;
    memset(key, 'k', sizeof(key) - 1);
    key[sizeof(key) - 1] = '\0';
    memset(group, 'g', sizeof(group) - 1);
    group[sizeof(group) - 1] = '\0';
    /* Redelivering these can never succeed: REJECT, not RETRY (which loops forever). */
    cr_expect_eq(idem_consume_ex(st, "commission", key, credit_fn, &c, &info), IDEM_CONSUME_REJECT);
    cr_expect_eq(info.code, IDEM_INVALID_ARGUMENT, "a 256-byte key");
    cr_expect_eq(idem_consume_ex(st, group, "msg-1", credit_fn, &c, &info), IDEM_CONSUME_REJECT);
    cr_expect_eq(info.code, IDEM_INVALID_ARGUMENT, "a 65-byte group");
    cr_expect_eq(idem_consume(st, "", "msg-1", credit_fn, &c), IDEM_CONSUME_REJECT);
    cr_expect_eq(idem_consume(st, "commission", NULL, credit_fn, &c), IDEM_CONSUME_REJECT);
    cr_expect_eq(idem_consume(st, "commission", "msg-1", NULL, &c), IDEM_CONSUME_REJECT);
    cr_expect_eq(atomic_load(&c.runs), 0, "fn never ran");
    key[IDEM_MAX_MSG_KEY] = '\0';
    group[IDEM_MAX_CONSUMER_GROUP] = '\0';
    cr_expect_eq(idem_consume(st, group, key, credit_fn, &c), IDEM_CONSUME_ACK,
                 "the bounds themselves are allowed: %s", idem_errmsg());
}

static idem_code mark_fn(idem_txn *t, void *arg)
{
    return idem_consume_mark(t, "rpc-consumer", arg);
}

static idem_code consume_inside(idem_txn *t, void *arg)
{
    (void)t;
    idem_consume_info *info = arg;
    consumer c = {.credit_key = "acct-1", .result = IDEM_OK};
    return idem_consume_ex(st, "commission", "msg-in", credit_fn, &c, info) == IDEM_CONSUME_REJECT
               ? IDEM_OK
               : IDEM_INTERNAL;
}

Test(consume, a_consume_from_inside_a_txn_is_rejected_not_retried_forever)
{
    idem_consume_info info;
    cr_expect_eq(idem_store_run_txn(st, consume_inside, &info), IDEM_OK);
    cr_expect_eq(info.code, IDEM_FAILED_PRECONDITION, "%s", idem_code_name(info.code));
}

Test(consume, mark_inside_a_txn_reports_a_duplicate_as_already_exists)
{
    consumer c = {.credit_key = "acct-1", .result = IDEM_OK};
    cr_expect_eq(idem_store_run_txn(st, mark_fn, "msg-1"), IDEM_OK);
    cr_expect_eq(idem_store_run_txn(st, mark_fn, "msg-1"), IDEM_ALREADY_EXISTS);
    cr_expect_eq(idem_consume(st, "rpc-consumer", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK,
                 "the same table as idem_consume");
    cr_expect_eq(atomic_load(&c.runs), 0);
}

static consumer shared_consumer = {.credit_key = "acct-1", .result = IDEM_OK};
static atomic_int acks;

static void *deliver(void *arg)
{
    (void)arg;
    if (idem_consume(st, "commission", "msg-1", credit_fn, &shared_consumer) == IDEM_CONSUME_ACK) {
        atomic_fetch_add(&acks, 1);
    }
    return NULL;
}

Test(consume, concurrent_deliveries_of_one_message_run_fn_once)
{
    pthread_t th[RACERS];
    atomic_store(&shared_consumer.runs, 0);
    atomic_store(&acks, 0);
    for (int i = 0; i < RACERS; i++) {
        cr_assert_eq(pthread_create(&th[i], NULL, deliver, NULL), 0);
    }
    for (int i = 0; i < RACERS; i++) {
        pthread_join(th[i], NULL);
    }
    cr_expect_eq(atomic_load(&acks), RACERS, "every delivery is acked");
    cr_expect_eq(atomic_load(&shared_consumer.runs), 1);
    cr_expect_eq(credits("acct-1"), 1);
}

static void consume_n(const char *prefix, int n)
{
    consumer c = {.credit_key = "acct-1", .result = IDEM_OK};
    char key[32];
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof(key), "%s-%d", prefix, i);
        cr_assert_eq(idem_consume(st, "commission", key, credit_fn, &c), IDEM_CONSUME_ACK);
    }
}

static bool consumed(const char *prefix, int i)
{
    char key[32];
    snprintf(key, sizeof(key), "%s-%d", prefix, i);
    return idem_consume_lookup(st, "commission", key, NULL) == IDEM_OK;
}

Test(consume, purge_removes_the_oldest_markers_in_bounded_batches)
{
    size_t purged;
    consume_n("msg", 25);
    uint64_t later = idem__now_ms() + 1;
    cr_assert_eq(idem_consume_purge(st, later, 10, &purged), IDEM_OK, "%s", idem_errmsg());
    cr_expect_eq(purged, 10);
    cr_expect_not(consumed("msg", 9));
    cr_expect(consumed("msg", 10), "oldest first: the 11th is kept");
    cr_assert_eq(idem_consume_purge(st, later, 10, &purged), IDEM_OK);
    cr_expect_eq(purged, 10);
    cr_assert_eq(idem_consume_purge(st, later, 10, &purged), IDEM_OK);
    cr_expect_eq(purged, 5);
    cr_assert_eq(idem_consume_purge(st, later, 10, &purged), IDEM_OK);
    cr_expect_eq(purged, 0);
    cr_expect_not(consumed("msg", 24));
}

Test(consume, purge_keeps_markers_consumed_at_or_after_the_cutoff)
{
    size_t purged;
    uint64_t last_old;
    consume_n("old", 3);
    cr_assert_eq(idem_consume_lookup(st, "commission", "old-2", &last_old), IDEM_OK);
    uint64_t cutoff;
    while ((cutoff = idem__now_ms()) <= last_old) {
        /* the clock has millisecond steps: wait for the next one */
    }
    consume_n("new", 3);
    cr_assert_eq(idem_consume_purge(st, cutoff, 100, &purged), IDEM_OK);
    cr_expect_eq(purged, 3);
    for (int i = 0; i < 3; i++) {
        cr_expect_not(consumed("old", i));
        cr_expect(consumed("new", i));
    }
}

Test(consume, a_message_redelivered_after_its_marker_was_purged_runs_again)
{
    consumer c = {.credit_key = "acct-1", .result = IDEM_OK};
    size_t purged;
    cr_assert_eq(idem_consume(st, "commission", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK);
    cr_assert_eq(idem_consume_purge(st, idem__now_ms() + 1, 100, &purged), IDEM_OK);
    cr_assert_eq(purged, 1);
    cr_expect_eq(idem_consume(st, "commission", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK);
    cr_expect_eq(credits("acct-1"), 2, "the documented price of purging too early");
    cr_expect_eq(idem_consume(st, "commission", "msg-1", credit_fn, &c), IDEM_CONSUME_ACK);
    cr_expect_eq(credits("acct-1"), 2, "and the new marker dedupes again");
}

Test(consume, purge_batches_are_bounded)
{
    size_t purged = 99;
    cr_expect_eq(idem_consume_purge(st, UINT64_MAX, IDEM_CONSUME_MAX_PURGE + 1, &purged),
                 IDEM_INVALID_ARGUMENT);
    cr_expect_eq(purged, 0);
    consume_n("msg", 2);
    cr_expect_eq(idem_consume_purge(st, UINT64_MAX, 0, &purged), IDEM_OK);
    cr_expect_eq(purged, 0, "a batch of 0 deletes nothing");
    cr_expect(consumed("msg", 0));
}

/* The three-service chain of examples/shop as real processes: order → inventory
 * (reserve) and order → payment (charge), each with its own LMDB store. One process
 * SIGKILLs itself at a chosen point of the first order; the test restarts it while the
 * client keeps retrying with attempts shorter than the call. Afterwards: stock
 * reserved once, money charged once, and every answer names the same order id. With
 * the order service's re-driver on, the client does not even retry. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

enum { INV, PAY, ORDER, N_ROLES };
static const char *const roles[N_ROLES] = {"inventory", "payment", "order"};
static char *dir;
static char url[N_ROLES][300], db[N_ROLES][300];
static tu_child proc[N_ROLES];

static void setup(void)
{
    dir = tu_tempdir("shop");
    for (int i = 0; i < N_ROLES; i++) {
        snprintf(url[i], sizeof(url[i]), "ipc://%s/%s.sock", dir, roles[i]);
        snprintf(db[i], sizeof(db[i]), "%s/%s", dir, roles[i]);
    }
}

static void stop_all(void)
{
    for (int i = 0; i < N_ROLES; i++) {
        if (proc[i].pid > 0) {
            kill(proc[i].pid, SIGTERM);
            cr_expect_eq(tu_reap(&proc[i]), 0, "%s stops cleanly on SIGTERM", roles[i]);
            proc[i].pid = 0;
        }
    }
}

static void teardown(void)
{
    stop_all();
    tu_rmtree(dir);
}

TestSuite(shop, .init = setup, .fini = teardown, .timeout = 90);

/* redrive_ms: order's re-driver interval (NULL: off); logs: its log lines on stdout. */
static void start_with(int role, const char *crash_at, const char *redrive_ms, bool logs)
{
    const char *argv[20] = {
        getenv("SHOP_SERVER"), "--role", roles[role], "--listen", url[role], "--db", db[role]};
    int n = 7;
    if (role == ORDER) {
        argv[n++] = "--inventory";
        argv[n++] = url[INV];
        argv[n++] = "--payment";
        argv[n++] = url[PAY];
        argv[n++] = "--lease-ms";
        argv[n++] = "300";
    }
    if (crash_at != NULL) {
        argv[n++] = "--crash-at";
        argv[n++] = crash_at;
    }
    if (redrive_ms != NULL) {
        argv[n++] = "--redrive-ms";
        argv[n++] = redrive_ms;
    }
    if (logs) {
        argv[n++] = "--log-stdout";
    }
    argv[n] = NULL;
    tu_spawn(&proc[role], argv);
}

static void start(int role, const char *crash_at)
{
    start_with(role, crash_at, NULL, false);
}

struct order_call {
    idem_code code;
    idem_result r;
};

static idem_code place_priced(idem_result *r, uint32_t attempts, const char *payload)
{
    idem_client_opts o;
    idem_client *c;
    idem_client_opts_init(&o);
    o.caller = "shop-web";
    o.attempt_timeout_ms = 300; /* shorter than a call whose process was killed */
    o.deadline_ms = 30000;
    o.retry.max_attempts = attempts;
    o.retry.period_ms = 50;
    o.retry.max_period_ms = 300;
    cr_assert_eq(idem_client_open(&c, (const char *[]){url[ORDER]}, 1, &o), IDEM_OK);
    idem_request q = {.method = "order.Shop/Place",
                      .idempotency_key = "cart-1",
                      .payload = payload,
                      .payload_len = strlen(payload)};
    idem_code code = idem_client_call(c, &q, r);
    idem_client_close(c);
    return code;
}

static idem_code place(idem_result *r, uint32_t attempts)
{
    return place_priced(r, attempts, "sku-1 250");
}

static void *place_thread(void *arg)
{
    struct order_call *oc = arg;
    oc->code = place(&oc->r, 100);
    return NULL;
}

static void read_state(int role, const char *method, const char *payload, char *out, size_t cap)
{
    idem_client *c = tu_client(url[role], 2000);
    idem_request q = {.method = method, .payload = payload, .payload_len = strlen(payload)};
    idem_result r;
    cr_assert_eq(idem_client_call(c, &q, &r), IDEM_OK, "%s: %s", method, r.message);
    snprintf(out, cap, "%s", (const char *)r.payload);
    idem_result_clear(&r);
    idem_client_close(c);
}

static void order_id(const char *payload, char *out, size_t cap)
{
    const char *p = strstr(payload, "order=");
    cr_assert_not_null(p, "no order id in '%s'", payload);
    snprintf(out, cap, "%.*s", (int)strcspn(p + 6, " "), p + 6);
}

/* Kills `role` (none when point is NULL) at `point` during the first order, restarts
 * it, and checks the effects. */
static void kill_and_recover(int role, const char *point)
{
    for (int i = 0; i < N_ROLES; i++) {
        start(i, point != NULL && i == role ? point : NULL);
    }
    struct order_call oc = {0};
    pthread_t t;
    pthread_create(&t, NULL, place_thread, &oc);
    if (point != NULL) {
        cr_assert_eq(tu_reap(&proc[role]), SIGKILL, "%s was killed at %s", roles[role], point);
        start(role, NULL); /* the client is still retrying */
    }
    pthread_join(t, NULL);
    cr_assert_eq(oc.code, IDEM_OK, "after a kill of %s at %s: %s", roles[role], point ? point : "-",
                 oc.r.message);

    char first[64], again_id[64], state[128];
    order_id(oc.r.payload, first, sizeof(first));
    idem_result again;
    cr_assert_eq(place(&again, 3), IDEM_OK, "%s", again.message);
    order_id(again.payload, again_id, sizeof(again_id));
    cr_expect_str_eq(again_id, first, "one order id");
    cr_expect(again.replayed);
    idem_result_clear(&again);
    idem_result_clear(&oc.r);

    read_state(INV, "inv.Stock/Level", "sku-1", state, sizeof(state));
    cr_expect_str_eq(state, "stock=99 reservations=1", "stock reserved once (%s at %s)",
                     roles[role], point ? point : "-");
    read_state(PAY, "pay.Pay/Total", "", state, sizeof(state));
    cr_expect_str_eq(state, "total=250 charges=1", "money charged once (%s at %s)", roles[role],
                     point ? point : "-");
}

Test(shop, no_fault_one_reservation_one_charge)
{
    kill_and_recover(ORDER, NULL);
}

Test(shop, order_killed_before_the_reservation)
{
    kill_and_recover(ORDER, "before_reserve");
}

Test(shop, order_killed_between_the_reservation_and_the_charge)
{
    kill_and_recover(ORDER, "between");
}

Test(shop, order_killed_after_the_charge_before_its_answer)
{
    kill_and_recover(ORDER, "after_charge");
}

Test(shop, inventory_killed_after_its_commit_before_its_answer)
{
    kill_and_recover(INV, "after_commit");
}

Test(shop, payment_killed_after_its_commit_before_its_answer)
{
    kill_and_recover(PAY, "after_commit");
}

/* Order (its re-driver on) is killed between its steps, its client gives up after one
 * attempt, and order restarts: the re-driver finishes the order (the charge runs,
 * once) without a retry, and the client's next call replays it with the same id. */
Test(shop, an_order_killed_between_its_steps_is_finished_by_the_redriver)
{
    start(INV, NULL);
    start(PAY, NULL);
    start_with(ORDER, "between", "50", false);
    idem_result r;
    cr_assert_neq(place(&r, 1), IDEM_OK, "the client gave up after one attempt");
    idem_result_clear(&r);
    cr_assert_eq(tu_reap(&proc[ORDER]), SIGKILL, "order was killed between its steps");
    start_with(ORDER, NULL, "50", false);

    char state[128];
    for (int i = 0; i < 200; i++) { /* the lease (300 ms) runs out, then a pass runs it */
        read_state(PAY, "pay.Pay/Total", "", state, sizeof(state));
        if (strcmp(state, "total=0 charges=0") != 0) {
            break;
        }
        nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL); /* another process: polled */
    }
    cr_expect_str_eq(state, "total=250 charges=1", "the re-driver charged once");
    read_state(INV, "inv.Stock/Level", "sku-1", state, sizeof(state));
    cr_expect_str_eq(state, "stock=99 reservations=1", "stock reserved once");
    char first[64], again[64];
    cr_assert_eq(place(&r, 3), IDEM_OK, "%s", r.message);
    cr_expect(r.replayed, "the client's next call replays the re-driven order");
    order_id(r.payload, first, sizeof(first));
    idem_result_clear(&r);
    cr_assert_eq(place(&r, 3), IDEM_OK, "%s", r.message);
    order_id(r.payload, again, sizeof(again));
    cr_expect_str_eq(again, first, "one order id");
    idem_result_clear(&r);
}

/* A request that kills its process between its steps, every time: the re-driver re-runs
 * it at most redrive_max_runs (3) times, then gives up (one error line), so the service
 * stops crash-looping, and compensates it: the reservation its first step recorded is
 * released, by a run that stops after replaying that step (the crash point is not
 * reached again). Stock is back where it started. */
Test(shop, a_call_that_kills_every_run_is_re_run_three_times_then_compensated)
{
    start(INV, NULL);
    start(PAY, NULL);
    start_with(ORDER, "between", "50", true);
    idem_result r;
    cr_assert_neq(place(&r, 1), IDEM_OK);
    idem_result_clear(&r);
    cr_assert_eq(tu_reap(&proc[ORDER]), SIGKILL, "the first run died between its steps");
    int reruns_died = 0;
    bool gave_up = false, compensated = false;
    char line[1024];
    while (!gave_up && reruns_died <= 4) {
        start_with(ORDER, "between", "50", true);
        while (!gave_up && fgets(line, sizeof(line), proc[ORDER].out) != NULL) {
            gave_up = strstr(line, "not re-run any more") != NULL;
        }
        if (!gave_up) { /* EOF: a re-run killed it */
            cr_assert_eq(tu_reap(&proc[ORDER]), SIGKILL);
            reruns_died++;
        }
    }
    cr_expect(gave_up, "the re-driver gave up");
    cr_expect_eq(reruns_died, 3, "three re-runs died, no more (%d)", reruns_died);
    char state[128] = "";
    for (int i = 0; i < 200 && gave_up; i++) { /* another process: polled */
        read_state(INV, "inv.Stock/Releases", "sku-1", state, sizeof(state));
        if (strncmp(state, "releases=0", 10) != 0) {
            break;
        }
        nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL);
    }
    cr_assert_str_eq(state, "releases=1 reserves=1", "the re-driver released the stock");
    while (!compensated && fgets(line, sizeof(line), proc[ORDER].out) != NULL) {
        compensated = strstr(line, "compensating run 1") != NULL;
    }
    cr_assert(compensated, "the re-driver ran the compensation");
    cr_expect(strstr(line, "INTERNAL") != NULL && strstr(line, "gave up") != NULL,
              "its outcome is the give-up: %s", line);
    read_state(INV, "inv.Stock/Level", "sku-1", state, sizeof(state));
    cr_expect_str_eq(state, "stock=100 reservations=0");
    read_state(PAY, "pay.Pay/Total", "", state, sizeof(state));
    cr_expect_str_eq(state, "total=0 charges=0", "nothing charged");
}

/* ---- compensation: a charge that fails finally gives the reservation back ---- */

static void *place_unaffordable(void *arg)
{
    struct order_call *oc = arg;
    oc->code = place_priced(&oc->r, 100, "sku-1 5000");
    return NULL;
}

/* "releases=N reserves=M": every reservation ever made was released exactly once. */
static int released_each_once(void)
{
    char state[128];
    int back = -1, made = -2;
    read_state(INV, "inv.Stock/Releases", "sku-1", state, sizeof(state));
    cr_assert_eq(sscanf(state, "releases=%d reserves=%d", &back, &made), 2, "%s", state);
    cr_expect_eq(back, made, "each reservation released once: %s", state);
    return back;
}

/* Kills `role` at `point` (none: NULL) during an order whose charge fails finally
 * (insufficient funds), restarts it while the client retries, and checks that the
 * stock and the money are back where they started, each reservation was released
 * once, and the key is free (the same order runs afresh and is compensated again).
 * A client attempt that timed out while the order compensated waits for it and, the
 * key being released, runs afresh too: so one or two reservations, each released. */
static void kill_and_compensate(int role, const char *point)
{
    for (int i = 0; i < N_ROLES; i++) {
        start(i, point != NULL && i == role ? point : NULL);
    }
    struct order_call oc = {0};
    pthread_t t;
    pthread_create(&t, NULL, place_unaffordable, &oc);
    if (point != NULL) {
        cr_assert_eq(tu_reap(&proc[role]), SIGKILL, "%s was killed at %s", roles[role], point);
        start(role, NULL); /* the client is still retrying */
    }
    pthread_join(t, NULL);
    cr_assert_eq(oc.code, IDEM_FAILED_PRECONDITION, "after a kill of %s at %s: %s", roles[role],
                 point ? point : "-", oc.r.message);
    cr_expect(strstr(oc.r.message, "insufficient funds") != NULL, "%s", oc.r.message);
    cr_expect_str_eq(idem_result_metadata(&oc.r, "idem-compensated"), "all");
    idem_result_clear(&oc.r);

    char state[128];
    read_state(INV, "inv.Stock/Level", "sku-1", state, sizeof(state));
    cr_expect_str_eq(state, "stock=100 reservations=0", "stock back (%s at %s)", roles[role],
                     point ? point : "-");
    int first = released_each_once();
    cr_expect(first >= 1, "the undo took effect (%s at %s)", roles[role], point ? point : "-");
    read_state(PAY, "pay.Pay/Total", "", state, sizeof(state));
    cr_expect_str_eq(state, "total=0 charges=0", "no money moved");

    idem_result again;
    cr_assert_eq(place_priced(&again, 3, "sku-1 5000"), IDEM_FAILED_PRECONDITION, "%s",
                 again.message);
    cr_expect(!again.replayed, "released: the retry ran afresh");
    idem_result_clear(&again);
    read_state(INV, "inv.Stock/Level", "sku-1", state, sizeof(state));
    cr_expect_str_eq(state, "stock=100 reservations=0", "and gave its new reservation back");
    cr_expect_gt(released_each_once(), first, "a new reservation, released");
}

Test(shop, a_charge_that_fails_finally_gives_the_reservation_back)
{
    kill_and_compensate(ORDER, NULL);
}

Test(shop, order_killed_before_its_undo)
{
    kill_and_compensate(ORDER, "before_undo");
}

Test(shop, order_killed_inside_its_undo_after_the_release)
{
    kill_and_compensate(ORDER, "in_undo");
}

Test(shop, order_killed_after_its_compensation_before_its_answer)
{
    kill_and_compensate(ORDER, "after_compensation");
}

Test(shop, inventory_killed_after_the_releases_commit_before_its_answer)
{
    kill_and_compensate(INV, "after_release_commit");
}

/* Order (its re-driver on) dies just before its undo, its client gives up after one
 * attempt: after the restart the re-driver finishes the compensation with no client
 * retry (the stock comes back), and the order's key is then free. */
Test(shop, the_redriver_finishes_a_compensation_whose_process_died)
{
    start(INV, NULL);
    start(PAY, NULL);
    start_with(ORDER, "before_undo", "50", false);
    idem_result r;
    cr_assert_neq(place_priced(&r, 1, "sku-1 5000"), IDEM_OK);
    idem_result_clear(&r);
    cr_assert_eq(tu_reap(&proc[ORDER]), SIGKILL, "order was killed before its undo");
    start_with(ORDER, NULL, "50", false);
    char state[128] = "";
    for (int i = 0; i < 200; i++) { /* another process: polled */
        read_state(INV, "inv.Stock/Releases", "sku-1", state, sizeof(state));
        if (strncmp(state, "releases=0", 10) != 0) {
            break;
        }
        nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL);
    }
    cr_expect_str_eq(state, "releases=1 reserves=1", "the re-driver released the stock");
    read_state(INV, "inv.Stock/Level", "sku-1", state, sizeof(state));
    cr_expect_str_eq(state, "stock=100 reservations=0");
    cr_assert_eq(place_priced(&r, 3, "sku-1 5000"), IDEM_FAILED_PRECONDITION, "%s", r.message);
    cr_expect(!r.replayed, "the compensated key was released: a fresh run");
    idem_result_clear(&r);
}

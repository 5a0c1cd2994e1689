/* Unit tests of idem_backoff_ms: the Feign-style retryer schedule (period x multiplier^n,
 * capped) and its jitter. */
#include <criterion/criterion.h>
#include <math.h>

#include "internal.h"

/* The default policy (all zero) without jitter. */
static const idem_retry_policy no_jitter = {.jitter = -1};

/* Checks retry 1..n of policy against expected[]. */
static void expect_schedule(const idem_retry_policy *p, const uint32_t *expected, size_t n)
{
    for (uint32_t retry = 1; retry <= n; retry++) {
        cr_expect_eq(idem_backoff_ms(p, retry, 0.5), expected[retry - 1], "retry %u", retry);
    }
}

Test(backoff, default_schedule_grows_by_half_up_to_one_second)
{
    /* 100 x 1.5^n truncated to whole ms: 337.5 -> 337, 506.25 -> 506, 759.375 -> 759,
     * then 1139.06 capped at 1000. */
    static const uint32_t expected[] = {100, 150, 225, 337, 506, 759, 1000, 1000, 1000};
    expect_schedule(&no_jitter, expected, IDEM_ARRAY_LEN(expected));
}

Test(backoff, retry_zero_is_the_first_period)
{
    cr_expect_eq(idem_backoff_ms(&no_jitter, 0, 0.5), 100);
}

Test(backoff, without_jitter_rnd_is_ignored)
{
    for (uint32_t retry = 1; retry <= 8; retry++) {
        uint32_t mid = idem_backoff_ms(&no_jitter, retry, 0.5);
        cr_expect_eq(idem_backoff_ms(&no_jitter, retry, 0.0), mid, "retry %u", retry);
        cr_expect_eq(idem_backoff_ms(&no_jitter, retry, 0.999), mid, "retry %u", retry);
    }
}

Test(backoff, custom_policy_sets_period_multiplier_and_cap)
{
    static const idem_retry_policy p = {
        .period_ms = 50, .max_period_ms = 400, .multiplier = 2.0, .jitter = -1};
    static const uint32_t expected[] = {50, 100, 200, 400, 400, 400};
    expect_schedule(&p, expected, IDEM_ARRAY_LEN(expected));
}

Test(backoff, cap_below_period_caps_the_first_backoff)
{
    static const idem_retry_policy p = {.period_ms = 500, .max_period_ms = 200, .jitter = -1};
    cr_expect_eq(idem_backoff_ms(&p, 1, 0.5), 200);
    cr_expect_eq(idem_backoff_ms(&p, 5, 0.5), 200);
}

Test(backoff, large_retry_numbers_stay_at_the_cap)
{
    cr_expect_eq(idem_backoff_ms(&no_jitter, 1000, 0.5), 1000);
    cr_expect_eq(idem_backoff_ms(&no_jitter, UINT32_MAX, 0.5), 1000);
}

/* Default jitter (0.2): rnd 0 is the low end, 0.5 the middle, ->1 the high end. The
 * bound allows the 1 ms lost to truncation. */
Test(backoff, default_jitter_stays_within_twenty_percent)
{
    static const idem_retry_policy jittered = {0};
    static const double rnds[] = {0.0, 0.5, 0.999};
    for (uint32_t retry = 1; retry <= 9; retry++) {
        double base = idem_backoff_ms(&no_jitter, retry, 0.5);
        for (size_t i = 0; i < IDEM_ARRAY_LEN(rnds); i++) {
            double v = idem_backoff_ms(&jittered, retry, rnds[i]);
            cr_expect_geq(v, base * 0.8 - 1, "retry %u rnd %g: %g vs %g", retry, rnds[i], v, base);
            cr_expect_leq(v, base * 1.2, "retry %u rnd %g: %g vs %g", retry, rnds[i], v, base);
        }
    }
}

/* The jitter is full-scale: rnd 0 gives -20 %, rnd 0.999 gives +19.96 % (within the 1 ms
 * of truncation), so a retryer that ignored rnd would fail here. */
Test(backoff, jitter_spans_the_whole_range)
{
    static const idem_retry_policy jittered = {0};
    for (uint32_t retry = 1; retry <= 9; retry++) {
        double base = idem_backoff_ms(&no_jitter, retry, 0.5);
        double low = idem_backoff_ms(&jittered, retry, 0.0);
        double high = idem_backoff_ms(&jittered, retry, 0.999);
        cr_expect_leq(fabs(low - base * 0.8), 1.0, "retry %u: %g vs %g", retry, low, base);
        cr_expect_leq(fabs(high - base * 1.1996), 1.0, "retry %u: %g vs %g", retry, high, base);
        cr_expect_eq(idem_backoff_ms(&jittered, retry, 0.5), base, "retry %u", retry);
    }
}

Test(backoff, custom_jitter_fraction_is_applied)
{
    static const idem_retry_policy p = {.period_ms = 1000, .max_period_ms = 1000, .jitter = 0.5};
    cr_expect_eq(idem_backoff_ms(&p, 1, 0.0), 500);
    cr_expect_eq(idem_backoff_ms(&p, 1, 0.5), 1000);
    cr_expect_eq(idem_backoff_ms(&p, 1, 0.75), 1250);
}

/* The broker topology checker's faults in time order (chaos_nats.h), to attribute each
 * of the consumers' duplicates to the fault before it. Faults are logged in history
 * order, which is time order: a binary search finds the last one before a moment. */
#include <stdlib.h>

#include "chaos_nats.h"

typedef struct fault_at {
    uint64_t t;
    int kind;
} fault_at;
static fault_at *fault_log;
static size_t n_fault_log, cap_fault_log;

void chaos_nats_log_fault(uint64_t t, int kind)
{
    if (n_fault_log == cap_fault_log) {
        size_t cap = cap_fault_log == 0 ? 256 : cap_fault_log * 2;
        fault_at *p = realloc(fault_log, cap * sizeof(*p));
        if (p == NULL) {
            return;
        }
        fault_log = p, cap_fault_log = cap;
    }
    fault_log[n_fault_log++] = (fault_at){t, kind};
}

int chaos_nats_fault_before(uint64_t t, uint64_t within_ms)
{
    size_t lo = 0, hi = n_fault_log; /* the first fault after t */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (fault_log[mid].t <= t) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo > 0 && t - fault_log[lo - 1].t <= within_ms ? fault_log[lo - 1].kind : -1;
}

void chaos_nats_forget_faults(void)
{
    free(fault_log);
    fault_log = NULL;
    n_fault_log = cap_fault_log = 0;
}

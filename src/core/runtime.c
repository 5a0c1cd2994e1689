/* The runtime's clock (runtime.h). */
#include "runtime.h"

#include "internal.h"

uint64_t idem__system_clock(void *arg)
{
    (void)arg;
    return idem__now_ms();
}

uint64_t idem__rt_now_ms(const idem_runtime *rt)
{
    return rt->clock.now_ms(rt->clock.arg);
}

/* The Redis debounce window in a build without hiredis (-Dredis=disabled, or auto
 * without hiredis installed). meson compiles this file instead of debounce.c: no window
 * can be created, so the interceptor is never installed with one, and a program that
 * offers debounce as an option still links and learns at run time that it is missing. */
#include "builtins.h"

idem_code idem_debounce_create(idem_debounce **out, const char *url, uint32_t window_ms)
{
    (void)url;
    (void)window_ms;
    *out = NULL;
    return idem__err(IDEM_UNIMPLEMENTED, "built without Redis support (-Dredis=disabled)");
}

void idem_debounce_destroy(idem_debounce *d)
{
    (void)d; /* only NULL can exist here */
}

/* Reached only through idem_server_use(srv, "debounce", …) with a window, which cannot
 * exist in this build: pass the call on, as debounce.c does when Redis is down. */
idem_code idem__debounce_interceptor(idem_call *call, idem_next next, void *arg)
{
    (void)arg;
    return idem_call_next(call, next);
}

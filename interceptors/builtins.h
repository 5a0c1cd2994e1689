/* The built-in interceptors and method (interceptors/): the server puts them in its
 * chain (server.c). */
#ifndef IDEMRPC_BUILTINS_H
#define IDEMRPC_BUILTINS_H

#include "call.h"

idem_code idem__request_id_interceptor(idem_call *call, idem_next next, void *arg);
idem_code idem__token_interceptor(idem_call *call, idem_next next, void *arg);
idem_code idem__result_cache_interceptor(idem_call *call, idem_next next, void *arg);
idem_code idem__debounce_interceptor(idem_call *call, idem_next next, void *arg);
idem_code idem__token_issue_handler(idem_call *call, void *arg);

#endif

/* More metrics on GET /metrics (server.h, idem_server_add_metrics): the sources are the
 * observer's (src/core/metric_sources.c), which renders them after its own. */
#include "server_setup.h"

idem_code idem_server_add_metrics(idem_server *srv, idem_metrics_fn fn, void *arg,
                                  void (*drop)(void *arg), unsigned *id)
{
    if (srv == NULL || fn == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT, "idem_server_add_metrics needs a server and a "
                                                "function");
    }
    return idem__metric_sources_add(idem__observer_sources(idem__server_observer(srv)), fn, arg,
                                    drop, id);
}

void idem_server_remove_metrics(idem_server *srv, unsigned id)
{
    if (srv != NULL) {
        idem__metric_sources_remove(idem__observer_sources(idem__server_observer(srv)), id);
    }
}

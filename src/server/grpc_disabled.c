/* The gRPC front in a build without libnghttp2 (-Dgrpc=disabled, or not installed):
 * listening answers UNIMPLEMENTED; the request frame builder (grpc_frame.c) stays. */
#include "grpc_front.h"

idem_code idem__grpc_start(const char *url, const idem_grpc_cfg *cfg, idem_grpc **out)
{
    (void)url;
    (void)cfg;
    *out = NULL;
    return idem__err(IDEM_UNIMPLEMENTED,
                     "this idemrpc was built without the gRPC front (libnghttp2): "
                     "install libnghttp2-dev and build with -Dgrpc=enabled");
}

int idem__grpc_port(const idem_grpc *g)
{
    (void)g;
    return 0;
}

void idem__grpc_stop(idem_grpc *g)
{
    (void)g;
}

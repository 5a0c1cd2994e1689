/* TLS for the fronts: nng's mbedtls-backed configuration, server side, with required
 * client certificates, so that a connection exists only for a client the CA signed. */

#include "tls.h"

idem_code idem__tls_server_config(nng_tls_config **out, const idem_tls_listener *tls)
{
    nng_tls_config *cfg;
    int rv;
    *out = NULL;
    if (tls == NULL || tls->cert_key_file == NULL || tls->client_ca_file == NULL ||
        !idem__caller_name_ok(tls->caller)) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "a TLS listener needs cert_key_file, client_ca_file and a caller of "
                         "1..%d printable bytes",
                         IDEM_MAX_CALLER);
    }
    if ((rv = nng_tls_config_alloc(&cfg, NNG_TLS_MODE_SERVER)) != 0) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "TLS config: %s", nng_strerror(rv));
    }
    const char *what = "cert_key_file";
    if ((rv = nng_tls_config_cert_key_file(cfg, tls->cert_key_file, NULL)) == 0) {
        what = "client_ca_file";
        rv = nng_tls_config_ca_file(cfg, tls->client_ca_file);
    }
    if (rv == 0) {
        what = "auth mode";
        rv = nng_tls_config_auth_mode(cfg, NNG_TLS_AUTH_MODE_REQUIRED);
    }
    if (rv != 0) {
        nng_tls_config_free(cfg);
        return idem__err(IDEM_INVALID_ARGUMENT, "TLS %s: %s", what, nng_strerror(rv));
    }
    *out = cfg;
    return IDEM_OK;
}

/* The client's dialers (client_internal.h): plain URLs, and tls+ URLs whose server is
 * always verified. */
#include <nng/nng.h>
#include <nng/supplemental/tls/tls.h>
#include <string.h>

#include "client_internal.h"

/* The host of a tls+tcp://HOST:PORT URL (brackets of an IPv6 literal removed) into
 * out: the name the server's certificate must carry unless tls_server_name says. */
static bool url_host(const char *url, char *out, size_t cap)
{
    const char *h = strstr(url, "://");
    h = h != NULL ? h + 3 : url;
    size_t n = *h == '[' ? strcspn(h + 1, "]") : strcspn(h, ":/");
    h += *h == '[';
    if (n == 0 || n >= cap) {
        return false;
    }
    memcpy(out, h, n);
    out[n] = '\0';
    return true;
}

/* The client side of tls+tcp:// for url: the server verified against tls_ca_file and
 * checked for server_name, this client's certificate when it has one. */
static idem_code client_tls(const idem_client_opts *o, const char *url, nng_tls_config **out)
{
    nng_tls_config *cfg;
    char host[256];
    int rv;
    *out = NULL;
    if (o->tls_ca_file == NULL) {
        return idem__err(IDEM_INVALID_ARGUMENT,
                         "%s needs tls_ca_file: the server's certificate is always verified", url);
    }
    const char *name = o->tls_server_name;
    if (name == NULL && !url_host(url, host, sizeof(host))) {
        return idem__err(IDEM_INVALID_ARGUMENT, "%s: no host to check the certificate for", url);
    }
    name = name != NULL ? name : host;
    if ((rv = nng_tls_config_alloc(&cfg, NNG_TLS_MODE_CLIENT)) != 0) {
        return idem__err(IDEM_RESOURCE_EXHAUSTED, "TLS config: %s", nng_strerror(rv));
    }
    const char *what = "tls_ca_file";
    if ((rv = nng_tls_config_ca_file(cfg, o->tls_ca_file)) == 0 &&
        (rv = nng_tls_config_auth_mode(cfg, NNG_TLS_AUTH_MODE_REQUIRED)) == 0 &&
        o->tls_cert_key_file != NULL) {
        what = "tls_cert_key_file";
        rv = nng_tls_config_cert_key_file(cfg, o->tls_cert_key_file, NULL);
    }
    if (rv == 0) {
        what = "tls_server_name";
        rv = nng_tls_config_server_name(cfg, name);
    }
    if (rv != 0) {
        nng_tls_config_free(cfg);
        return idem__err(IDEM_INVALID_ARGUMENT, "TLS %s: %s", what, nng_strerror(rv));
    }
    *out = cfg;
    return IDEM_OK;
}

idem_code idem__client_dial(nng_socket sock, const char *url, const idem_client_opts *o)
{
    nng_dialer d;
    nng_tls_config *cfg = NULL;
    idem_code code;
    int rv;
    if (strncmp(url, "tls+", 4) != 0) {
        rv = nng_dial(sock, url, NULL, NNG_FLAG_NONBLOCK);
    } else if ((code = client_tls(o, url, &cfg)) != IDEM_OK) {
        return code;
    } else if ((rv = nng_dialer_create(&d, sock, url)) == 0 &&
               ((rv = nng_dialer_set_ptr(d, NNG_OPT_TLS_CONFIG, cfg)) != 0 ||
                (rv = nng_dialer_start(d, NNG_FLAG_NONBLOCK)) != 0)) {
        nng_dialer_close(d);
    }
    if (cfg != NULL) {
        nng_tls_config_free(cfg); /* the dialer holds its own reference */
    }
    return rv == 0 ? IDEM_OK
                   : idem__err(IDEM_INVALID_ARGUMENT, "dial %s: %s", url, nng_strerror(rv));
}

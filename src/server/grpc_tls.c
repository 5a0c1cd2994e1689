/* TLS for the gRPC front: OpenSSL over the accepted TCP stream through memory BIOs.
 *
 * nng 1.5.2's TLS (mbedtls) cannot negotiate ALPN, and gRPC clients require "h2" by
 * ALPN, so the front speaks TLS itself: ciphertext read from the nng stream is written
 * into the connection's read BIO, SSL_read gives the plaintext to nghttp2, nghttp2's
 * output goes through SSL_write and the write BIO's bytes to the stream. The context
 * requires a client certificate signed by the listener's CA (every such client is the
 * listener's caller, as on the other fronts), TLS 1.2 or later, and ALPN "h2" (a client
 * that offers ALPN without h2 fails the handshake; one that offers no ALPN at all is
 * closed as soon as its handshake is done, before any HTTP/2 byte). */
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdio.h>

#include "grpc_conn.h"

static int alpn_select(SSL *ssl, const unsigned char **out, unsigned char *outlen,
                       const unsigned char *in, unsigned int inlen, void *arg)
{
    static const unsigned char h2[] = {2, 'h', '2'};
    unsigned char *chosen;
    (void)ssl;
    (void)arg;
    if (SSL_select_next_proto(&chosen, outlen, h2, sizeof(h2), in, inlen) !=
            OPENSSL_NPN_NEGOTIATED ||
        *outlen != 2) {
        return SSL_TLSEXT_ERR_ALERT_FATAL;
    }
    *out = chosen;
    return SSL_TLSEXT_ERR_OK;
}

/* OpenSSL's first queued error, for a message; the queue is emptied. */
static const char *ssl_error(char *buf, size_t cap)
{
    unsigned long e = ERR_get_error();
    ERR_clear_error();
    if (e == 0) {
        snprintf(buf, cap, "unknown error");
    } else {
        ERR_error_string_n(e, buf, cap);
    }
    return buf;
}

static bool ctx_load(SSL_CTX *ctx, const idem_tls_listener *tls, const char **what)
{
    STACK_OF(X509_NAME) * cas;
    *what = "cert_key_file";
    if (SSL_CTX_use_certificate_chain_file(ctx, tls->cert_key_file) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, tls->cert_key_file, SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ctx) != 1) {
        return false;
    }
    *what = "client_ca_file";
    if (SSL_CTX_load_verify_locations(ctx, tls->client_ca_file, NULL) != 1 ||
        (cas = SSL_load_client_CA_file(tls->client_ca_file)) == NULL) {
        return false;
    }
    SSL_CTX_set_client_CA_list(ctx, cas); /* the context owns it */
    return true;
}

idem_code idem__gtls_ctx_new(const idem_tls_listener *tls, SSL_CTX **out)
{
    char err[256];
    const char *what = "context";
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    *out = NULL;
    if (ctx == NULL || SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) != 1 ||
        !ctx_load(ctx, tls, &what)) {
        SSL_CTX_free(ctx);
        return idem__err(IDEM_INVALID_ARGUMENT, "gRPC TLS %s: %s", what,
                         ssl_error(err, sizeof(err)));
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    SSL_CTX_set_alpn_select_cb(ctx, alpn_select, NULL);
    *out = ctx;
    return IDEM_OK;
}

SSL *idem__gtls_new(SSL_CTX *ctx)
{
    SSL *ssl = SSL_new(ctx);
    BIO *rbio = BIO_new(BIO_s_mem()), *wbio = BIO_new(BIO_s_mem());
    if (ssl == NULL || rbio == NULL || wbio == NULL) {
        SSL_free(ssl);
        BIO_free(rbio);
        BIO_free(wbio);
        ERR_clear_error();
        return NULL;
    }
    SSL_set_bio(ssl, rbio, wbio); /* ssl owns both */
    SSL_set_accept_state(ssl);
    return ssl;
}

bool idem__gtls_ready(SSL *ssl)
{
    return SSL_is_init_finished(ssl) == 1;
}

bool idem__gtls_feed(SSL *ssl, const void *p, size_t n)
{
    return n <= INT32_MAX && BIO_write(SSL_get_rbio(ssl), p, (int)n) == (int)n;
}

/* alpn_select runs only for a client that offers ALPN: one that offers none completes
 * the handshake without it, and is refused here. */
static bool alpn_h2(const SSL *ssl)
{
    const unsigned char *p;
    unsigned int n;
    SSL_get0_alpn_selected(ssl, &p, &n);
    return n == 2 && p[0] == 'h' && p[1] == '2';
}

int idem__gtls_read(SSL *ssl, uint8_t *buf, size_t cap)
{
    int r = SSL_read(ssl, buf, (int)cap);
    if (SSL_is_init_finished(ssl) && !alpn_h2(ssl)) {
        ERR_clear_error();
        return -1; /* no ALPN h2: the connection ends */
    }
    if (r > 0) {
        return r;
    }
    int e = SSL_get_error(ssl, r);
    ERR_clear_error();
    return e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE ? 0 : -1;
}

bool idem__gtls_write(SSL *ssl, const void *p, size_t n)
{
    bool ok = n <= INT32_MAX && SSL_write(ssl, p, (int)n) == (int)n; /* a memory BIO takes all */
    ERR_clear_error();
    return ok;
}

size_t idem__gtls_take(SSL *ssl, uint8_t *buf, size_t cap)
{
    int n = BIO_read(SSL_get_wbio(ssl), buf, (int)cap);
    return n > 0 ? (size_t)n : 0;
}

/* Unit tests of the codec layer: request decoding and validation, stored-response round
 * trips, SHA-256 and fingerprints, UTF-8, base64url and the code names. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "testutil.h"

/* ---- helpers ---- */

/* Packs r with protobuf-c and decodes it; frees the decoded request unless out is given. */
static idem_code decode_packed(const Idem__V1__Request *r, Idem__V1__Request **out)
{
    size_t len = idem__v1__request__get_packed_size(r);
    uint8_t *buf = malloc(len ? len : 1);
    cr_assert_not_null(buf);
    idem__v1__request__pack(r, buf);
    Idem__V1__Request *decoded = NULL;
    idem_code code = idem__decode_request(buf, len, &decoded);
    free(buf);
    if (code != IDEM_OK) {
        cr_assert_null(decoded, "a rejected frame must not yield a request");
    }
    if (out != NULL) {
        *out = decoded;
    } else {
        idem__free_request(decoded);
    }
    return code;
}

/* A minimal valid request: only the method. */
static Idem__V1__Request valid_request(void)
{
    Idem__V1__Request r = IDEM__V1__REQUEST__INIT;
    r.method = "shop.Orders/Create";
    return r;
}

/* A string of n copies of c (malloc'd). */
static char *repeat(char c, size_t n)
{
    char *s = malloc(n + 1);
    cr_assert_not_null(s);
    memset(s, c, n);
    s[n] = '\0';
    return s;
}

/* Hand-built protobuf frames, for byte sequences protobuf-c cannot pack from C strings
 * (embedded NULs). */
typedef struct frame {
    uint8_t b[2048];
    size_t n;
} frame;

static void frame_varint(frame *f, uint64_t v)
{
    do {
        cr_assert_lt(f->n, sizeof(f->b));
        f->b[f->n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v != 0);
}

/* Appends a length-delimited field (string, bytes or submessage). */
static void frame_bytes(frame *f, unsigned field, const void *data, size_t len)
{
    frame_varint(f, (uint64_t)field << 3 | 2);
    frame_varint(f, len);
    cr_assert_leq(f->n + len, sizeof(f->b));
    memcpy(f->b + f->n, data, len);
    f->n += len;
}

static idem_code decode_frame(const frame *f)
{
    Idem__V1__Request *r = NULL;
    idem_code code = idem__decode_request(f->b, f->n, &r);
    if (code != IDEM_OK) {
        cr_assert_null(r);
    }
    idem__free_request(r);
    return code;
}

static void hex32(char out[65], const uint8_t digest[32])
{
    idem__hex(out, digest, 32);
}

static void sha256_of(const void *data, size_t len, char out[65])
{
    uint8_t digest[32];
    idem__sha256((const void *const[]){data}, (const size_t[]){len}, 1, digest);
    hex32(out, digest);
}

/* ---- idem__decode_request ---- */

Test(decode_request, round_trips_every_field)
{
    Idem__V1__Request r = valid_request();
    Idem__V1__Request__MetadataEntry e0 = IDEM__V1__REQUEST__METADATA_ENTRY__INIT;
    Idem__V1__Request__MetadataEntry e1 = IDEM__V1__REQUEST__METADATA_ENTRY__INIT;
    Idem__V1__Request__MetadataEntry *entries[] = {&e0, &e1};
    static const uint8_t payload[] = {0x00, 0x01, 0xfe, 0xff};
    e0.key = "x-request-id", e0.value = "trace-1";
    e1.key = "lang", e1.value = "zh-CN 中文";
    r.idempotency_key = "order-42";
    r.request_id = "rid-7";
    r.token = "tok_abc";
    r.caller = "checkout-svc";
    r.n_metadata = 2;
    r.metadata = entries;
    r.payload = (ProtobufCBinaryData){sizeof(payload), (uint8_t *)payload};
    r.attempt = 3;
    r.deadline_unix_ms = 1700000000123u;

    Idem__V1__Request *d;
    cr_assert_eq(decode_packed(&r, &d), IDEM_OK, "%s", idem_errmsg());
    cr_assert_str_eq(d->method, "shop.Orders/Create");
    cr_assert_str_eq(d->idempotency_key, "order-42");
    cr_assert_str_eq(d->request_id, "rid-7");
    cr_assert_str_eq(d->token, "tok_abc");
    cr_assert_str_eq(d->caller, "checkout-svc");
    cr_assert_eq(d->attempt, 3);
    cr_assert_eq(d->deadline_unix_ms, 1700000000123u);
    cr_assert_eq(d->payload.len, sizeof(payload));
    cr_assert_arr_eq(d->payload.data, payload, sizeof(payload));
    cr_assert_eq(d->n_metadata, 2);
    cr_assert_str_eq(d->metadata[0]->key, "x-request-id");
    cr_assert_str_eq(d->metadata[0]->value, "trace-1");
    cr_assert_str_eq(d->metadata[1]->key, "lang");
    cr_assert_str_eq(d->metadata[1]->value, "zh-CN 中文");
    idem__free_request(d);
}

Test(decode_request, rejects_empty_frame)
{
    Idem__V1__Request *r = (Idem__V1__Request *)1; /* must be reset to NULL */
    cr_assert_eq(idem__decode_request("", 0, &r), IDEM_INVALID_ARGUMENT);
    cr_assert_null(r);
    cr_assert_neq(idem_errmsg()[0], '\0', "the reason is in idem_errmsg()");
}

Test(decode_request, rejects_truncated_protobuf)
{
    Idem__V1__Request r = valid_request();
    r.payload = (ProtobufCBinaryData){5, (uint8_t *)"hello"};
    size_t len = idem__v1__request__get_packed_size(&r);
    uint8_t buf[128];
    cr_assert_leq(len, sizeof(buf));
    idem__v1__request__pack(&r, buf);

    Idem__V1__Request *d = NULL;
    cr_assert_eq(idem__decode_request(buf, len, &d), IDEM_OK, "the full frame is valid");
    idem__free_request(d);
    for (size_t cut = 1; cut <= 3; cut++) {
        cr_expect_eq(idem__decode_request(buf, len - cut, &d), IDEM_INVALID_ARGUMENT,
                     "frame cut by %zu bytes", cut);
        cr_expect_null(d);
    }
}

Test(decode_request, rejects_garbage_bytes)
{
    static const uint8_t unterminated_varint[] = {0xff, 0xff, 0xff, 0xff, 0xff};
    static const uint8_t bad_wire_type[] = {0x0f, 0x01, 0x02}; /* field 1, wire type 7 */
    static const uint8_t overlong_length[] = {0x0a, 0x7f, 'a', 'b'};
    Idem__V1__Request *d = NULL;
    cr_expect_eq(idem__decode_request(unterminated_varint, sizeof(unterminated_varint), &d),
                 IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem__decode_request(bad_wire_type, sizeof(bad_wire_type), &d),
                 IDEM_INVALID_ARGUMENT);
    cr_expect_eq(idem__decode_request(overlong_length, sizeof(overlong_length), &d),
                 IDEM_INVALID_ARGUMENT);
    cr_expect_null(d);
}

Test(decode_request, requires_a_method)
{
    Idem__V1__Request r = IDEM__V1__REQUEST__INIT;
    r.idempotency_key = "k";
    cr_assert_eq(decode_packed(&r, NULL), IDEM_INVALID_ARGUMENT);
}

Test(decode_request, requires_method_of_form_service_slash_method)
{
    static const char *const bad[] = {
        "shop.Orders.Create", /* no '/' */
        "/Create",            /* empty service */
        "shop.Orders/",       /* empty method */
        "shop/Orders/Create", /* two '/' */
        "shop.Orders/Do It",  /* space */
        " shop.Orders/Create",
        "shop.Orders/Create\t",
    };
    Idem__V1__Request r = valid_request();
    cr_assert_eq(decode_packed(&r, NULL), IDEM_OK, "%s", idem_errmsg());
    for (size_t i = 0; i < IDEM_ARRAY_LEN(bad); i++) {
        r.method = (char *)bad[i];
        cr_expect_eq(decode_packed(&r, NULL), IDEM_INVALID_ARGUMENT, "method \"%s\"", bad[i]);
    }
}

Test(decode_request, accepts_key_of_255_bytes_and_rejects_256)
{
    Idem__V1__Request r = valid_request();
    char *key255 = repeat('k', IDEM_MAX_KEY), *key256 = repeat('k', IDEM_MAX_KEY + 1);
    r.idempotency_key = key255;
    cr_expect_eq(decode_packed(&r, NULL), IDEM_OK, "%s", idem_errmsg());
    r.idempotency_key = key256;
    cr_expect_eq(decode_packed(&r, NULL), IDEM_INVALID_ARGUMENT);
    free(key255);
    free(key256);
}

Test(decode_request, accepts_64_metadata_entries_and_rejects_65)
{
    Idem__V1__Request__MetadataEntry entries[IDEM_MAX_METADATA + 1];
    Idem__V1__Request__MetadataEntry *ptrs[IDEM_MAX_METADATA + 1];
    char names[IDEM_MAX_METADATA + 1][16];
    for (size_t i = 0; i < IDEM_ARRAY_LEN(entries); i++) {
        idem__v1__request__metadata_entry__init(&entries[i]);
        snprintf(names[i], sizeof(names[i]), "m-%zu", i);
        entries[i].key = names[i];
        entries[i].value = "v";
        ptrs[i] = &entries[i];
    }
    Idem__V1__Request r = valid_request();
    r.metadata = ptrs;
    r.n_metadata = IDEM_MAX_METADATA;
    cr_expect_eq(decode_packed(&r, NULL), IDEM_OK, "%s", idem_errmsg());
    r.n_metadata = IDEM_MAX_METADATA + 1;
    cr_expect_eq(decode_packed(&r, NULL), IDEM_INVALID_ARGUMENT);
}

Test(decode_request, rejects_invalid_utf8_in_key_caller_and_method)
{
    static char bad_utf8[] = "ab\xc3(cd"; /* 2-byte lead followed by ASCII */
    Idem__V1__Request r = valid_request();

    r.idempotency_key = bad_utf8;
    cr_expect_eq(decode_packed(&r, NULL), IDEM_INVALID_ARGUMENT, "key");
    r = valid_request();
    r.caller = bad_utf8;
    cr_expect_eq(decode_packed(&r, NULL), IDEM_INVALID_ARGUMENT, "caller");
    r = valid_request();
    r.method = "shop.Orders/Cr\xc3(ate";
    cr_expect_eq(decode_packed(&r, NULL), IDEM_INVALID_ARGUMENT, "method");
    r = valid_request();
    r.caller = "caf\xc3\xa9"; /* "café": valid UTF-8 is fine */
    cr_expect_eq(decode_packed(&r, NULL), IDEM_OK, "%s", idem_errmsg());
}

/* A C string ends at the first NUL: "ab\0cd" would silently become key "ab" and collide
 * with every other key starting "ab\0". */
Test(decode_request, rejects_embedded_nul_in_strings)
{
    static const char method[] = "shop.Orders/Create";
    static const char nul_key[] = {'a', 'b', 0, 'c', 'd'};
    frame ok = {0}, key = {0}, caller = {0}, meth = {0}, meta = {0};

    frame_bytes(&ok, 1, method, strlen(method));
    frame_bytes(&ok, 2, "abcd", 4);
    cr_assert_eq(decode_frame(&ok), IDEM_OK, "hand-built frame is valid: %s", idem_errmsg());

    frame_bytes(&key, 1, method, strlen(method));
    frame_bytes(&key, 2, nul_key, sizeof(nul_key));
    cr_expect_eq(decode_frame(&key), IDEM_INVALID_ARGUMENT, "NUL in idempotency_key");

    frame_bytes(&caller, 1, method, strlen(method));
    frame_bytes(&caller, 9, nul_key, sizeof(nul_key));
    cr_expect_eq(decode_frame(&caller), IDEM_INVALID_ARGUMENT, "NUL in caller");

    frame_bytes(&meth, 1, "shop.Orders/Create\0x", 20);
    cr_expect_eq(decode_frame(&meth), IDEM_INVALID_ARGUMENT, "NUL in method");

    frame entry = {0};
    frame_bytes(&entry, 1, "idempotency-key", 15);
    frame_bytes(&entry, 2, nul_key, sizeof(nul_key));
    frame_bytes(&meta, 1, method, strlen(method));
    frame_bytes(&meta, 5, entry.b, entry.n);
    cr_expect_eq(decode_frame(&meta), IDEM_INVALID_ARGUMENT, "NUL in a metadata value");
}

/* ---- stored responses ---- */

typedef struct response_fixture {
    Idem__V1__Request req;
    idem_call call;
} response_fixture;

static void response_fixture_init(response_fixture *f)
{
    f->req = valid_request();
    idem__call_init(&f->call, &f->req, NULL, NULL);
}

Test(call_response, encode_then_load_round_trips_code_message_payload_metadata)
{
    static const uint8_t payload[] = {'o', 'k', 0x00, 0xff, 0x10};
    response_fixture src, dst;
    response_fixture_init(&src);
    response_fixture_init(&dst);
    idem_call_reply(&src.call, IDEM_NOT_FOUND, payload, sizeof(payload));
    cr_assert_eq(idem__call_set_message(&src.call, "no such order"), IDEM_OK);
    cr_assert_eq(idem_call_set_response_metadata(&src.call, "request-id", "rid-1"), IDEM_OK);
    cr_assert_eq(idem_call_set_response_metadata(&src.call, "x-shard", "7"), IDEM_OK);

    uint8_t *buf;
    size_t len;
    cr_assert_eq(idem__encode_call_response(&src.call, false, &buf, &len), IDEM_OK);
    cr_assert_eq(idem__load_call_response(&dst.call, buf, len), IDEM_OK, "%s", idem_errmsg());
    free(buf);

    size_t plen;
    const uint8_t *p = idem_call_response_payload(&dst.call, &plen);
    cr_expect_eq(idem_call_code(&dst.call), IDEM_NOT_FOUND);
    cr_expect_str_eq(idem_call_message(&dst.call), "no such order");
    cr_assert_eq(plen, sizeof(payload));
    cr_expect_arr_eq(p, payload, sizeof(payload));
    cr_expect_str_eq(idem_call_response_metadata(&dst.call, "request-id"), "rid-1");
    cr_expect_str_eq(idem_call_response_metadata(&dst.call, "x-shard"), "7");
    cr_expect_null(idem_call_response_metadata(&dst.call, "absent"));
    idem__call_fini(&src.call);
    idem__call_fini(&dst.call);
}

Test(call_response, load_replaces_the_previous_response)
{
    response_fixture src, dst;
    response_fixture_init(&src);
    response_fixture_init(&dst);
    idem_call_reply(&src.call, IDEM_OK, "first", 5);
    idem_call_fail(&dst.call, IDEM_INTERNAL, "stale");
    idem_call_set_response_metadata(&dst.call, "stale", "1");

    uint8_t *buf;
    size_t len;
    cr_assert_eq(idem__encode_call_response(&src.call, false, &buf, &len), IDEM_OK);
    cr_assert_eq(idem__load_call_response(&dst.call, buf, len), IDEM_OK);
    free(buf);
    cr_expect_eq(idem_call_code(&dst.call), IDEM_OK);
    cr_expect_str_eq(idem_call_message(&dst.call), "");
    cr_expect_null(idem_call_response_metadata(&dst.call, "stale"));
    idem__call_fini(&src.call);
    idem__call_fini(&dst.call);
}

Test(call_response, wire_encoding_carries_replayed_and_request_id_storage_does_not)
{
    response_fixture f;
    response_fixture_init(&f);
    strcpy(f.call.request_id, "rid-9");
    f.call.replayed = true;
    idem_call_reply(&f.call, IDEM_OK, "x", 1);

    for (int for_wire = 0; for_wire <= 1; for_wire++) {
        uint8_t *buf;
        size_t len;
        cr_assert_eq(idem__encode_call_response(&f.call, for_wire, &buf, &len), IDEM_OK);
        Idem__V1__Response *r = idem__v1__response__unpack(NULL, len, buf);
        free(buf);
        cr_assert_not_null(r);
        cr_expect_eq(r->replayed, (bool)for_wire);
        cr_expect_str_eq(r->request_id, for_wire ? "rid-9" : "");
        idem__v1__response__free_unpacked(r, NULL);
    }
    idem__call_fini(&f.call);
}

Test(call_response, load_of_garbage_is_data_loss)
{
    static const uint8_t garbage[] = {0xff, 0xff, 0xff};
    response_fixture f;
    response_fixture_init(&f);
    cr_expect_eq(idem__load_call_response(&f.call, garbage, sizeof(garbage)), IDEM_DATA_LOSS);
    idem__call_fini(&f.call);
}

/* ---- SHA-256 (FIPS 180-4 / NIST CAVS examples) ---- */

Test(sha256, empty_message)
{
    char hex[65];
    sha256_of("", 0, hex);
    cr_expect_str_eq(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

Test(sha256, abc)
{
    char hex[65];
    sha256_of("abc", 3, hex);
    cr_expect_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

Test(sha256, two_block_448_bit_message)
{
    static const char msg[] = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    char hex[65];
    cr_assert_eq(strlen(msg), 56);
    sha256_of(msg, strlen(msg), hex);
    cr_expect_str_eq(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

/* Lengths around the padding boundary (55/56 bytes fit one/need two blocks); reference
 * digests from coreutils sha256sum. */
Test(sha256, padding_boundaries)
{
    static const struct {
        size_t n;
        const char *hex;
    } cases[] = {
        {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
        {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
        {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
    };
    for (size_t i = 0; i < IDEM_ARRAY_LEN(cases); i++) {
        char *msg = repeat('a', cases[i].n), hex[65];
        sha256_of(msg, cases[i].n, hex);
        cr_expect_str_eq(hex, cases[i].hex, "%zu x 'a'", cases[i].n);
        free(msg);
    }
}

Test(sha256, million_a_streamed_in_uneven_parts)
{
    /* 1,000,000 = 7 + 57 + 64 + 999,872; parts that straddle block boundaries. */
    static const size_t sizes[] = {7, 57, 64, 999872};
    char *a = repeat('a', 1000000), hex[65];
    const void *parts[IDEM_ARRAY_LEN(sizes)];
    size_t off = 0;
    for (size_t i = 0; i < IDEM_ARRAY_LEN(sizes); i++) {
        parts[i] = a + off;
        off += sizes[i];
    }
    cr_assert_eq(off, 1000000);
    uint8_t digest[32];
    idem__sha256(parts, sizes, IDEM_ARRAY_LEN(sizes), digest);
    hex32(hex, digest);
    cr_expect_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    sha256_of(a, 1000000, hex);
    cr_expect_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    free(a);
}

/* ---- fingerprints ---- */

Test(fingerprint, equal_for_equal_method_and_payload)
{
    uint8_t a[32], b[32];
    idem__fingerprint("shop.Orders/Create", "{\"sku\":1}", 9, a);
    idem__fingerprint("shop.Orders/Create", "{\"sku\":1}", 9, b);
    cr_expect_arr_eq(a, b, 32);
}

Test(fingerprint, differs_when_method_or_payload_differs)
{
    uint8_t base[32], other_method[32], other_payload[32], empty_payload[32];
    idem__fingerprint("shop.Orders/Create", "{\"sku\":1}", 9, base);
    idem__fingerprint("shop.Orders/Cancel", "{\"sku\":1}", 9, other_method);
    idem__fingerprint("shop.Orders/Create", "{\"sku\":2}", 9, other_payload);
    idem__fingerprint("shop.Orders/Create", NULL, 0, empty_payload);
    cr_expect_arr_neq(base, other_method, 32);
    cr_expect_arr_neq(base, other_payload, 32);
    cr_expect_arr_neq(base, empty_payload, 32);
}

Test(fingerprint, separates_method_from_payload)
{
    /* Without the separator "a/bc"+"" and "a/b"+"c" would hash the same bytes. */
    uint8_t x[32], y[32];
    idem__fingerprint("a/bc", "", 0, x);
    idem__fingerprint("a/b", "c", 1, y);
    cr_expect_arr_neq(x, y, 32);
}

/* ---- UTF-8 ---- */

static bool utf8(const char *s)
{
    return idem__utf8_valid(s, strlen(s));
}

Test(utf8, accepts_ascii_and_valid_multibyte_sequences)
{
    cr_expect(idem__utf8_valid("", 0));
    cr_expect(utf8("plain ascii ~"));
    cr_expect(utf8("\xc2\x80"));         /* U+0080, smallest 2-byte */
    cr_expect(utf8("\xc3\xa9"));         /* é */
    cr_expect(utf8("\xe2\x82\xac"));     /* € */
    cr_expect(utf8("\xe0\xa0\x80"));     /* U+0800, smallest 3-byte */
    cr_expect(utf8("\xef\xbf\xbf"));     /* U+FFFF */
    cr_expect(utf8("\xf0\x9f\x98\x80")); /* 😀 */
    cr_expect(utf8("\xf4\x8f\xbf\xbf")); /* U+10FFFF, the largest code point */
    cr_expect(utf8("\xe4\xb8\xad\xe6\x96\x87 mixed"));
}

Test(utf8, rejects_overlong_encodings)
{
    cr_expect_not(utf8("\xc0\x80"));         /* NUL as 2 bytes */
    cr_expect_not(utf8("\xc1\xbf"));         /* U+007F as 2 bytes */
    cr_expect_not(utf8("\xe0\x80\x80"));     /* 3-byte overlong */
    cr_expect_not(utf8("\xe0\x9f\xbf"));     /* U+07FF as 3 bytes */
    cr_expect_not(utf8("\xf0\x80\x80\x80")); /* 4-byte overlong */
    cr_expect_not(utf8("\xf0\x8f\xbf\xbf")); /* U+FFFF as 4 bytes */
}

Test(utf8, rejects_surrogates)
{
    cr_expect_not(utf8("\xed\xa0\x80")); /* U+D800 */
    cr_expect_not(utf8("\xed\xbf\xbf")); /* U+DFFF */
    cr_expect(utf8("\xed\x9f\xbf"));     /* U+D7FF, just below */
}

Test(utf8, rejects_code_points_above_10ffff)
{
    cr_expect_not(utf8("\xf4\x90\x80\x80")); /* U+110000 */
    cr_expect_not(utf8("\xf7\xbf\xbf\xbf"));
    cr_expect_not(utf8("\xf8\x88\x80\x80\x80")); /* 5-byte form */
    cr_expect_not(utf8("\xff"));
}

Test(utf8, rejects_truncated_sequences)
{
    cr_expect_not(utf8("\xc3"));
    cr_expect_not(utf8("\xe2\x82"));
    cr_expect_not(utf8("\xf0\x9f\x98"));
    cr_expect_not(utf8("ab\xe2\x82"));
    cr_expect_not(utf8("\xe2\x82x")); /* continuation replaced by ASCII */
    cr_expect_not(idem__utf8_valid("\xc3\xa9", 1), "length cuts the sequence");
}

Test(utf8, rejects_lone_continuation_bytes_and_nul)
{
    cr_expect_not(utf8("\x80"));
    cr_expect_not(utf8("a\xbf"));
    cr_expect_not(idem__utf8_valid("a\0b", 3));
}

/* ---- base64url ---- */

static void b64(const char *in, char *out)
{
    idem__base64url(out, in, strlen(in));
}

Test(base64url, rfc4648_vectors_without_padding)
{
    static const char *const vectors[][2] = {
        {"", ""},           {"f", "Zg"},          {"fo", "Zm8"},          {"foo", "Zm9v"},
        {"foob", "Zm9vYg"}, {"fooba", "Zm9vYmE"}, {"foobar", "Zm9vYmFy"},
    };
    char out[16];
    for (size_t i = 0; i < IDEM_ARRAY_LEN(vectors); i++) {
        b64(vectors[i][0], out);
        cr_expect_str_eq(out, vectors[i][1], "base64url(\"%s\")", vectors[i][0]);
    }
}

Test(base64url, uses_the_url_safe_alphabet)
{
    static const uint8_t plus_slash[] = {0xfb, 0xff};     /* standard: "+/8=" */
    static const uint8_t all_ones[] = {0xff, 0xff, 0xff}; /* standard: "////" */
    char out[16];
    idem__base64url(out, plus_slash, sizeof(plus_slash));
    cr_expect_str_eq(out, "-_8");
    idem__base64url(out, all_ones, sizeof(all_ones));
    cr_expect_str_eq(out, "____");
}

Test(base64url, token_of_16_bytes_is_22_chars)
{
    uint8_t rnd[16];
    char out[23];
    memset(rnd, 0xa5, sizeof(rnd));
    memset(out, 'X', sizeof(out));
    idem__base64url(out, rnd, sizeof(rnd));
    cr_expect_eq(strlen(out), 22);
}

/* ---- code names ---- */

Test(code_name, names_every_code_and_parses_it_back)
{
    static const char *const names[IDEM_CODE_COUNT] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    for (int c = 0; c < IDEM_CODE_COUNT; c++) {
        idem_code parsed = (idem_code)-1;
        cr_expect_str_eq(idem_code_name(c), names[c], "code %d", c);
        cr_expect(idem_code_from_name(names[c], &parsed), "%s", names[c]);
        cr_expect_eq(parsed, (idem_code)c, "%s", names[c]);
    }
    cr_expect_eq(IDEM_UNAUTHENTICATED, 16, "numbers are the gRPC codes");
}

Test(code_name, out_of_range_codes_are_unknown_code)
{
    cr_expect_str_eq(idem_code_name(-1), "UNKNOWN_CODE");
    cr_expect_str_eq(idem_code_name(IDEM_CODE_COUNT), "UNKNOWN_CODE");
    cr_expect_str_eq(idem_code_name(1000), "UNKNOWN_CODE");
}

Test(code_name, from_name_rejects_non_names)
{
    idem_code out = IDEM_ABORTED;
    cr_expect_not(idem_code_from_name("UNKNOWN_CODE", &out));
    cr_expect_not(idem_code_from_name("ok", &out), "case-sensitive");
    cr_expect_not(idem_code_from_name("", &out));
    cr_expect_not(idem_code_from_name("NOT_FOUND ", &out));
    cr_expect_eq(out, IDEM_ABORTED, "out is untouched on failure");
}

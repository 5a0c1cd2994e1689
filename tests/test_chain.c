/* Unit tests of the interceptor chain, of the request_id interceptor (request ids and
 * idempotency key resolution) and of the thread's error detail (idem__err), run in
 * memory: no network, no store. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "call.h"
#include "builtins.h"
#include "testutil.h"

#define METHOD "shop.Orders/Create"
#define MAX_ITEMS 8

/* One call under test: the decoded request, its method, the chain and what ran. */
static struct world {
    Idem__V1__Request req;
    Idem__V1__Request__MetadataEntry entries[MAX_ITEMS];
    Idem__V1__Request__MetadataEntry *entry_ptrs[MAX_ITEMS];
    idem_method method;
    idem_runtime rt;
    idem_interceptor items[MAX_ITEMS];
    idem_chain chain;
    idem_call call;
    char trace[256];
    int handler_runs;
    char key_seen[IDEM_MAX_KEY + 1]; /* idem_call_key() as the handler saw it */
} w;

static void trace(const char *step)
{
    strncat(w.trace, step, sizeof(w.trace) - strlen(w.trace) - 1);
}

/* Replies OK "done" and records that it ran and which key it saw. */
static idem_code recording_handler(idem_call *call, void *arg)
{
    (void)arg;
    const char *key = idem_call_key(call);
    w.handler_runs++;
    trace("handler ");
    snprintf(w.key_seen, sizeof(w.key_seen), "%s", key != NULL ? key : "(none)");
    return idem_call_reply(call, IDEM_OK, "done", 4);
}

static void world_setup(void)
{
    memset(&w, 0, sizeof(w));
    w.req = (Idem__V1__Request)IDEM__V1__REQUEST__INIT;
    w.req.method = METHOD;
    w.req.metadata = w.entry_ptrs;
    w.method = (idem_method){.name = METHOD, .fn = recording_handler};
    w.chain.items = w.items;
}

static void world_teardown(void)
{
    idem__call_fini(&w.call);
}

TestSuite(chain, .init = world_setup, .fini = world_teardown);
TestSuite(request_id, .init = world_setup, .fini = world_teardown);
TestSuite(key, .init = world_setup, .fini = world_teardown);

static void add_metadata(const char *name, const char *value)
{
    size_t i = w.req.n_metadata++;
    cr_assert_lt(i, MAX_ITEMS);
    idem__v1__request__metadata_entry__init(&w.entries[i]);
    w.entries[i].key = (char *)name;
    w.entries[i].value = (char *)value;
    w.entry_ptrs[i] = &w.entries[i];
}

static void use(const char *name, idem_interceptor_fn fn, void *arg)
{
    cr_assert_lt(w.chain.n, MAX_ITEMS);
    w.items[w.chain.n++] = (idem_interceptor){.name = (char *)name, .fn = fn, .arg = arg};
}

/* Runs the whole chain for w.req; method is &w.method or NULL (unknown method). */
static idem_code run_with(const idem_method *method)
{
    idem__call_init(&w.call, &w.req, method, &w.rt);
    idem_code code = idem_call_next(&w.call, (idem_next){&w.chain, 0});
    cr_expect_eq(code, idem_call_code(&w.call), "the returned code is the call's code");
    return code;
}

static idem_code run(void)
{
    return run_with(&w.method);
}

/* ---- test interceptors ---- */

/* Traces "<name>> " before and "<<name> " after the rest of the chain. */
static idem_code tracing(idem_call *call, idem_next next, void *arg)
{
    char step[32];
    snprintf(step, sizeof(step), "%s> ", (const char *)arg);
    trace(step);
    idem_code code = idem_call_next(call, next);
    snprintf(step, sizeof(step), "<%s ", (const char *)arg);
    trace(step);
    return code;
}

/* Answers PERMISSION_DENIED itself. */
static idem_code rejecting(idem_call *call, idem_next next, void *arg)
{
    (void)next, (void)arg;
    trace("reject ");
    return idem_call_fail(call, IDEM_PERMISSION_DENIED, "not for you");
}

/* After next: records the handler's code and payload in *arg and tags the response. */
typedef struct observation {
    idem_code code;
    char payload[16];
} observation;

static idem_code observing(idem_call *call, idem_next next, void *arg)
{
    observation *seen = arg;
    idem_code code = idem_call_next(call, next);
    size_t len;
    const char *p = idem_call_response_payload(call, &len);
    seen->code = idem_call_code(call);
    snprintf(seen->payload, sizeof(seen->payload), "%.*s", (int)len, p != NULL ? p : "");
    idem_call_set_response_metadata(call, "x-observed", "yes");
    return code;
}

/* ---- the chain ---- */

Test(chain, runs_interceptors_in_registration_order_around_the_handler)
{
    use("a", tracing, "a");
    use("b", tracing, "b");
    use("c", tracing, "c");
    cr_assert_eq(run(), IDEM_OK);
    cr_expect_str_eq(w.trace, "a> b> c> handler <c <b <a ");
}

Test(chain, without_interceptors_runs_the_handler)
{
    size_t len;
    cr_assert_eq(run(), IDEM_OK);
    cr_expect_eq(w.handler_runs, 1);
    const char *p = idem_call_response_payload(&w.call, &len);
    cr_assert_eq(len, 4);
    cr_expect_arr_eq(p, "done", 4);
}

Test(chain, interceptor_that_answers_short_circuits_the_rest)
{
    use("a", tracing, "a");
    use("reject", rejecting, NULL);
    use("b", tracing, "b");
    cr_expect_eq(run(), IDEM_PERMISSION_DENIED);
    cr_expect_eq(w.handler_runs, 0, "the handler must not run");
    cr_expect_str_eq(w.trace, "a> reject <a ");
    cr_expect_str_eq(idem_call_message(&w.call), "not for you");
}

Test(chain, interceptor_after_next_sees_the_handler_response)
{
    observation seen = {IDEM_UNKNOWN, ""};
    use("observe", observing, &seen);
    cr_assert_eq(run(), IDEM_OK);
    cr_expect_eq(seen.code, IDEM_OK);
    cr_expect_str_eq(seen.payload, "done");
    cr_expect_str_eq(idem_call_response_metadata(&w.call, "x-observed"), "yes",
                     "and may add to the response");
}

Test(chain, unknown_method_is_unimplemented)
{
    use("a", tracing, "a");
    cr_expect_eq(run_with(NULL), IDEM_UNIMPLEMENTED);
    cr_expect_eq(w.handler_runs, 0);
    cr_expect_str_eq(w.trace, "a> <a ", "interceptors still run");
    cr_expect_not_null(strstr(idem_call_message(&w.call), METHOD), "message names the method");
}

static idem_code replies_ok_returns_internal(idem_call *call, void *arg)
{
    (void)arg;
    idem_call_reply(call, IDEM_OK, "x", 1);
    return IDEM_INTERNAL;
}

Test(chain, handler_return_code_wins_over_its_reply)
{
    w.method.fn = replies_ok_returns_internal;
    cr_expect_eq(run(), IDEM_INTERNAL);
}

/* ---- request ids ---- */

static bool is_lower_hex(const char *s, size_t n)
{
    if (strlen(s) != n) {
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) {
            return false;
        }
    }
    return true;
}

Test(request_id, keeps_the_request_field)
{
    w.req.request_id = "rid-from-field";
    add_metadata("x-request-id", "rid-from-metadata");
    use("request_id", idem__request_id_interceptor, NULL);
    cr_assert_eq(run(), IDEM_OK);
    cr_expect_str_eq(idem_call_request_id(&w.call), "rid-from-field");
}

Test(request_id, falls_back_to_metadata_x_request_id)
{
    add_metadata("x-request-id", "rid-from-metadata");
    use("request_id", idem__request_id_interceptor, NULL);
    cr_assert_eq(run(), IDEM_OK);
    cr_expect_str_eq(idem_call_request_id(&w.call), "rid-from-metadata");
}

Test(request_id, generates_32_hex_chars_when_none_given)
{
    char first[IDEM_MAX_REQUEST_ID + 1];
    use("request_id", idem__request_id_interceptor, NULL);
    cr_assert_eq(run(), IDEM_OK);
    snprintf(first, sizeof(first), "%s", idem_call_request_id(&w.call));
    cr_expect(is_lower_hex(first, 32), "\"%s\"", first);

    idem__call_fini(&w.call);
    cr_assert_eq(run(), IDEM_OK);
    cr_expect_str_neq(idem_call_request_id(&w.call), first, "every call gets its own id");
}

Test(request_id, replaces_an_oversized_metadata_id)
{
    char big[IDEM_MAX_REQUEST_ID + 2];
    memset(big, 'r', sizeof(big) - 1), big[sizeof(big) - 1] = '\0';
    add_metadata("x-request-id", big);
    use("request_id", idem__request_id_interceptor, NULL);
    cr_assert_eq(run(), IDEM_OK);
    cr_expect(is_lower_hex(idem_call_request_id(&w.call), 32));
}

/* ---- idempotency key resolution ---- */

/* Derives "<payload>@<arg>", like out_trade_no + channel of a payment callback. */
static bool payload_extractor(const idem_call *call, char *buf, size_t cap, void *arg)
{
    size_t len;
    const char *p = idem_call_payload(call, &len);
    if (len == 0) {
        return false;
    }
    snprintf(buf, cap, "%.*s@%s", (int)len, p, (const char *)arg);
    return true;
}

/* Writes a key one byte over the bound. */
static bool oversized_extractor(const idem_call *call, char *buf, size_t cap, void *arg)
{
    (void)call, (void)arg;
    cr_assert_gt(cap, IDEM_MAX_KEY + 1);
    memset(buf, 'x', IDEM_MAX_KEY + 1);
    buf[IDEM_MAX_KEY + 1] = '\0';
    return true;
}

/* A request that offers a key from every source; tests remove them one by one. */
static void offer_every_key_source(void)
{
    w.req.idempotency_key = "field-key";
    add_metadata("idempotency-key", "metadata-key");
    w.req.payload = (ProtobufCBinaryData){6, (uint8_t *)"T-1001"};
    w.method.opts.extractor = payload_extractor;
    w.method.opts.extractor_arg = "alipay";
    w.req.token = "token-key";
    use("request_id", idem__request_id_interceptor, NULL);
}

static void expect_key(idem_key_source source, const char *key)
{
    cr_assert_eq(run(), IDEM_OK, "%s", idem_call_message(&w.call));
    cr_expect_eq(idem_call_key_source(&w.call), source);
    cr_expect_str_eq(idem_call_key(&w.call), key);
    cr_expect_str_eq(w.key_seen, key, "the handler sees the resolved key");
}

Test(key, business_key_is_the_key_and_a_differing_explicit_key_is_refused)
{
    offer_every_key_source();
    w.req.n_metadata = 0;
    cr_expect_eq(run(), IDEM_INVALID_ARGUMENT, "field-key differs from T-1001@alipay");
    cr_expect_eq(w.handler_runs, 0);
    cr_expect(strstr(idem_call_message(&w.call), "business key") != NULL);
}

Test(key, an_explicit_key_equal_to_the_business_key_is_accepted)
{
    offer_every_key_source();
    w.req.idempotency_key = "T-1001@alipay";
    w.req.n_metadata = 0;
    expect_key(IDEM_KEY_EXTRACTED, "T-1001@alipay");
}

Test(key, field_wins_over_the_token_without_a_business_key)
{
    offer_every_key_source();
    w.req.n_metadata = 0;
    w.req.payload.len = 0; /* the extractor finds nothing */
    expect_key(IDEM_KEY_FIELD, "field-key");
}

Test(key, a_field_and_metadata_that_name_two_keys_are_refused)
{
    offer_every_key_source();
    w.req.payload.len = 0;
    cr_expect_eq(run(), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(w.handler_runs, 0);
    cr_expect(strstr(idem_call_message(&w.call), "two different keys") != NULL);
}

Test(key, metadata_comes_second)
{
    offer_every_key_source();
    w.req.idempotency_key = "";
    w.req.payload.len = 0;
    expect_key(IDEM_KEY_METADATA, "metadata-key");
}

Test(key, extractor_without_an_explicit_key)
{
    offer_every_key_source();
    w.req.idempotency_key = "";
    w.req.n_metadata = 0;
    expect_key(IDEM_KEY_EXTRACTED, "T-1001@alipay");
}

Test(key, token_comes_last)
{
    offer_every_key_source();
    w.req.idempotency_key = "";
    w.req.n_metadata = 0;
    w.req.payload.len = 0; /* the extractor finds nothing */
    expect_key(IDEM_KEY_TOKEN, "token-key");
}

Test(key, business_key_wins_over_a_key_the_client_generated)
{
    offer_every_key_source();
    w.req.n_metadata = 0;
    add_metadata("idem-key-generated", "1"); /* idem_client made "field-key" up */
    expect_key(IDEM_KEY_EXTRACTED, "T-1001@alipay");
}

Test(key, generated_key_stands_when_there_is_no_business_key)
{
    offer_every_key_source();
    w.req.n_metadata = 0;
    add_metadata("idem-key-generated", "1");
    w.req.payload.len = 0;
    expect_key(IDEM_KEY_GENERATED, "field-key");
}

Test(key, generated_key_does_not_satisfy_key_required)
{
    w.method.opts.flags = IDEM_METHOD_KEY_REQUIRED;
    w.req.idempotency_key = "made-up-by-the-client";
    add_metadata("idem-key-generated", "1");
    use("request_id", idem__request_id_interceptor, NULL);
    cr_expect_eq(run(), IDEM_INVALID_ARGUMENT);
    cr_expect(strstr(idem_call_message(&w.call), "chosen by the caller") != NULL);
    cr_expect_eq(w.handler_runs, 0);
}

Test(key, none_when_no_source_offers_one)
{
    use("request_id", idem__request_id_interceptor, NULL);
    cr_assert_eq(run(), IDEM_OK);
    cr_expect_eq(idem_call_key_source(&w.call), IDEM_KEY_NONE);
    cr_expect_null(idem_call_key(&w.call));
    cr_expect_eq(w.handler_runs, 1, "a method that does not require a key still runs");
}

Test(key, required_key_missing_is_invalid_argument_and_handler_not_run)
{
    w.method.opts.flags = IDEM_METHOD_KEY_REQUIRED;
    use("request_id", idem__request_id_interceptor, NULL);
    cr_expect_eq(run(), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(w.handler_runs, 0);
}

Test(key, required_key_is_satisfied_by_any_source)
{
    w.method.opts.flags = IDEM_METHOD_KEY_REQUIRED;
    w.req.token = "token-key";
    use("request_id", idem__request_id_interceptor, NULL);
    expect_key(IDEM_KEY_TOKEN, "token-key");
    cr_expect_eq(w.handler_runs, 1);
}

Test(key, metadata_key_of_256_bytes_is_invalid_argument)
{
    char key256[IDEM_MAX_KEY + 2];
    memset(key256, 'k', IDEM_MAX_KEY + 1), key256[IDEM_MAX_KEY + 1] = '\0';
    add_metadata("idempotency-key", key256);
    w.req.token = "token-key"; /* an unusable key is an error, not a reason to fall back */
    use("request_id", idem__request_id_interceptor, NULL);
    cr_expect_eq(run(), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(w.handler_runs, 0);
}

Test(key, metadata_key_of_255_bytes_is_accepted)
{
    char key255[IDEM_MAX_KEY + 1];
    memset(key255, 'k', IDEM_MAX_KEY), key255[IDEM_MAX_KEY] = '\0';
    add_metadata("idempotency-key", key255);
    use("request_id", idem__request_id_interceptor, NULL);
    expect_key(IDEM_KEY_METADATA, key255);
}

Test(key, oversized_extracted_key_is_invalid_argument)
{
    w.method.opts.extractor = oversized_extractor;
    use("request_id", idem__request_id_interceptor, NULL);
    cr_expect_eq(run(), IDEM_INVALID_ARGUMENT);
    cr_expect_eq(w.handler_runs, 0);
}

/* The stores add their context to a cause with idem__err(code, "... (%s)", idem_errmsg()):
 * the thread's message formatted into itself. */
Test(errmsg, a_message_that_wraps_the_current_one_keeps_the_cause_intact)
{
    idem__err(IDEM_UNAVAILABLE, "server closed the connection unexpectedly");
    idem__err(IDEM_UNAVAILABLE, "the commit failed or its outcome is unknown (%s)", idem_errmsg());
    cr_expect_str_eq(idem_errmsg(), "the commit failed or its outcome is unknown (server closed "
                                    "the connection unexpectedly)");
    idem__err(IDEM_UNAVAILABLE, "%s; retry", idem_errmsg());
    cr_expect_str_eq(idem_errmsg(), "the commit failed or its outcome is unknown (server closed "
                                    "the connection unexpectedly); retry");
}

Test(errmsg, a_wrapped_message_longer_than_the_buffer_is_cut_at_its_end)
{
    char cause[600], want[600];
    memset(cause, 'c', sizeof(cause) - 1), cause[sizeof(cause) - 1] = '\0';
    idem__err(IDEM_UNAVAILABLE, "%s", cause);
    size_t kept = strlen(idem_errmsg());
    cr_assert_gt(kept, 400, "the detail holds a long cause");
    idem__err(IDEM_UNAVAILABLE, "fence refused: %s", idem_errmsg());
    snprintf(want, kept + 1, "fence refused: %s", cause);
    cr_expect_str_eq(idem_errmsg(), want, "the context first, then the cause cut at the end");
}

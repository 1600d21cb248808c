/* google.protobuf.Struct <-> cJSON and Timestamp helpers (libcommon/pbjson.c): round trips in
 * memory and through the protobuf wire encoding, key order, unicode, the 2^53 precision
 * boundary, refusals (depth, non-finite numbers, duplicate keys, invalid UTF-8) with their
 * JSON pointers, and RFC 3339 formatting and parsing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include <cmocka.h>

#include <cjson/cJSON.h>
#include <protobuf-c/protobuf-c.h>

#include "pbjson.h"

static const char doc[] =
    "{\"zeta\":1,\"alpha\":{\"nested\":{\"deeper\":[1,2,{\"x\":null}],\"empty_obj\":{},"
    "\"empty_list\":[]}},\"flags\":[true,false,null],\"num\":-1.5,\"big\":1e300,"
    "\"tiny\":5e-324,\"zero\":0,\"int53\":9007199254740992,"
    "\"text\":\"quote \\\" backslash \\\\ newline \\n tab \\t\","
    "\"utf8\":\"caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80\","
    "\"escaped\":\"\\u00e9\\u65e5\\ud83d\\ude00\\u0001\","
    "\"\xf0\x9f\x94\x91 key\":\"unicode key\",\"\":\"empty key\",\"empty\":\"\"}";

/* Converts JSON -> Struct -> JSON and returns the result; asserts success. */
static cJSON *roundtrip_mem(const cJSON *in) {
    Google__Protobuf__Struct *s = NULL;
    char err[256];
    assert_int_equal(pbjson_struct_from_json(in, &s, err, sizeof err), 0);
    cJSON *out = pbjson_struct_to_json(s);
    assert_non_null(out);
    pbjson_struct_free(s);
    return out;
}

/* JSON -> Struct -> wire bytes -> unpacked Struct -> JSON. */
static cJSON *roundtrip_wire(const cJSON *in) {
    Google__Protobuf__Struct *s = NULL;
    char err[256];
    assert_int_equal(pbjson_struct_from_json(in, &s, err, sizeof err), 0);
    size_t n = protobuf_c_message_get_packed_size(&s->base);
    uint8_t *buf = malloc(n ? n : 1);
    assert_int_equal(protobuf_c_message_pack(&s->base, buf), n);
    pbjson_struct_free(s);
    Google__Protobuf__Struct *u = google__protobuf__struct__unpack(NULL, n, buf);
    assert_non_null(u);
    free(buf);
    cJSON *out = pbjson_struct_to_json(u);
    assert_non_null(out);
    protobuf_c_message_free_unpacked(&u->base, NULL);
    return out;
}

static void assert_same_text(const cJSON *a, const cJSON *b) {
    char *x = cJSON_PrintUnformatted(a), *y = cJSON_PrintUnformatted(b);
    if (strcmp(x, y) != 0) print_error("%s\n!=\n%s\n", x, y);
    assert_string_equal(x, y);
    free(x);
    free(y);
}

static void test_roundtrip(void **state) {
    (void)state;
    cJSON *in = cJSON_Parse(doc);
    assert_non_null(in);
    cJSON *mem = roundtrip_mem(in), *wire = roundtrip_wire(in);
    assert_true(cJSON_Compare(in, mem, 1));
    assert_true(cJSON_Compare(in, wire, 1));
    /* Member order is preserved exactly (cJSON_Compare ignores it; the text does not). */
    assert_same_text(in, mem);
    assert_same_text(in, wire);
    /* Escaped \u sequences arrive as the same UTF-8 bytes, 4-byte ones included. */
    assert_string_equal(cJSON_GetObjectItem(wire, "escaped")->valuestring,
                        "\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80\x01");
    assert_string_equal(cJSON_GetObjectItem(wire, "\xf0\x9f\x94\x91 key")->valuestring,
                        "unicode key");
    assert_true(cJSON_GetObjectItem(wire, "tiny")->valuedouble == 5e-324);
    cJSON_Delete(in);
    cJSON_Delete(mem);
    cJSON_Delete(wire);
}

static void test_empty_and_scalars(void **state) {
    (void)state;
    cJSON *empty = cJSON_CreateObject();
    cJSON *w = roundtrip_wire(empty);
    assert_true(cJSON_IsObject(w) && w->child == NULL);
    cJSON_Delete(w);
    cJSON_Delete(empty);

    const char *values[] = {
        "null", "true", "false", "0", "-2.25", "\"s\"", "[]", "{}", "[null,[[]],{\"a\":[{}]}]"};
    for (size_t i = 0; i < sizeof values / sizeof values[0]; i++) {
        cJSON *j = cJSON_Parse(values[i]);
        Google__Protobuf__Value *v = NULL;
        char err[128];
        assert_int_equal(pbjson_value_from_json(j, &v, err, sizeof err), 0);
        /* through the wire as a Value */
        size_t n = protobuf_c_message_get_packed_size(&v->base);
        uint8_t buf[256];
        assert_true(n <= sizeof buf);
        protobuf_c_message_pack(&v->base, buf);
        Google__Protobuf__Value *u = google__protobuf__value__unpack(NULL, n, buf);
        assert_non_null(u);
        cJSON *back = pbjson_value_to_json(u);
        assert_true(cJSON_Compare(j, back, 1));
        assert_same_text(j, back);
        cJSON_Delete(back);
        protobuf_c_message_free_unpacked(&u->base, NULL);
        pbjson_value_free(v);
        cJSON_Delete(j);
    }
    /* The wire kinds are the documented ones. */
    cJSON *j = cJSON_Parse("{\"n\":null,\"b\":true,\"d\":2,\"s\":\"x\",\"o\":{},\"l\":[]}");
    Google__Protobuf__Struct *s = NULL;
    assert_int_equal(pbjson_struct_from_json(j, &s, NULL, 0), 0);
    assert_int_equal(s->n_fields, 6);
    assert_int_equal(s->fields[0]->value->kind_case, GOOGLE__PROTOBUF__VALUE__KIND_NULL_VALUE);
    assert_int_equal(s->fields[1]->value->kind_case, GOOGLE__PROTOBUF__VALUE__KIND_BOOL_VALUE);
    assert_int_equal(s->fields[2]->value->kind_case, GOOGLE__PROTOBUF__VALUE__KIND_NUMBER_VALUE);
    assert_int_equal(s->fields[3]->value->kind_case, GOOGLE__PROTOBUF__VALUE__KIND_STRING_VALUE);
    assert_int_equal(s->fields[4]->value->kind_case, GOOGLE__PROTOBUF__VALUE__KIND_STRUCT_VALUE);
    assert_int_equal(s->fields[5]->value->kind_case, GOOGLE__PROTOBUF__VALUE__KIND_LIST_VALUE);
    assert_string_equal(s->fields[3]->key, "s");
    pbjson_struct_free(s);
    cJSON_Delete(j);
}

/* Struct numbers are doubles: 2^53 survives, 2^53 + 1 arrives as 2^53, and an id that must
 * stay exact has to travel as a string. */
static void test_large_integers(void **state) {
    (void)state;
    cJSON *in = cJSON_Parse("{\"exact\":9007199254740992,\"lossy\":9007199254740993,"
                            "\"neg\":-9007199254740993,\"as_text\":\"9007199254740993\","
                            "\"small\":4294967297}");
    cJSON *out = roundtrip_wire(in);
    assert_true(cJSON_GetObjectItem(out, "exact")->valuedouble == 9007199254740992.0);
    assert_true(cJSON_GetObjectItem(out, "lossy")->valuedouble == 9007199254740992.0);
    assert_true(cJSON_GetObjectItem(out, "neg")->valuedouble == -9007199254740992.0);
    assert_string_equal(cJSON_GetObjectItem(out, "as_text")->valuestring, "9007199254740993");
    assert_true(cJSON_GetObjectItem(out, "small")->valuedouble == 4294967297.0);
    /* cJSON's printer keeps 15 significant digits: integers up to 10^15 print exactly,
     * larger ones do not (pbjson.h says so). */
    char *text = cJSON_PrintUnformatted(out);
    assert_non_null(strstr(text, "\"small\":4294967297}"));
    assert_null(strstr(text, "9007199254740992"));
    free(text);
    cJSON *ms = cJSON_Parse("{\"ms\":999999999999999}");
    cJSON *ms_back = roundtrip_wire(ms);
    text = cJSON_PrintUnformatted(ms_back);
    assert_string_equal(text, "{\"ms\":999999999999999}");
    free(text);
    cJSON_Delete(ms);
    cJSON_Delete(ms_back);
    cJSON_Delete(in);
    cJSON_Delete(out);
}

static void expect_error(const char *json, const char *want_err) {
    cJSON *j = cJSON_Parse(json);
    assert_non_null(j);
    Google__Protobuf__Struct *s = (Google__Protobuf__Struct *)0x1;
    char err[256] = "";
    assert_int_equal(pbjson_struct_from_json(j, &s, err, sizeof err), -1);
    assert_ptr_equal(s, (Google__Protobuf__Struct *)0x1); /* untouched */
    if (strcmp(err, want_err) != 0) print_error("err: %s\n", err);
    assert_string_equal(err, want_err);
    cJSON_Delete(j);
}

static void test_refusals(void **state) {
    (void)state;
    expect_error("{\"a\":{\"b\":[0,1e400]}}", "/a/b/1: number is not finite");
    expect_error("{\"a\":-1e400}", "/a: number is not finite");
    expect_error("{\"k\":1,\"x\":{\"d\":1,\"d\":2}}", "/x: duplicate key \"d\"");
    expect_error("{\"list\":[\"ok\",\"bad \xff\"]}", "/list/1: string is not valid UTF-8");
    expect_error("{\"over\xc0\xaf\":1}", "/: member name is not valid UTF-8");
    expect_error("{\"a/b~c\":[\"\xed\xa0\x80\"]}", "/a~1b~0c/0: string is not valid UTF-8");
    expect_error("[1]", "/: not a JSON object");

    /* NaN built programmatically (no JSON text can carry it). */
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "nan", NAN);
    Google__Protobuf__Struct *s = NULL;
    char err[128];
    assert_int_equal(pbjson_struct_from_json(o, &s, err, sizeof err), -1);
    assert_string_equal(err, "/nan: number is not finite");
    cJSON_Delete(o);
    assert_int_equal(pbjson_struct_from_json(NULL, &s, err, sizeof err), -1);
}

/* {"d":{"d":...}} with `levels` objects in total, the root included. */
static cJSON *nested(int levels, int arrays) {
    cJSON *inner = arrays ? cJSON_CreateArray() : cJSON_CreateObject();
    for (int i = 1; i < levels - 1; i++) {
        cJSON *c = arrays ? cJSON_CreateArray() : cJSON_CreateObject();
        if (arrays)
            cJSON_AddItemToArray(c, inner);
        else
            cJSON_AddItemToObject(c, "d", inner);
        inner = c;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "d", inner);
    return root;
}

static void test_depth(void **state) {
    (void)state;
    for (int arrays = 0; arrays <= 1; arrays++) {
        cJSON *ok = nested(PBJSON_MAX_DEPTH, arrays), *deep = nested(PBJSON_MAX_DEPTH + 1, arrays);
        Google__Protobuf__Struct *s = NULL;
        char err[512];
        assert_int_equal(pbjson_struct_from_json(ok, &s, err, sizeof err), 0);
        cJSON *back = pbjson_struct_to_json(s);
        /* Text, not cJSON_Compare: that compares objects both ways per level (2^depth). */
        assert_same_text(ok, back);
        cJSON_Delete(back);
        pbjson_struct_free(s);
        assert_int_equal(pbjson_struct_from_json(deep, &s, err, sizeof err), -1);
        assert_non_null(strstr(err, "nested deeper than 64"));
        cJSON_Delete(ok);
        cJSON_Delete(deep);
    }
}

/* Wire Structs built by hand: repeated keys keep the last value (map semantics), a Value
 * without a kind and a non-finite number become null, and over-deep trees are refused. */
static void test_to_json_wire_shapes(void **state) {
    (void)state;
    Google__Protobuf__Value v1 = GOOGLE__PROTOBUF__VALUE__INIT, v2 = GOOGLE__PROTOBUF__VALUE__INIT,
                            v3 = GOOGLE__PROTOBUF__VALUE__INIT, v4 = GOOGLE__PROTOBUF__VALUE__INIT;
    v1.kind_case = GOOGLE__PROTOBUF__VALUE__KIND_NUMBER_VALUE;
    v1.number_value = 1;
    v2.kind_case = GOOGLE__PROTOBUF__VALUE__KIND_STRING_VALUE;
    v2.string_value = (char *)"second";
    v4.kind_case = GOOGLE__PROTOBUF__VALUE__KIND_NUMBER_VALUE;
    v4.number_value = INFINITY;
    Google__Protobuf__Struct__FieldsEntry e1 = GOOGLE__PROTOBUF__STRUCT__FIELDS_ENTRY__INIT,
                                          e2 = GOOGLE__PROTOBUF__STRUCT__FIELDS_ENTRY__INIT,
                                          e3 = GOOGLE__PROTOBUF__STRUCT__FIELDS_ENTRY__INIT,
                                          e4 = GOOGLE__PROTOBUF__STRUCT__FIELDS_ENTRY__INIT,
                                          e5 = GOOGLE__PROTOBUF__STRUCT__FIELDS_ENTRY__INIT;
    e1.key = (char *)"k", e1.value = &v1;
    e2.key = (char *)"unset", e2.value = &v3;
    e3.key = (char *)"k", e3.value = &v2;
    e4.key = (char *)"inf", e4.value = &v4;
    e5.key = (char *)"missing", e5.value = NULL;
    Google__Protobuf__Struct__FieldsEntry *entries[] = {&e1, &e2, &e3, &e4, &e5};
    Google__Protobuf__Struct s = GOOGLE__PROTOBUF__STRUCT__INIT;
    s.n_fields = 5;
    s.fields = entries;
    cJSON *j = pbjson_struct_to_json(&s);
    char *text = cJSON_PrintUnformatted(j);
    assert_string_equal(text, "{\"unset\":null,\"k\":\"second\",\"inf\":null,\"missing\":null}");
    free(text);
    cJSON_Delete(j);

    /* A too-deep wire tree: to_json refuses (NULL) instead of recursing without bound. */
    cJSON *deep = nested(PBJSON_MAX_DEPTH, 0);
    Google__Protobuf__Struct *d = NULL;
    assert_int_equal(pbjson_struct_from_json(deep, &d, NULL, 0), 0);
    Google__Protobuf__Value wrap = GOOGLE__PROTOBUF__VALUE__INIT;
    wrap.kind_case = GOOGLE__PROTOBUF__VALUE__KIND_STRUCT_VALUE;
    wrap.struct_value = d;
    Google__Protobuf__Struct__FieldsEntry we = GOOGLE__PROTOBUF__STRUCT__FIELDS_ENTRY__INIT;
    we.key = (char *)"d";
    we.value = &wrap;
    Google__Protobuf__Struct__FieldsEntry *wes[] = {&we};
    Google__Protobuf__Struct top = GOOGLE__PROTOBUF__STRUCT__INIT;
    top.n_fields = 1;
    top.fields = wes;
    assert_null(pbjson_struct_to_json(&top));
    cJSON *ok = pbjson_struct_to_json(d);
    assert_non_null(ok);
    cJSON_Delete(ok);
    pbjson_struct_free(d);
    cJSON_Delete(deep);
}

/* ---- timestamps ---- */

static void test_ts_ms(void **state) {
    (void)state;
    Google__Protobuf__Timestamp ts;
    struct {
        int64_t ms, sec;
        int32_t nanos;
    } cases[] = {{0, 0, 0},      {1, 0, 1000000},        {-1, -1, 999000000},
                 {-1000, -1, 0}, {-1001, -2, 999000000}, {1700000000123LL, 1700000000, 123000000}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pbjson_ts_from_ms(&ts, cases[i].ms);
        assert_int_equal(ts.seconds, cases[i].sec);
        assert_int_equal(ts.nanos, cases[i].nanos);
        assert_int_equal(pbjson_ts_to_ms(&ts), cases[i].ms);
        assert_ptr_equal(ts.base.descriptor, &google__protobuf__timestamp__descriptor);
    }
    ts.seconds = 5;
    ts.nanos = 999999999; /* sub-millisecond part is dropped, not rounded up */
    assert_int_equal(pbjson_ts_to_ms(&ts), 5999);
    pbjson_ts_now(&ts);
    int64_t now = (int64_t)time(NULL);
    assert_true(ts.seconds >= now - 1 && ts.seconds <= now + 1);
    assert_true(ts.nanos >= 0 && ts.nanos < 1000000000);
}

static void test_ts_format(void **state) {
    (void)state;
    struct {
        int64_t sec;
        int32_t nanos;
        const char *text;
    } cases[] = {
        {0, 0, "1970-01-01T00:00:00Z"},
        {1700000000, 123000000, "2023-11-14T22:13:20.123Z"},
        {1700000000, 123456000, "2023-11-14T22:13:20.123456Z"},
        {1700000000, 1, "2023-11-14T22:13:20.000000001Z"},
        {1709164800, 0, "2024-02-29T00:00:00Z"},
        {951782400, 0, "2000-02-29T00:00:00Z"},
        {-1, 500000000, "1969-12-31T23:59:59.500Z"},
        {-62135596800LL, 0, "0001-01-01T00:00:00Z"},
        {253402300799LL, 999999999, "9999-12-31T23:59:59.999999999Z"},
    };
    char buf[PBJSON_TS_MAX];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Google__Protobuf__Timestamp ts = GOOGLE__PROTOBUF__TIMESTAMP__INIT, back;
        ts.seconds = cases[i].sec;
        ts.nanos = cases[i].nanos;
        assert_int_equal(pbjson_ts_to_rfc3339(&ts, buf, sizeof buf), 0);
        assert_string_equal(buf, cases[i].text);
        assert_int_equal(pbjson_ts_parse_rfc3339(buf, &back), 0);
        assert_int_equal(back.seconds, ts.seconds);
        assert_int_equal(back.nanos, ts.nanos);
    }
    Google__Protobuf__Timestamp bad = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    bad.seconds = 253402300800LL;
    assert_int_equal(pbjson_ts_to_rfc3339(&bad, buf, sizeof buf), -1);
    bad.seconds = -62135596801LL;
    assert_int_equal(pbjson_ts_to_rfc3339(&bad, buf, sizeof buf), -1);
    bad.seconds = 0;
    bad.nanos = 1000000000;
    assert_int_equal(pbjson_ts_to_rfc3339(&bad, buf, sizeof buf), -1);
    bad.nanos = -1;
    assert_int_equal(pbjson_ts_to_rfc3339(&bad, buf, sizeof buf), -1);
    bad.nanos = 0;
    assert_int_equal(pbjson_ts_to_rfc3339(&bad, buf, PBJSON_TS_MAX - 1), -1);

    /* Agreement with the C library over a sweep of instants. */
    for (int64_t t = -2208988800LL; t < 4102444800LL; t += 7776013) {
        Google__Protobuf__Timestamp ts = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
        char want[64];
        time_t tt = (time_t)t;
        struct tm tm;
        gmtime_r(&tt, &tm);
        strftime(want, sizeof want, "%Y-%m-%dT%H:%M:%SZ", &tm);
        ts.seconds = t;
        assert_int_equal(pbjson_ts_to_rfc3339(&ts, buf, sizeof buf), 0);
        assert_string_equal(buf, want);
    }
}

static void test_ts_parse(void **state) {
    (void)state;
    Google__Protobuf__Timestamp ts;
    assert_int_equal(pbjson_ts_parse_rfc3339("2023-11-14T23:13:20.5+01:00", &ts), 0);
    assert_int_equal(ts.seconds, 1700000000);
    assert_int_equal(ts.nanos, 500000000);
    assert_int_equal(pbjson_ts_parse_rfc3339("2023-11-14t17:43:20-04:30", &ts), 0);
    assert_int_equal(ts.seconds, 1700000000);
    assert_int_equal(pbjson_ts_parse_rfc3339("2023-11-14T22:13:20.1z", &ts), 0);
    assert_int_equal(ts.nanos, 100000000);
    const char *bad[] = {
        "",
        "2023-11-14",
        "2023-11-14T22:13:20",  /* no zone */
        "2023-11-14 22:13:20Z", /* space separator */
        "2023-02-29T00:00:00Z", /* not a leap year */
        "1900-02-29T00:00:00Z", /* century rule */
        "2023-04-31T00:00:00Z",
        "2023-13-01T00:00:00Z",
        "2023-00-01T00:00:00Z",
        "2023-11-14T24:00:00Z",
        "2023-11-14T23:60:00Z",
        "2016-12-31T23:59:60Z", /* leap second */
        "2023-11-14T22:13:20.Z",
        "2023-11-14T22:13:20.1234567890Z", /* 10 fraction digits */
        "2023-11-14T22:13:20Zjunk",
        "2023-11-14T22:13:20+0100",
        "2023-11-14T22:13:20+24:00",
        "0000-01-01T00:00:00Z",
        "0001-01-01T00:00:00+00:01", /* before the minimum once shifted */
        "9999-12-31T23:59:59-00:01", /* after the maximum once shifted */
        "+2023-11-14T22:13:20Z",
        "2023-1-14T22:13:20Z",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ts.seconds = 42;
        if (pbjson_ts_parse_rfc3339(bad[i], &ts) != -1) print_error("accepted %s\n", bad[i]);
        assert_int_equal(pbjson_ts_parse_rfc3339(bad[i], &ts), -1);
        assert_int_equal(ts.seconds, 42); /* untouched */
    }
    assert_int_equal(pbjson_ts_parse_rfc3339("2000-02-29T00:00:00Z", &ts), 0);
    assert_int_equal(pbjson_ts_parse_rfc3339(NULL, &ts), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),      cmocka_unit_test(test_empty_and_scalars),
        cmocka_unit_test(test_large_integers), cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_depth),          cmocka_unit_test(test_to_json_wire_shapes),
        cmocka_unit_test(test_ts_ms),          cmocka_unit_test(test_ts_format),
        cmocka_unit_test(test_ts_parse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

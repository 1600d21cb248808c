/* google.protobuf.Struct / Value / ListValue <-> cJSON, and google.protobuf.Timestamp helpers.
 *
 * Mapping (the protobuf JSON mapping): object <-> Struct, array <-> ListValue, string, number
 * (double), bool and null <-> the matching Value kind.
 *
 * - Numbers are doubles on the wire: integers beyond 2^53 (9007199254740992) lose precision
 *   (2^53 + 1 arrives as 2^53). Send such ids as strings. Note also that cJSON_Print writes
 *   15 significant digits, so integers above 10^15 are not exact in printed JSON either.
 * - Non-finite numbers are refused by from_json (JSON cannot carry NaN or Infinity; cJSON
 *   turns 1e400 into Infinity). to_json writes null for a non-finite number decoded from the
 *   wire, and for a Value with no kind set.
 * - Object members keep their JSON order in Struct.fields (and back). A JSON object with the
 *   same key twice is refused; a wire Struct with a repeated key keeps the last value, as
 *   protobuf map semantics say.
 * - Strings and keys must be valid UTF-8 (protobuf `string` fields are); escaped \u sequences,
 *   surrogate pairs included, arrive as UTF-8 through cJSON.
 * - Nesting deeper than PBJSON_MAX_DEPTH objects/arrays is refused (the root object counts 1).
 *
 * Allocation: trees built by *_from_json are plain heap trees (every message, key, string and
 * pointer array is its own malloc block) and are released with pbjson_struct_free /
 * pbjson_value_free. Trees decoded by protobuf_c_message_unpack are released with
 * protobuf_c_message_free_unpacked instead. */
#ifndef UPSQUAD_PBJSON_H
#define UPSQUAD_PBJSON_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "google/protobuf/struct.pb-c.h"
#include "google/protobuf/timestamp.pb-c.h"

#define PBJSON_MAX_DEPTH 64

/* obj must be a JSON object. *out: caller frees with pbjson_struct_free. On error returns -1
 * with err naming the JSON pointer of the offending member ("/steps/3/name: ..."). */
int pbjson_struct_from_json(const cJSON *obj, Google__Protobuf__Struct **out, char *err,
                            size_t errlen);
/* Any JSON value. *out: caller frees with pbjson_value_free. */
int pbjson_value_from_json(const cJSON *v, Google__Protobuf__Value **out, char *err, size_t errlen);

/* The same, every node from `alloc`: with rpc_call_allocator(call) the tree lives in the call's
 * arena and goes with the call (nothing to free, nothing to leak; a handler puts it straight
 * into its response instead of deep-copying). alloc NULL: the heap, as above. On error the
 * partial tree is handed back to alloc->free (a no-op for the arena). */
int pbjson_struct_from_json_a(const cJSON *obj, ProtobufCAllocator *alloc,
                              Google__Protobuf__Struct **out, char *err, size_t errlen);
int pbjson_value_from_json_a(const cJSON *v, ProtobufCAllocator *alloc,
                             Google__Protobuf__Value **out, char *err, size_t errlen);

/* Caller frees with cJSON_Delete. NULL on OOM or nesting deeper than PBJSON_MAX_DEPTH. */
cJSON *pbjson_struct_to_json(const Google__Protobuf__Struct *s);
cJSON *pbjson_value_to_json(const Google__Protobuf__Value *v);

void pbjson_struct_free(Google__Protobuf__Struct *s);
void pbjson_value_free(Google__Protobuf__Value *v);

/* Timestamps. The setters (re)initialise *ts. Valid timestamps lie within
 * 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999999Z with 0 <= nanos < 1e9. */
void pbjson_ts_now(Google__Protobuf__Timestamp *ts);
int64_t pbjson_ts_to_ms(const Google__Protobuf__Timestamp *ts); /* rounds towards -inf */
void pbjson_ts_from_ms(Google__Protobuf__Timestamp *ts, int64_t ms);
/* "2026-12-02T14:50:01Z", with 3, 6 or 9 fraction digits when nanos != 0 (as the protobuf
 * JSON mapping writes them). Needs len >= PBJSON_TS_MAX. 0, or -1 for an invalid timestamp
 * or a short buffer. */
#define PBJSON_TS_MAX 31
int pbjson_ts_to_rfc3339(const Google__Protobuf__Timestamp *ts, char *buf, size_t len);
/* RFC 3339: "YYYY-MM-DDTHH:MM:SS[.1-9 digits](Z|+HH:MM|-HH:MM)", 'T' and 'Z' in either case,
 * no leap second. 0, or -1 (ts untouched). */
int pbjson_ts_parse_rfc3339(const char *s, Google__Protobuf__Timestamp *ts);

#endif

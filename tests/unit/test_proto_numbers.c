/* Wire contract of the .proto transcription: every field and enum number that the API documents
 * (spec/agent-runtime-api.txt, spec/workflow-api.txt) state in their prose, the oneofs the prose
 * describes, the map and proto3-optional shapes, and each service's method table — read back from
 * the generated protobuf-c descriptors, plus a few encodings checked byte for byte so that a
 * renumbered field cannot slip through as "still compiles". */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include <protobuf-c/protobuf-c.h>

#include "upsquad/runtime/v1/lifecycle.pb-c.h"
#include "upsquad/runtime/v1/model.pb-c.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

typedef struct {
    const char *field;
    uint32_t id;
} field_num;

typedef struct {
    const char *name;
    int value;
} enum_num;

typedef struct {
    const char *name;
    const ProtobufCMessageDescriptor *input;
    const ProtobufCMessageDescriptor *output;
} method_sig;

/* Looks a field up by name; fails the test (naming message and field) when it is absent. */
static const ProtobufCFieldDescriptor *must_field(const ProtobufCMessageDescriptor *msg,
                                                  const char *name) {
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(msg, name);
    if (f == NULL) fail_msg("%s has no field %s", msg->name, name);
    return f;
}

static void check_numbers(const ProtobufCMessageDescriptor *msg, const field_num *t, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const ProtobufCFieldDescriptor *f = must_field(msg, t[i].field);
        if (f->id != t[i].id)
            fail_msg("%s.%s is field %u, the spec says %u", msg->name, t[i].field, f->id, t[i].id);
        /* The lookup by number must land on the same field (no duplicate or shadowing). */
        assert_ptr_equal(protobuf_c_message_descriptor_get_field(msg, t[i].id), f);
    }
}

/* Every arm has its number and belongs to the oneof whose case member sits at case_offset, and
 * the oneof has exactly these arms. */
static void check_oneof(const ProtobufCMessageDescriptor *msg, unsigned case_offset,
                        const field_num *arms, size_t n) {
    check_numbers(msg, arms, n);
    for (size_t i = 0; i < n; i++) {
        const ProtobufCFieldDescriptor *f = must_field(msg, arms[i].field);
        if (!(f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) || f->quantifier_offset != case_offset)
            fail_msg("%s.%s is not an arm of the expected oneof", msg->name, arms[i].field);
    }
    size_t members = 0;
    for (unsigned i = 0; i < msg->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &msg->fields[i];
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) && f->quantifier_offset == case_offset)
            members++;
    }
    assert_int_equal(members, n);
}

static void check_not_in_oneof(const ProtobufCMessageDescriptor *msg, const char *name) {
    if (must_field(msg, name)->flags & PROTOBUF_C_FIELD_FLAG_ONEOF)
        fail_msg("%s.%s must not be in a oneof", msg->name, name);
}

/* A proto map field: repeated entry message whose key = 1 and value = 2 have the given types
 * (value_desc is the value's message descriptor for message-valued maps, else NULL). */
static void check_map(const ProtobufCMessageDescriptor *msg, const char *name, uint32_t id,
                      const ProtobufCMessageDescriptor *entry, ProtobufCType value_type,
                      const ProtobufCMessageDescriptor *value_desc) {
    const ProtobufCFieldDescriptor *f = must_field(msg, name);
    assert_int_equal(f->id, id);
    assert_int_equal(f->label, PROTOBUF_C_LABEL_REPEATED);
    assert_int_equal(f->type, PROTOBUF_C_TYPE_MESSAGE);
    assert_ptr_equal(f->descriptor, entry);
    assert_int_equal(entry->n_fields, 2);
    const ProtobufCFieldDescriptor *k = must_field(entry, "key");
    const ProtobufCFieldDescriptor *v = must_field(entry, "value");
    assert_int_equal(k->id, 1);
    assert_int_equal(k->type, PROTOBUF_C_TYPE_STRING);
    assert_int_equal(v->id, 2);
    assert_int_equal(v->type, value_type);
    if (value_desc != NULL) assert_ptr_equal(v->descriptor, value_desc);
}

static void check_enum(const ProtobufCEnumDescriptor *e, const enum_num *t, size_t n) {
    assert_int_equal(e->n_values, n);
    for (size_t i = 0; i < n; i++) {
        const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value_by_name(e, t[i].name);
        if (v == NULL) fail_msg("%s has no value %s", e->name, t[i].name);
        if (v->value != t[i].value)
            fail_msg("%s.%s = %d, the spec says %d", e->name, t[i].name, v->value, t[i].value);
        assert_string_equal(protobuf_c_enum_descriptor_get_value(e, t[i].value)->name, t[i].name);
    }
}

static void check_service(const ProtobufCServiceDescriptor *sd, const char *full_name,
                          const method_sig *t, size_t n) {
    assert_string_equal(sd->name, full_name);
    assert_int_equal(sd->n_methods, n);
    for (size_t i = 0; i < n; i++) {
        const ProtobufCMethodDescriptor *m = &sd->methods[i];
        if (strcmp(m->name, t[i].name) != 0)
            fail_msg("%s method %zu is %s, expected %s", full_name, i, m->name, t[i].name);
        if (m->input != t[i].input || m->output != t[i].output)
            fail_msg("%s.%s has types %s -> %s", full_name, m->name, m->input->name,
                     m->output->name);
        assert_ptr_equal(protobuf_c_service_descriptor_get_method_by_name(sd, t[i].name), m);
    }
}

/* Packs msg into buf and compares with the expected bytes. */
static void check_packed(const ProtobufCMessage *msg, const uint8_t *want, size_t want_len) {
    uint8_t buf[64];
    size_t len = protobuf_c_message_get_packed_size(msg);
    assert_int_equal(len, want_len);
    assert_true(len <= sizeof buf);
    assert_int_equal(protobuf_c_message_pack(msg, buf), want_len);
    assert_memory_equal(buf, want, want_len);
}

/* ---- runtime.proto ---- */

static void test_execute_step_event_arms(void **state) {
    (void)state;
    /* "arms run token = 1 ... input_required = 15"; security is "field 9", structured_answer
     * "field 10"/"= 10", step_progress "Tag 11", interrupt_required "Tag 12"/"field 12",
     * decomposition "Tag 13", write_confirm "Tag 14", input_required "Tag 15". */
    static const field_num arms[] = {
        {"token", 1},           {"tool_call", 2},
        {"tool_result", 3},     {"status", 4},
        {"completion", 5},      {"metrics", 6},
        {"error", 7},           {"checkpoint", 8},
        {"security", 9},        {"structured_answer", 10},
        {"step_progress", 11},  {"interrupt_required", 12},
        {"decomposition", 13},  {"write_confirm", 14},
        {"input_required", 15},
    };
    const ProtobufCMessageDescriptor *d = &upsquad__runtime__v1__execute_step_event__descriptor;
    check_oneof(d, offsetof(Upsquad__Runtime__V1__ExecuteStepEvent, event_case), arms,
                N_ELEMS(arms));
    assert_int_equal(d->n_fields, N_ELEMS(arms));
    assert_ptr_equal(must_field(d, "input_required")->descriptor,
                     &upsquad__runtime__v1__input_required__descriptor);
    assert_ptr_equal(must_field(d, "interrupt_required")->descriptor,
                     &upsquad__runtime__v1__interrupt_required__descriptor);
    assert_null(protobuf_c_message_descriptor_get_field(d, 16));
    assert_null(protobuf_c_message_descriptor_get_field_by_name(d, "session_paused"));
}

static void test_execute_step_request_numbers(void **state) {
    (void)state;
    /* user_message "(field 4)", provider_keys "(field 6)", step_goal "field 8", then the
     * "Field N next-free" statements and "agent_gateway_token, field 9". */
    static const field_num t[] = {
        {"user_message", 4},        {"provider_keys", 6},         {"step_goal", 8},
        {"agent_gateway_token", 9}, {"context_engine_token", 10}, {"prior_turns", 11},
        {"ask_user_resume", 12},
    };
    const ProtobufCMessageDescriptor *d = &upsquad__runtime__v1__execute_step_request__descriptor;
    check_numbers(d, t, N_ELEMS(t));
    assert_int_equal(d->n_fields, 12);
    assert_int_equal(must_field(d, "prior_turns")->label, PROTOBUF_C_LABEL_REPEATED);
    check_map(d, "provider_keys", 6,
              &upsquad__runtime__v1__execute_step_request__provider_keys_entry__descriptor,
              PROTOBUF_C_TYPE_STRING, NULL);
}

static void test_session_snapshot_maps(void **state) {
    (void)state;
    const ProtobufCMessageDescriptor *d = &upsquad__runtime__v1__session_snapshot__descriptor;
    /* "mcp_servers ... Field 20." */
    check_map(d, "mcp_servers", 20,
              &upsquad__runtime__v1__session_snapshot__mcp_servers_entry__descriptor,
              PROTOBUF_C_TYPE_MESSAGE, &upsquad__runtime__v1__mcp_server_ref__descriptor);
    check_map(d, "rbac_grants", 9,
              &upsquad__runtime__v1__session_snapshot__rbac_grants_entry__descriptor,
              PROTOBUF_C_TYPE_STRING, NULL);
    assert_int_equal(d->n_fields, 20);
}

static void test_runtime_enums(void **state) {
    (void)state;
    static const enum_num status[] = {
        {"AGENT_STATUS_UNSPECIFIED", 0}, {"AGENT_STATUS_THINKING", 1},
        {"AGENT_STATUS_ACTING", 2},      {"AGENT_STATUS_COMPLETE", 3},
        {"AGENT_STATUS_ERROR", 4},       {"AGENT_STATUS_SUSPENDED", 5},
    };
    static const enum_num mode[] = {
        {"EXECUTION_MODE_UNSPECIFIED", 0},
        {"EXECUTION_MODE_SINGLE_TURN", 1},
        {"EXECUTION_MODE_MULTI_TURN", 2},
        {"EXECUTION_MODE_AUTONOMOUS", 3},
    };
    static const enum_num role[] = {
        {"ROLE_UNSPECIFIED", 0},
        {"ROLE_USER", 1},
        {"ROLE_ASSISTANT", 2},
    };
    static const enum_num pause[] = {
        {"PAUSE_SOURCE_UNSPECIFIED", 0}, {"PAUSE_SOURCE_OPERATOR", 1},
        {"PAUSE_SOURCE_APPROVAL", 2},    {"PAUSE_SOURCE_POLICY", 3},
        {"PAUSE_SOURCE_DELEGATION", 4},  {"PAUSE_SOURCE_DELEGATION_APPROVAL", 5},
    };
    check_enum(&upsquad__runtime__v1__agent_status__descriptor, status, N_ELEMS(status));
    check_enum(&upsquad__runtime__v1__execution_mode__descriptor, mode, N_ELEMS(mode));
    check_enum(&upsquad__runtime__v1__prior_turn__role__descriptor, role, N_ELEMS(role));
    check_enum(&upsquad__runtime__v1__pause_source__descriptor, pause, N_ELEMS(pause));
    /* Role is nested in PriorTurn, as the spec's "PriorTurn.Role" heading says. */
    assert_string_equal(upsquad__runtime__v1__prior_turn__role__descriptor.name,
                        "upsquad.runtime.v1.PriorTurn.Role");
    /* WAITING_APPROVAL and DELEGATING are only reserved by the spec, not defined. */
    assert_null(protobuf_c_enum_descriptor_get_value_by_name(
        &upsquad__runtime__v1__agent_status__descriptor, "AGENT_STATUS_WAITING_APPROVAL"));
    assert_null(
        protobuf_c_enum_descriptor_get_value(&upsquad__runtime__v1__execution_mode__descriptor, 4));
}

static void test_runtime_wire_tags(void **state) {
    (void)state;
    Upsquad__Runtime__V1__ExecuteStepEvent ev = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__INIT;
    Upsquad__Runtime__V1__InputRequired ir = UPSQUAD__RUNTIME__V1__INPUT_REQUIRED__INIT;
    ev.event_case = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INPUT_REQUIRED;
    ev.input_required = &ir;
    static const uint8_t ev_bytes[] = {(15 << 3) | 2, 0x00};
    check_packed(&ev.base, ev_bytes, sizeof ev_bytes);

    /* A client's step_progress arm (tag 11, empty) decodes into the right case. */
    static const uint8_t sp_bytes[] = {(11 << 3) | 2, 0x00};
    Upsquad__Runtime__V1__ExecuteStepEvent *got =
        upsquad__runtime__v1__execute_step_event__unpack(NULL, sizeof sp_bytes, sp_bytes);
    assert_non_null(got);
    assert_int_equal(got->event_case,
                     UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STEP_PROGRESS);
    assert_non_null(got->step_progress);
    upsquad__runtime__v1__execute_step_event__free_unpacked(got, NULL);

    /* A length that runs past the buffer is rejected. */
    static const uint8_t bad[] = {(15 << 3) | 2, 0x05};
    assert_null(upsquad__runtime__v1__execute_step_event__unpack(NULL, sizeof bad, bad));

    Upsquad__Runtime__V1__ExecuteStepRequest req = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_REQUEST__INIT;
    Upsquad__Runtime__V1__ExecuteStepRequest__ProviderKeysEntry key =
        UPSQUAD__RUNTIME__V1__EXECUTE_STEP_REQUEST__PROVIDER_KEYS_ENTRY__INIT;
    Upsquad__Runtime__V1__ExecuteStepRequest__ProviderKeysEntry *keys[] = {&key};
    key.key = "k";
    key.value = "v";
    req.n_provider_keys = 1;
    req.provider_keys = keys;
    req.agent_gateway_token = "t";
    static const uint8_t req_bytes[] = {
        (6 << 3) | 2, 6, 0x0a, 1, 'k', 0x12, 1, 'v', /* provider_keys = 6, map entry */
        (9 << 3) | 2, 1, 't',                        /* agent_gateway_token = 9 */
    };
    check_packed(&req.base, req_bytes, sizeof req_bytes);

    Upsquad__Runtime__V1__SessionSnapshot snap = UPSQUAD__RUNTIME__V1__SESSION_SNAPSHOT__INIT;
    Upsquad__Runtime__V1__SessionSnapshot__McpServersEntry srv =
        UPSQUAD__RUNTIME__V1__SESSION_SNAPSHOT__MCP_SERVERS_ENTRY__INIT;
    Upsquad__Runtime__V1__SessionSnapshot__McpServersEntry *srvs[] = {&srv};
    Upsquad__Runtime__V1__McpServerRef ref = UPSQUAD__RUNTIME__V1__MCP_SERVER_REF__INIT;
    ref.prefix = "p";
    srv.key = "s1";
    srv.value = &ref;
    snap.n_mcp_servers = 1;
    snap.mcp_servers = srvs;
    static const uint8_t snap_bytes[] = {
        0xa2, 0x01, 9, /* varint tag (20 << 3) | 2 */
        0x0a, 2,    's', '1', 0x12, 3, 0x0a, 1, 'p',
    };
    check_packed(&snap.base, snap_bytes, sizeof snap_bytes);
}

static void test_runtime_service(void **state) {
    (void)state;
    static const method_sig t[] = {
        {"ExecuteStep", &upsquad__runtime__v1__execute_step_request__descriptor,
         &upsquad__runtime__v1__execute_step_event__descriptor},
        {"InitWorkerSession", &upsquad__runtime__v1__init_worker_session_request__descriptor,
         &upsquad__runtime__v1__init_worker_session_response__descriptor},
        {"TerminateSession", &upsquad__runtime__v1__terminate_session_request__descriptor,
         &upsquad__runtime__v1__terminate_session_response__descriptor},
        {"Checkpoint", &upsquad__runtime__v1__checkpoint_request__descriptor,
         &upsquad__runtime__v1__checkpoint_response__descriptor},
        {"Heartbeat", &upsquad__runtime__v1__heartbeat_request__descriptor,
         &upsquad__runtime__v1__heartbeat_response__descriptor},
    };
    check_service(&upsquad__runtime__v1__runtime_service__descriptor,
                  "upsquad.runtime.v1.RuntimeService", t, N_ELEMS(t));
}

/* ---- lifecycle.proto ---- */

static void test_agent_event_arms(void **state) {
    (void)state;
    /* structured_answer is "field 7 in AgentEvent oneof", delegated "Tag 9", write_confirm
     * "Tag 10 — arms 1–9 are occupied". */
    static const field_num arms[] = {
        {"token", 1},
        {"status", 2},
        {"completion", 3},
        {"error", 4},
        {"session_paused", 5},
        {"session_resumed", 6},
        {"structured_answer", 7},
        {"interrupt_required", 8},
        {"delegated", 9},
        {"write_confirm", 10},
    };
    const ProtobufCMessageDescriptor *d = &upsquad__runtime__v1__agent_event__descriptor;
    check_oneof(d, offsetof(Upsquad__Runtime__V1__AgentEvent, event_case), arms, N_ELEMS(arms));
    assert_int_equal(d->n_fields, N_ELEMS(arms));
    /* The portal arm is the client-safe projection, not the worker's InterruptRequired. */
    assert_ptr_equal(must_field(d, "interrupt_required")->descriptor,
                     &upsquad__runtime__v1__interrupt_required_event__descriptor);
    assert_ptr_equal(must_field(d, "delegated")->descriptor,
                     &upsquad__runtime__v1__delegated_event_envelope__descriptor);
    /* AgentEvent carries a subset: no raw tool-call arm. */
    assert_null(protobuf_c_message_descriptor_get_field_by_name(d, "tool_call"));

    Upsquad__Runtime__V1__AgentEvent ev = UPSQUAD__RUNTIME__V1__AGENT_EVENT__INIT;
    Upsquad__Runtime__V1__DelegatedEventEnvelope env =
        UPSQUAD__RUNTIME__V1__DELEGATED_EVENT_ENVELOPE__INIT;
    env.child_session_id = "c";
    ev.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_DELEGATED;
    ev.delegated = &env;
    static const uint8_t bytes[] = {(9 << 3) | 2, 3, (2 << 3) | 2, 1, 'c'};
    check_packed(&ev.base, bytes, sizeof bytes);
}

static void test_lifecycle_service(void **state) {
    (void)state;
    static const method_sig t[] = {
        {"SendMessage", &upsquad__runtime__v1__send_message_request__descriptor,
         &upsquad__runtime__v1__agent_event__descriptor},
        {"CreateSession", &upsquad__runtime__v1__create_session_request__descriptor,
         &upsquad__runtime__v1__create_session_response__descriptor},
        {"GetSession", &upsquad__runtime__v1__get_session_request__descriptor,
         &upsquad__runtime__v1__get_session_response__descriptor},
        {"ListSessions", &upsquad__runtime__v1__list_sessions_request__descriptor,
         &upsquad__runtime__v1__list_sessions_response__descriptor},
        {"TerminateSession", &upsquad__runtime__v1__terminate_lifecycle_session_request__descriptor,
         &upsquad__runtime__v1__terminate_lifecycle_session_response__descriptor},
        {"GetProvenanceChain", &upsquad__runtime__v1__get_provenance_chain_request__descriptor,
         &upsquad__runtime__v1__get_provenance_chain_response__descriptor},
        {"PauseSession", &upsquad__runtime__v1__pause_session_request__descriptor,
         &upsquad__runtime__v1__pause_session_response__descriptor},
        {"ResumeSession", &upsquad__runtime__v1__resume_session_request__descriptor,
         &upsquad__runtime__v1__resume_session_response__descriptor},
        {"ListChildren", &upsquad__runtime__v1__list_children_request__descriptor,
         &upsquad__runtime__v1__list_children_response__descriptor},
        {"GetParentSession", &upsquad__runtime__v1__get_parent_session_request__descriptor,
         &upsquad__runtime__v1__get_parent_session_response__descriptor},
        {"GetSubagentTree", &upsquad__runtime__v1__get_subagent_tree_request__descriptor,
         &upsquad__runtime__v1__get_subagent_tree_response__descriptor},
        {"TerminateSubagentTree",
         &upsquad__runtime__v1__terminate_subagent_tree_request__descriptor,
         &upsquad__runtime__v1__terminate_subagent_tree_response__descriptor},
    };
    check_service(&upsquad__runtime__v1__lifecycle_service__descriptor,
                  "upsquad.runtime.v1.LifecycleService", t, N_ELEMS(t));
}

/* ---- model.proto ---- */

static void test_model_registry_service(void **state) {
    (void)state;
    static const method_sig t[] = {
        {"ListModels", &upsquad__runtime__v1__list_models_request__descriptor,
         &upsquad__runtime__v1__list_models_response__descriptor},
        {"GetModelRecommendation",
         &upsquad__runtime__v1__get_model_recommendation_request__descriptor,
         &upsquad__runtime__v1__get_model_recommendation_response__descriptor},
        {"CompareModels", &upsquad__runtime__v1__compare_models_request__descriptor,
         &upsquad__runtime__v1__compare_models_response__descriptor},
    };
    check_service(&upsquad__runtime__v1__model_registry_service__descriptor,
                  "upsquad.runtime.v1.ModelRegistryService", t, N_ELEMS(t));
}

/* ---- workflow.proto ---- */

static void test_workflow_numbers(void **state) {
    (void)state;
    /* "NodeStatusUpdate.blocked_by (field 6 of that message)", "NodeStatusUpdate.iteration
     * (field 8)", "approval_id, field 12" (WorkflowAction). */
    static const field_num status[] = {{"blocked_by", 6}, {"iteration", 8}};
    static const field_num action[] = {{"approval_id", 12}};
    check_numbers(&upsquad__workflow__v1__node_status_update__descriptor, status, N_ELEMS(status));
    check_numbers(&upsquad__workflow__v1__workflow_action__descriptor, action, N_ELEMS(action));

    Upsquad__Workflow__V1__NodeStatusUpdate up = UPSQUAD__WORKFLOW__V1__NODE_STATUS_UPDATE__INIT;
    up.blocked_by = "b";
    up.iteration = 3;
    static const uint8_t up_bytes[] = {(6 << 3) | 2, 1, 'b', (8 << 3) | 0, 3};
    check_packed(&up.base, up_bytes, sizeof up_bytes);

    Upsquad__Workflow__V1__WorkflowAction act = UPSQUAD__WORKFLOW__V1__WORKFLOW_ACTION__INIT;
    act.approval_id = "a";
    static const uint8_t act_bytes[] = {(12 << 3) | 2, 1, 'a'};
    check_packed(&act.base, act_bytes, sizeof act_bytes);
}

static void test_workflow_oneofs(void **state) {
    (void)state;
    /* NodeIOFrame: "Exactly one event arm is set"; the frame's identity fields stay outside. */
    static const field_num frame_arms[] = {
        {"token_text", 5}, {"tool_call", 6}, {"tool_result", 7}, {"status", 8}, {"user_prompt", 9},
    };
    const ProtobufCMessageDescriptor *f = &upsquad__workflow__v1__node_ioframe__descriptor;
    check_oneof(f, offsetof(Upsquad__Workflow__V1__NodeIOFrame, event_case), frame_arms,
                N_ELEMS(frame_arms));
    check_not_in_oneof(f, "node_id");
    check_not_in_oneof(f, "seq");

    /* StreamNodeIOResponse: "Exactly one of the oneof arms is set". */
    static const field_num resp_arms[] = {
        {"snapshot_event", 1},
        {"live", 2},
        {"gap", 3},
        {"snapshot_done", 4},
    };
    check_oneof(&upsquad__workflow__v1__stream_node_ioresponse__descriptor,
                offsetof(Upsquad__Workflow__V1__StreamNodeIOResponse, frame_case), resp_arms,
                N_ELEMS(resp_arms));
}

/* open_prompt_count is proto3 `optional` (EXPLICIT PRESENCE): written as a one-field oneof, a
 * present 0 must go on the wire and an absent one must not. */
static void test_open_prompt_count_presence(void **state) {
    (void)state;
    static const field_num ev_num[] = {{"open_prompt_count", 16}};
    static const field_num row_num[] = {{"open_prompt_count", 5}};
    check_oneof(&upsquad__workflow__v1__visible_run_event__descriptor,
                offsetof(Upsquad__Workflow__V1__VisibleRunEvent, _open_prompt_count_case), ev_num,
                1);
    check_oneof(&upsquad__workflow__v1__visible_run_row__descriptor,
                offsetof(Upsquad__Workflow__V1__VisibleRunRow, _open_prompt_count_case), row_num,
                1);
    check_not_in_oneof(&upsquad__workflow__v1__visible_run_event__descriptor, "is_waiting");

    Upsquad__Workflow__V1__VisibleRunEvent ev = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
    assert_int_equal(protobuf_c_message_get_packed_size(&ev.base), 0);
    ev._open_prompt_count_case =
        UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT___OPEN_PROMPT_COUNT_OPEN_PROMPT_COUNT;
    ev.open_prompt_count = 0;
    static const uint8_t zero[] = {0x80, 0x01, 0x00}; /* varint tag (16 << 3) | 0, value 0 */
    check_packed(&ev.base, zero, sizeof zero);

    Upsquad__Workflow__V1__VisibleRunEvent *got =
        upsquad__workflow__v1__visible_run_event__unpack(NULL, sizeof zero, zero);
    assert_non_null(got);
    assert_int_equal(
        got->_open_prompt_count_case,
        UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT___OPEN_PROMPT_COUNT_OPEN_PROMPT_COUNT);
    assert_int_equal(got->open_prompt_count, 0);
    upsquad__workflow__v1__visible_run_event__free_unpacked(got, NULL);

    static const uint8_t other[] = {0x90, 0x01, 1}; /* is_waiting (18) = true, nothing else */
    got = upsquad__workflow__v1__visible_run_event__unpack(NULL, sizeof other, other);
    assert_non_null(got);
    assert_int_equal(got->_open_prompt_count_case,
                     UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT___OPEN_PROMPT_COUNT__NOT_SET);
    assert_true(got->is_waiting);
    upsquad__workflow__v1__visible_run_event__free_unpacked(got, NULL);
}

static void test_workflow_enums(void **state) {
    (void)state;
    static const enum_num kind[] = {
        {"RUN_PROMPT_KIND_UNSPECIFIED", 0},
        {"RUN_PROMPT_KIND_USER_PROMPT", 1},
        {"RUN_PROMPT_KIND_APPROVAL_GATE", 2},
        {"RUN_PROMPT_KIND_QUESTION_GATE", 3},
    };
    static const enum_num filter[] = {
        {"RUN_STATUS_FILTER_UNSPECIFIED", 0}, {"RUN_STATUS_FILTER_ACTIVE", 1},
        {"RUN_STATUS_FILTER_COMPLETED", 2},   {"RUN_STATUS_FILTER_FAILED", 3},
        {"RUN_STATUS_FILTER_ALL", 4},
    };
    check_enum(&upsquad__workflow__v1__run_prompt_kind__descriptor, kind, N_ELEMS(kind));
    check_enum(&upsquad__workflow__v1__run_status_filter__descriptor, filter, N_ELEMS(filter));
}

#define WF(m, req, resp)                                                                           \
    { m, &upsquad__workflow__v1__##req##__descriptor, &upsquad__workflow__v1__##resp##__descriptor }

static void test_workflow_service(void **state) {
    (void)state;
    /* The document's table order, with CancelRun (named by the prose, left out of the table)
     * placed next to PauseRun. */
    static const method_sig t[] = {
        WF("CreateWorkflow", create_workflow_request, create_workflow_response),
        WF("GetWorkflow", get_workflow_request, get_workflow_response),
        WF("ListWorkflows", list_workflows_request, list_workflows_response),
        WF("TriggerWorkflow", trigger_workflow_request, trigger_workflow_response),
        WF("GetWorkflowStatus", get_workflow_status_request, get_workflow_status_response),
        WF("ApproveAction", approve_action_request, approve_action_response),
        WF("RejectAction", reject_action_request, reject_action_response),
        WF("EscalateAction", escalate_action_request, escalate_action_response),
        WF("ListPendingApprovals", list_pending_approvals_request, list_pending_approvals_response),
        WF("StreamRunStatus", stream_run_status_request, stream_run_status_response),
        WF("StreamRunLogs", stream_run_logs_request, stream_run_logs_response),
        WF("GetNodeIO", get_node_iorequest, get_node_ioresponse),
        WF("GetNodeTranscript", get_node_transcript_request, get_node_transcript_response),
        WF("StreamNodeIO", stream_node_iorequest, stream_node_ioresponse),
        WF("PauseRun", pause_run_request, pause_run_response),
        WF("CancelRun", cancel_run_request, cancel_run_response),
        WF("ResumeRun", resume_run_request, resume_run_response),
        WF("ListRuns", list_runs_request, list_runs_response),
        WF("UpdateWorkflowStatus", update_workflow_status_request, update_workflow_status_response),
        WF("SetWorkflowEnabled", set_workflow_enabled_request, set_workflow_enabled_response),
        WF("UpdateWorkflowDefinition", update_workflow_definition_request,
           update_workflow_definition_response),
        WF("DeleteWorkflow", delete_workflow_request, delete_workflow_response),
        WF("GetToolCatalog", get_tool_catalog_request, get_tool_catalog_response),
        WF("GetRunPrompt", get_run_prompt_request, get_run_prompt_response),
        WF("AnswerRunPrompt", answer_run_prompt_request, answer_run_prompt_response),
        WF("DeliverWorkflowEvent", deliver_workflow_event_request, deliver_workflow_event_response),
        WF("ListVisibleRuns", list_visible_runs_request, list_visible_runs_response),
        WF("StreamVisibleRuns", stream_visible_runs_request, visible_run_event),
    };
    const ProtobufCServiceDescriptor *sd = &upsquad__workflow__v1__workflow_service__descriptor;
    check_service(sd, "upsquad.workflow.v1.WorkflowService", t, N_ELEMS(t));
    assert_null(protobuf_c_service_descriptor_get_method_by_name(sd, "CancelWorkflow"));
    /* CancelRun's request names the run; its response carries the run back. */
    const ProtobufCMessageDescriptor *req = &upsquad__workflow__v1__cancel_run_request__descriptor;
    assert_int_equal(must_field(req, "run_id")->id, 1);
    assert_int_equal(must_field(req, "reason")->id, 2);
    assert_ptr_equal(
        must_field(&upsquad__workflow__v1__cancel_run_response__descriptor, "run")->descriptor,
        &upsquad__workflow__v1__workflow_run__descriptor);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_execute_step_event_arms),
        cmocka_unit_test(test_execute_step_request_numbers),
        cmocka_unit_test(test_session_snapshot_maps),
        cmocka_unit_test(test_runtime_enums),
        cmocka_unit_test(test_runtime_wire_tags),
        cmocka_unit_test(test_runtime_service),
        cmocka_unit_test(test_agent_event_arms),
        cmocka_unit_test(test_lifecycle_service),
        cmocka_unit_test(test_model_registry_service),
        cmocka_unit_test(test_workflow_numbers),
        cmocka_unit_test(test_workflow_oneofs),
        cmocka_unit_test(test_open_prompt_count_presence),
        cmocka_unit_test(test_workflow_enums),
        cmocka_unit_test(test_workflow_service),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Agent definitions (the JSON documents `upsquad-agents apply` provisions) and the session
 * snapshot frozen from them.
 *
 * Document (docs/orchestrator.md, "Agent definitions"): an object with `role`, `display_name`,
 * `model` (required) and optional `id`, `fallback_chain`, `temperature`, `max_tokens`,
 * `persona`, `tools`, `guardrail_hashes`, `rbac_grants`, `max_loops`, `execution_mode`,
 * `runtime`, `llm_base_url`, `context_engine_address`, `mcp_servers`, `security_config`,
 * `tool_policies`, `approval_clearance`.
 * Unknown members are refused; every error names its JSON pointer.
 *
 * snapshot_hash: SHA-256 (lowercase hex) over the canonical encoding written in
 * docs/orchestrator.md ("The snapshot and its hash"): every SessionSnapshot field in
 * field-number order, except the session's identity (1 session_id, 2 tenant_id), snapshot_hash
 * itself (11), org_version_seq (19) and mcp_servers (20). */
#ifndef UPSQUAD_ORCH_AGENTDEF_H
#define UPSQUAD_ORCH_AGENTDEF_H

#include <cjson/cJSON.h>
#include <stddef.h>

#include "arena.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"

typedef Upsquad__Runtime__V1__SessionSnapshot SessionSnapshot;

#define AGENTDEF_PERSONA_MAX 32768
#define AGENTDEF_LIST_MAX 128
#define AGENTDEF_ITEM_MAX 256

/* Validates `doc` (borrowed). 0, or -1 with err naming the pointer ("/temperature: ..."). */
int agentdef_validate(const cJSON *doc, char *err, size_t errlen);

/* The agent id of a document: its `id`, or the UUID derived from sha256("upsquad-agent:" org
 * ":" role) when it has none (so re-applying a file is stable). out: 37 bytes. */
void agentdef_id(const cJSON *doc, const char *org_id, char out[37]);

/* 1..3 for the document's execution_mode ("single_turn", "multi_turn", "autonomous"); 1 when
 * absent. */
int agentdef_mode(const cJSON *doc);

/* Freezes a snapshot from a validated document. Strings and arrays live in `a`; the snapshot
 * itself too. model_override: NULL/"" keeps the document's model. mode: 0 keeps the agent's
 * default. The hash is computed and set. NULL on OOM. */
SessionSnapshot *agentdef_freeze(orch_arena *a, const cJSON *doc, const char *session_id,
                                 const char *org_id, const char *agent_id,
                                 const char *model_override, int mode);

/* The clearance (1..5) a member needs to decide a gated call of `tool` (approvals and
 * prompts opened for this agent): the tool's `tool_policies.<tool>.required_clearance`, else
 * the agent's `approval_clearance`, else AGENTDEF_CLEARANCE_DEFAULT — never 0: a gate whose
 * policy names no clearance fails closed to the highest tier. doc: a validated document. */
#define AGENTDEF_CLEARANCE_DEFAULT 5
int agentdef_tool_clearance(const cJSON *doc, const char *tool);
/* A tool's policy read from a stored definition (JSON text; unreadable: the defaults):
 * clearance as agentdef_tool_clearance, whether the policy names one itself, and whether it
 * asks an approval (tool_policies.<tool>.requires_approval: the orchestrator asks one itself
 * before a call it serves, delegate_to_agent; the worker gates the tools it runs). */
typedef struct agentdef_policy {
    int clearance;
    int names_clearance;
    int requires_approval;
} agentdef_policy;
void agentdef_tool_policy(const char *definition, const char *tool, agentdef_policy *out);

/* Canonical encoding (heap, caller frees) and hash of a snapshot. */
int agentdef_canonical(const SessionSnapshot *s, unsigned char **out, size_t *len);
int agentdef_hash(const SessionSnapshot *s, char out[65]);

#endif

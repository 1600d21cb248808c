/* The bus contract, written down once: every NATS subject, JetStream stream, retention and
 * durable consumer the services share. Message types live in proto/upsquad/internal/v1/ (and
 * the spec's own messages where one fits); publisher and consumer include the same header.
 *
 *  subject                        from -> to                   message; kind / stream
 *  agent.step.dispatch            workflow-engine -> orch.     AgentStepDispatch; JetStream
 *                                                              AGENT_STEPS (work queue),
 *                                                              Nats-Msg-Id = idempotency key
 *  agent.step.result.<org>.<run>  orchestrator -> engine       AgentStepResult; AGENT_RESULTS
 *  agent.step.cancel.<org>.<run>  workflow-engine -> orch.     AgentStepCancel; AGENT_CANCELS,
 *                                                              an ordered consumer per replica
 *  wf.status.<org>.<run>          workflow-engine -> hub       RunEvent; WF_EVENTS
 *  wf.log.<org>.<run>             workflow-engine -> hub       RunEvent; WF_EVENTS
 *  wfio.<org>.<run>               orchestrator -> stream-hub   NodeIOEvent; WFIO
 *  wfio.<org>.<run>               workflow-engine -> hub       NodeIOEvent, user_prompt frame
 *                                                              (outbox; session = prompt id)
 *  session.event.<org>.<session>  orchestrator -> replicas     core NATS (live relay)
 *  tool.invoke.<tool>             workflow-engine -> provider  ToolInvokeRequest; core req/reply
 *  tool.announce                  providers -> engine          ToolAnnounce; core NATS
 *  approval.decided.<org>         workflow-engine -> parked    core NATS + APPROVALS
 *
 * Live readers (stream-hub's fan-out) subscribe to the same subjects on core NATS: a JetStream
 * publish is also delivered to core subscribers, so live frames cost one publish. Durable
 * readers (the hub's projection writer, the engine's result consumer, the orchestrator's
 * dispatch consumer) use the durable pull consumers below; replicas bind the same durable and
 * share the work.
 *
 * Tokens <org>, <run>, <session> are UUIDs (bus_token_valid holds for them). */
#ifndef UPSQUAD_SUBJECTS_H
#define UPSQUAD_SUBJECTS_H

/* ---- subjects (prefixes; build full subjects with bus_subject) ---- */
#define SUBJ_AGENT_STEP_DISPATCH "agent.step.dispatch"
#define SUBJ_AGENT_STEP_RESULT "agent.step.result" /* .<org>.<run> */
#define SUBJ_AGENT_STEP_CANCEL "agent.step.cancel" /* .<org>.<run> */
#define SUBJ_WF_STATUS "wf.status"                 /* .<org>.<run> */
#define SUBJ_WF_LOG "wf.log"                       /* .<org>.<run> */
#define SUBJ_WFIO "wfio"                           /* .<org>.<run> */
#define SUBJ_SESSION_EVENT "session.event"         /* .<org>.<session> */
#define SUBJ_TOOL_INVOKE "tool.invoke"             /* .<tool> */
#define SUBJ_TOOL_BATCH "tool.batch"               /* .<tool>: many calls in one request */
#define SUBJ_TOOL_ANNOUNCE "tool.announce"
#define SUBJ_APPROVAL_DECIDED "approval.decided" /* .<org> */

/* ---- JetStream streams: name, subjects, retention, age; sizes in bus_stream_limits ---- */

/* Work queue of agent steps: a message is removed when the orchestrator acks it. Bounded by
 * age (a step nobody took in a day is stale: the engine's timer fails it first) and bytes;
 * full => publish refused, the engine's outbox retries (nothing is lost). */
#define STREAM_AGENT_STEPS "AGENT_STEPS"
#define STREAM_AGENT_STEPS_SUBJECTS "agent.step.dispatch"
#define STREAM_AGENT_STEPS_MAX_AGE_S (24 * 3600)
#define DURABLE_AGENT_STEPS "orchestrator-steps"

/* Step outcomes, a work queue consumed by the engine replicas. */
#define STREAM_AGENT_RESULTS "AGENT_RESULTS"
#define STREAM_AGENT_RESULTS_SUBJECTS "agent.step.result.>"
#define STREAM_AGENT_RESULTS_MAX_AGE_S (7 * 24 * 3600)
#define DURABLE_AGENT_RESULTS "workflow-engine-results"

/* Cancellations of dispatched agent steps. The engine publishes them through its outbox (so a
 * cancel is never lost); every orchestrator replica reads all of them through an ordered
 * consumer (a fan-out: the replica running the attempt must see it; it resumes after a
 * reconnect), from the oldest the stream keeps (an hour). */
#define STREAM_AGENT_CANCELS "AGENT_CANCELS"
#define STREAM_AGENT_CANCELS_SUBJECTS "agent.step.cancel.>"
#define STREAM_AGENT_CANCELS_MAX_AGE_S 3600

/* Run status and log events, kept for replay (limits: the oldest go first when full). */
#define STREAM_WF_EVENTS "WF_EVENTS"
#define STREAM_WF_EVENTS_SUBJECT_STATUS "wf.status.>"
#define STREAM_WF_EVENTS_SUBJECT_LOG "wf.log.>"
#define STREAM_WF_EVENTS_MAX_AGE_S (7 * 24 * 3600)
#define DURABLE_HUB_PROJECTION "stream-hub-projection"

/* Live node I/O of agent steps (limits, shorter: transcripts are captured by the hub). */
#define STREAM_WFIO "WFIO"
#define STREAM_WFIO_SUBJECTS "wfio.>"
#define STREAM_WFIO_MAX_AGE_S (24 * 3600)
#define DURABLE_HUB_TRANSCRIPTS "stream-hub-transcripts"

/* Decisions on approvals, for whoever parked on them (a run, a session). */
#define STREAM_APPROVALS "APPROVALS"
#define STREAM_APPROVALS_SUBJECTS "approval.decided.>"
#define STREAM_APPROVALS_MAX_AGE_S (7 * 24 * 3600)

#endif

/* hub-publisher: publishes the workflow-engine's RunEvents and the orchestrator's NodeIOEvents
 * as they appear on the bus (proto/upsquad/internal/v1/, libcommon/subjects.h), for the
 * stream-hub tests and benchmark.
 *
 *   hub-publisher NATS_URL      reads one JSON command per line on stdin, answers "ok" (or
 *                               "error: ...") per line on stdout.
 *
 * Commands ("op"):
 *   run   {org, run, seq, status, nodes_total, nodes_done, workflow_id, workflow_name, team,
 *          visibility, owner, display_name, workflow_deleted} -> wf.status.<org>.<run> (JetStream)
 *   node  {... scope as run, seq, node_id, step, status, run_status, iteration, blocked_by,
 *          elapsed_ms, cost_usd, at_ms_ago (the transition's `at` that long before now),
 *          raw_status, needs_input, needs_approval, prompt_id, is_waiting} -> wf.status (JS)
 *   log   {... scope, seq, node_id, level, message}           -> wf.log.<org>.<run> (JetStream)
 *         run, node and log take "repeat": N (N events, seq, seq+1, ...) and "batch": K (those
 *         events K per message, a RunEventBatch, as the engine's outbox relay sends them: on
 *         wf.status, or wf.log when all are log lines; message id "<run>:<first seq>+<count>")
 *   io    {org, run, node, session, seq, iteration, token | status | tool_call {name, id, args} |
 *          tool_result {name, id, summary, is_error, duration_ms},
 *          transcript {event_type, content}}                  -> wfio.<org>.<run> (core: the
 *          WFIO stream captures it too)
 *   tokens {org, run, node, session, from, count, size, rate}  count token frames, each
 *          token_text = "<publish time in ns>|" padded to size bytes; rate frames/s (0 = as
 *          fast as possible). Answers "ok <seconds taken>". "nodes": [names] instead of
 *          node: frame i goes to nodes[i % n] (a name may repeat: its share), session
 *          "<session>-<node>", seq from `from` counted per node (interleaved steps).
 *   flush {}                                                  waits for the server
 *   sleep {ms}
 * Run events carry Nats-Msg-Id "<run>:<seq>", as the engine's outbox relay does. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bus.h"
#include "pbjson.h"
#include "upsquad/internal/v1/node_io.pb-c.h"
#include "upsquad/internal/v1/run_events.pb-c.h"

static bus *B;

static const char *str(const cJSON *o, const char *k, const char *def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : def;
}

static double num(const cJSON *o, const char *k, double def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : def;
}

static int flag(const cJSON *o, const char *k) {
    return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, k));
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The batch being built ("batch": K): the events' packed bytes, unpacked again into the
 * RunEventBatch, so the framing is protobuf-c's, not the engine's. */
typedef struct pending_batch {
    Upsquad__Internal__V1__RunEvent *ev[1024];
    int n, status; /* events; one of them is a node or run transition */
    char run[64];
    long long seq0;
} pending_batch;

static pending_batch PB;

static int batch_flush(char *err, size_t errlen) {
    if (PB.n == 0) return 0;
    Upsquad__Internal__V1__RunEventBatch b = UPSQUAD__INTERNAL__V1__RUN_EVENT_BATCH__INIT;
    b.n_events = (size_t)PB.n;
    b.events = PB.ev;
    char subj[256], msgid[160];
    const Upsquad__Internal__V1__RunScope *sc = PB.ev[0]->scope;
    int rc = bus_subject(subj, sizeof subj, "wf", PB.status ? "status" : "log", sc->org_id,
                         sc->run_id, NULL);
    size_t n = protobuf_c_message_get_packed_size(&b.base);
    uint8_t *buf = rc == BUS_OK ? malloc(n ? n : 1) : NULL;
    if (buf) {
        protobuf_c_message_pack(&b.base, buf);
        snprintf(msgid, sizeof msgid, "%s:%lld+%d", sc->run_id, PB.seq0, PB.n);
        rc = bus_js_publish(B, subj, buf, (int)n, msgid, NULL, err, errlen);
    } else {
        snprintf(err, errlen, "bad org or run, or out of memory");
        rc = -1;
    }
    free(buf);
    for (int i = 0; i < PB.n; i++)
        upsquad__internal__v1__run_event__free_unpacked(PB.ev[i], NULL);
    PB.n = PB.status = 0;
    return rc == BUS_OK ? 0 : -1;
}

static int publish_run_event(const cJSON *c, const char *op, char *err, size_t errlen) {
    Upsquad__Internal__V1__RunEvent ev = UPSQUAD__INTERNAL__V1__RUN_EVENT__INIT;
    Upsquad__Internal__V1__RunScope sc = UPSQUAD__INTERNAL__V1__RUN_SCOPE__INIT;
    Upsquad__Internal__V1__NodeTransition nt = UPSQUAD__INTERNAL__V1__NODE_TRANSITION__INIT;
    Upsquad__Internal__V1__RunTransition rt = UPSQUAD__INTERNAL__V1__RUN_TRANSITION__INIT;
    Upsquad__Workflow__V1__NodeStatusUpdate up = UPSQUAD__WORKFLOW__V1__NODE_STATUS_UPDATE__INIT;
    Upsquad__Workflow__V1__RunLogLine ll = UPSQUAD__WORKFLOW__V1__RUN_LOG_LINE__INIT;
    Google__Protobuf__Timestamp at = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    char subj[256], msgid[160];
    pbjson_ts_now(&at);
    sc.org_id = (char *)str(c, "org", "");
    sc.run_id = (char *)str(c, "run", "");
    sc.workflow_id = (char *)str(c, "workflow_id", "");
    sc.workflow_name = (char *)str(c, "workflow_name", "");
    sc.team_id = (char *)str(c, "team", "");
    sc.visibility = (char *)str(c, "visibility", "team");
    sc.owner_id = (char *)str(c, "owner", "");
    sc.display_name = (char *)str(c, "display_name", "");
    sc.workflow_deleted = flag(c, "workflow_deleted");
    ev.scope = &sc;
    ev.seq = (int64_t)num(c, "seq", 0);
    ev.at = &at;
    const char *kind = "status";
    if (strcmp(op, "run") == 0) {
        rt.status = (char *)str(c, "status", "running");
        rt.nodes_total = (int)num(c, "nodes_total", 0);
        rt.nodes_done = (int)num(c, "nodes_done", 0);
        ev.event_case = UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_RUN;
        ev.run = &rt;
    } else if (strcmp(op, "node") == 0) {
        up.run_id = sc.run_id;
        up.node_id = (char *)str(c, "node_id", "");
        up.status = (char *)str(c, "status", "running");
        up.blocked_by = (char *)str(c, "blocked_by", "");
        up.iteration = (int)num(c, "iteration", 0);
        up.elapsed_ms = (int64_t)num(c, "elapsed_ms", 0);
        up.cost_usd = num(c, "cost_usd", 0);
        /* at_ms_ago: a transition that happened that long before it is published */
        int64_t ago = (int64_t)num(c, "at_ms_ago", 0);
        if (ago > 0) pbjson_ts_from_ms(&at, now_ns() / 1000000 - ago);
        up.at = &at;
        nt.update = &up;
        nt.step_name = (char *)str(c, "step", "");
        nt.raw_status = (char *)str(c, "raw_status", "");
        nt.run_status = (char *)str(c, "run_status", "");
        nt.needs_input = flag(c, "needs_input");
        nt.needs_approval = flag(c, "needs_approval");
        nt.prompt_id = (char *)str(c, "prompt_id", "");
        nt.is_waiting = flag(c, "is_waiting");
        ev.event_case = UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_NODE;
        ev.node = &nt;
    } else {
        ll.run_id = sc.run_id;
        ll.node_id = (char *)str(c, "node_id", "");
        ll.level = (char *)str(c, "level", "INFO");
        ll.message = (char *)str(c, "message", "");
        ll.t = &at;
        ev.event_case = UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_LOG;
        ev.log = &ll;
        kind = "log";
    }
    if (bus_subject(subj, sizeof subj, "wf", kind, sc.org_id, sc.run_id, NULL) != BUS_OK) {
        snprintf(err, errlen, "bad org or run");
        return -1;
    }
    size_t n = protobuf_c_message_get_packed_size(&ev.base);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return -1;
    protobuf_c_message_pack(&ev.base, buf);
    if (num(c, "batch", 0) >= 1) { /* into the batch; batch_flush publishes it */
        if (PB.n == 0) PB.seq0 = (long long)ev.seq;
        PB.ev[PB.n] = upsquad__internal__v1__run_event__unpack(NULL, n, buf);
        free(buf);
        if (!PB.ev[PB.n]) return snprintf(err, errlen, "out of memory"), -1;
        PB.status |= strcmp(kind, "log") != 0;
        PB.n++;
        return 0;
    }
    snprintf(msgid, sizeof msgid, "%s:%lld", sc.run_id, (long long)ev.seq);
    int rc = bus_js_publish(B, subj, buf, (int)n, msgid, NULL, err, errlen);
    free(buf);
    return rc == BUS_OK ? 0 : -1;
}

static int publish_io(const cJSON *c, const char *token_override, char *err, size_t errlen) {
    Upsquad__Internal__V1__NodeIOEvent ev = UPSQUAD__INTERNAL__V1__NODE_IOEVENT__INIT;
    Upsquad__Workflow__V1__NodeIOFrame fr = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__INIT;
    Upsquad__Workflow__V1__NodeToolCall tc = UPSQUAD__WORKFLOW__V1__NODE_TOOL_CALL__INIT;
    Upsquad__Workflow__V1__NodeToolResult tr = UPSQUAD__WORKFLOW__V1__NODE_TOOL_RESULT__INIT;
    Upsquad__Workflow__V1__TranscriptEvent te = UPSQUAD__WORKFLOW__V1__TRANSCRIPT_EVENT__INIT;
    Google__Protobuf__Timestamp at = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    Google__Protobuf__Struct *content = NULL;
    char subj[256];
    int rc = -1;
    ev.org_id = (char *)str(c, "org", "");
    ev.run_id = (char *)str(c, "run", "");
    ev.step_name = (char *)str(c, "node", "");
    ev.action_id = (char *)str(c, "action_id", "");
    ev.iteration = (int)num(c, "iteration", 0);
    fr.node_id = ev.step_name;
    fr.session_id = (char *)str(c, "session", "");
    fr.seq = (int64_t)num(c, "seq", 0);
    fr.iteration = ev.iteration;
    const cJSON *x;
    if (token_override || str(c, "token", NULL)) {
        fr.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOKEN_TEXT;
        fr.token_text = (char *)(token_override ? token_override : str(c, "token", ""));
    } else if (str(c, "status", NULL)) {
        fr.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_STATUS;
        fr.status = (char *)str(c, "status", "");
    } else if ((x = cJSON_GetObjectItemCaseSensitive(c, "tool_call"))) {
        tc.tool_name = (char *)str(x, "name", "");
        tc.tool_call_id = (char *)str(x, "id", "");
        tc.args_summary = (char *)str(x, "args", "");
        fr.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOOL_CALL;
        fr.tool_call = &tc;
    } else if ((x = cJSON_GetObjectItemCaseSensitive(c, "tool_result"))) {
        tr.tool_name = (char *)str(x, "name", "");
        tr.tool_call_id = (char *)str(x, "id", "");
        tr.summary = (char *)str(x, "summary", "");
        tr.is_error = flag(x, "is_error");
        tr.duration_ms = (int)num(x, "duration_ms", 0);
        fr.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOOL_RESULT;
        fr.tool_result = &tr;
    }
    if (!flag(c, "no_frame")) ev.frame = &fr;
    if ((x = cJSON_GetObjectItemCaseSensitive(c, "transcript"))) {
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(x, "content");
        if (ct && pbjson_struct_from_json(ct, &content, err, errlen) != 0) goto done;
        pbjson_ts_now(&at);
        te.session_id = fr.session_id;
        te.seq = (int32_t)fr.seq;
        te.event_type = (char *)str(x, "event_type", "assistant_message");
        te.content = content;
        te.created_at = &at;
        ev.transcript = &te;
    }
    if (bus_subject(subj, sizeof subj, "wfio", ev.org_id, ev.run_id, NULL) != BUS_OK) {
        snprintf(err, errlen, "bad org or run");
        goto done;
    }
    size_t n = protobuf_c_message_get_packed_size(&ev.base);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) goto done;
    protobuf_c_message_pack(&ev.base, buf);
    rc = bus_publish(B, subj, buf, (int)n) == BUS_OK ? 0 : -1;
    if (rc) snprintf(err, errlen, "publish failed");
    free(buf);
done:
    if (content) pbjson_struct_free(content);
    return rc;
}

static const char *item_str(const cJSON *array, int i) {
    const cJSON *v = cJSON_GetArrayItem(array, i);
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* Token frames at a steady rate, each stamped with its publish time (latency probes). */
static int publish_tokens(cJSON *c, double *secs, char *err, size_t errlen) {
    long from = (long)num(c, "from", 1), count = (long)num(c, "count", 1);
    size_t size = (size_t)num(c, "size", 64);
    double rate = num(c, "rate", 0);
    const cJSON *nodes = cJSON_GetObjectItemCaseSensitive(c, "nodes");
    int nn = cJSON_IsArray(nodes) ? cJSON_GetArraySize(nodes) : 0;
    char session[128];
    snprintf(session, sizeof session, "%s", str(c, "session", ""));
    long *sent = nn ? calloc((size_t)nn, sizeof *sent) : NULL; /* per node (first index) */
    char *tok = malloc(size + 32);
    if (!tok || (nn && !sent)) {
        free(tok);
        free(sent);
        return -1;
    }
    int64_t t0 = now_ns();
    for (long i = 0; i < count; i++) {
        long seq = from + i;
        if (nn) { /* this frame's node: its session, and its own count as the seq */
            const char *name = item_str(nodes, (int)(i % nn));
            int first = 0;
            while (strcmp(item_str(nodes, first), name) != 0)
                first++;
            seq = from + sent[first]++;
            char sess[300];
            snprintf(sess, sizeof sess, "%s-%s", session, name);
            cJSON_DeleteItemFromObjectCaseSensitive(c, "node");
            cJSON_AddStringToObject(c, "node", name);
            cJSON_DeleteItemFromObjectCaseSensitive(c, "session");
            cJSON_AddStringToObject(c, "session", sess);
        }
        if (rate > 0) {
            int64_t due = t0 + (int64_t)((double)i * 1e9 / rate);
            int64_t wait = due - now_ns();
            if (wait > 0) {
                struct timespec ts = {wait / 1000000000LL, wait % 1000000000LL};
                nanosleep(&ts, NULL);
            }
        }
        int k = snprintf(tok, size + 32, "%lld|", (long long)now_ns());
        while ((size_t)k < size)
            tok[k++] = 'x';
        tok[k] = 0;
        cJSON_DeleteItemFromObjectCaseSensitive(c, "seq");
        cJSON_AddNumberToObject(c, "seq", (double)seq);
        if (publish_io(c, tok, err, errlen)) {
            free(tok);
            free(sent);
            return -1;
        }
    }
    bus_flush(B, 10000);
    *secs = (double)(now_ns() - t0) / 1e9;
    free(tok);
    free(sent);
    return 0;
}

int main(int argc, char **argv) {
    char err[512], line[1 << 16];
    if (argc < 2) {
        fprintf(stderr, "usage: hub-publisher NATS_URL < commands\n");
        return 2;
    }
    if (bus_connect(argv[1], "hub-publisher", &B, err, sizeof err) != BUS_OK) {
        fprintf(stderr, "hub-publisher: %s\n", err);
        return 1;
    }
    while (fgets(line, sizeof line, stdin)) {
        cJSON *c = cJSON_Parse(line);
        const char *op = c ? str(c, "op", "") : "";
        int rc = 0;
        double secs = -1;
        err[0] = 0;
        if (!c) {
            if (strspn(line, " \t\r\n") == strlen(line)) continue;
            rc = -1;
            snprintf(err, sizeof err, "not JSON");
        } else if (!strcmp(op, "run") || !strcmp(op, "node") || !strcmp(op, "log")) {
            /* "repeat": N events with seq, seq+1, ... (bursts without a round trip each) */
            long n = (long)num(c, "repeat", 1), seq0 = (long)num(c, "seq", 0);
            long k = (long)num(c, "batch", 0);
            if (k > 1024) k = 1024;
            for (long i = 0; i < n && rc == 0; i++) {
                cJSON_DeleteItemFromObjectCaseSensitive(c, "seq");
                cJSON_AddNumberToObject(c, "seq", (double)(seq0 + i));
                rc = publish_run_event(c, op, err, sizeof err);
                if (rc == 0 && k >= 1 && (PB.n == k || i + 1 == n))
                    rc = batch_flush(err, sizeof err);
            }
        } else if (!strcmp(op, "io")) {
            rc = publish_io(c, NULL, err, sizeof err);
        } else if (!strcmp(op, "tokens")) {
            rc = publish_tokens(c, &secs, err, sizeof err);
        } else if (!strcmp(op, "flush")) {
            rc = bus_flush(B, 10000) == BUS_OK ? 0 : -1;
        } else if (!strcmp(op, "sleep")) {
            long ms = (long)num(c, "ms", 0);
            struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        } else {
            rc = -1;
            snprintf(err, sizeof err, "unknown op \"%s\"", op);
        }
        cJSON_Delete(c);
        if (rc)
            printf("error: %s\n", err[0] ? err : "failed");
        else if (secs >= 0)
            printf("ok %.6f\n", secs);
        else
            printf("ok\n");
        fflush(stdout);
    }
    bus_flush(B, 5000);
    bus_close(B);
    bus_library_shutdown();
    return 0;
}

/* The projection: durable JetStream consumers into the stream_hub schema.
 *
 * Two pull consumers (names from the configuration, defaults in libcommon/subjects.h), bound
 * by every replica, which share the work: run events (WF_EVENTS, wf.>) and node I/O (WFIO,
 * wfio.>; only events that complete a transcript entry are stored, and the engine's
 * user_prompt frames). A run events message is a batch of one run's events (or, from earlier
 * engines, one event); each is projected on its own. A message is acked after its row is committed;
 * a failed write is not acked and comes back after the ack wait, so a crash or a Postgres outage
 * loses nothing. Writes are idempotent by sequence (store.c), so a redelivery, or two replicas
 * racing, change nothing. An undecodable message is terminated (never redelivered) and counted. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hub.h"
#include "ids.h"
#include "log.h"
#include "store.h"
#include "upsquad/internal/v1/node_io.pb-c.h"
#include "upsquad/internal/v1/run_events.pb-c.h"

#define PROJ_BATCH 128
#define PROJ_WAIT_MS 500

typedef Upsquad__Internal__V1__RunEvent RunEvent;
typedef Upsquad__Internal__V1__NodeIOEvent NodeIOEvent;

enum { PR_RUN = 0, PR_NODE = 1, PR_LOG = 2, PR_TRANSCRIPT = 3 };

static double ts_of(const Google__Protobuf__Timestamp *t) {
    return t ? (double)t->seconds + (double)t->nanos / 1e9 : 0;
}

/* 0 stored (or nothing to store), 1 undecodable (terminate), -1 retry later. */
static int project_run_event(hub *h, const uint8_t *data, size_t len) {
    char err[512];
    RunEvent *ev = upsquad__internal__v1__run_event__unpack(NULL, len, data);
    if (!ev || !ev->scope || ev->seq <= 0 || !ids_uuid_valid(ev->scope->org_id) ||
        !ids_uuid_valid(ev->scope->run_id)) {
        if (ev) upsquad__internal__v1__run_event__free_unpacked(ev, NULL);
        return 1;
    }
    const Upsquad__Internal__V1__RunScope *sc = ev->scope;
    hs_run_event e = {
        .org_id = sc->org_id,
        .run_id = sc->run_id,
        .seq = ev->seq,
        .at_s = ts_of(ev->at),
        .workflow_id = sc->workflow_id,
        .workflow_name = sc->workflow_name,
        .team_id = sc->team_id,
        .visibility = sc->visibility,
        .owner_id = sc->owner_id,
        .display_name = sc->display_name,
        .workflow_deleted = sc->workflow_deleted,
        .status = "",
        .body = data,
        .len = len,
    };
    int which;
    if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_NODE && ev->node) {
        Upsquad__Internal__V1__NodeTransition *n = ev->node;
        e.kind = 'n';
        e.node_id = n->update ? n->update->node_id : n->step_name;
        e.iteration = n->update ? n->update->iteration : 0;
        e.status = n->run_status;
        e.needs_input = n->needs_input;
        e.needs_approval = n->needs_approval;
        e.prompt_kind = n->prompt_kind;
        e.prompt_id = n->prompt_id;
        e.asked_by_role = n->asked_by_role;
        e.is_waiting = n->is_waiting;
        e.node_status = n->update ? n->update->status : "";
        which = PR_NODE;
    } else if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_RUN && ev->run) {
        e.kind = 'r';
        e.status = ev->run->status;
        e.has_counters = 1;
        e.nodes_total = ev->run->nodes_total;
        e.nodes_done = ev->run->nodes_done;
        which = PR_RUN;
    } else if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_LOG && ev->log) {
        e.kind = 'l';
        e.node_id = ev->log->node_id;
        which = PR_LOG;
    } else {
        upsquad__internal__v1__run_event__free_unpacked(ev, NULL);
        return 1;
    }
    int rc = hs_put_run_event(h->pool, &e, err, sizeof err);
    if (rc != DB_OK)
        log_warn("hub.project", "run %s seq %lld: %s", sc->run_id, (long long)ev->seq, err);
    else
        metric_inc(h->m_projected[which]);
    upsquad__internal__v1__run_event__free_unpacked(ev, NULL);
    return rc == DB_OK ? 0 : (rc == DB_EPRIVILEGE || rc == DB_ECHECK ? 1 : -1);
}

/* A WF_EVENTS message: each of its events (a batch's, or a bare RunEvent) projected on its own,
 * idempotent by (run, seq). 0 when every event was stored or dropped as undecodable (counted),
 * 1 when none was decodable (terminate), -1 retry later: the message comes back whole and the
 * events already stored change nothing then. */
static int project_run_msg(hub *h, const uint8_t *data, size_t len) {
    hub_evit it;
    const uint8_t *ev;
    size_t n;
    int rc, stored = 0, dropped = 0;
    hub_evit_init(&it, data, len);
    while ((rc = hub_evit_next(&it, &ev, &n)) == 1) {
        int r = project_run_event(h, ev, n);
        if (r < 0) return -1;
        if (r == 0)
            stored++;
        else
            dropped++;
    }
    if (rc < 0) dropped++;
    if (stored == 0) return 1;
    if (dropped) {
        log_warn("hub.project", "run events: %d undecodable event(s) in a batch dropped", dropped);
        metric_add(h->m_proj_errors, dropped);
    }
    return 0;
}

/* A user_prompt frame (the engine's, one per prompt it opens) is kept for the StreamNodeIO
 * snapshot of a subscriber that comes while the prompt is open (fanout.c). */
static int project_prompt(hub *h, const NodeIOEvent *ev, char *err, size_t errlen) {
    const Upsquad__Workflow__V1__NodeIOFrame *fr = ev->frame;
    if (!fr || fr->event_case != UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_USER_PROMPT ||
        !fr->user_prompt || !fr->user_prompt->prompt_id || !fr->user_prompt->prompt_id[0])
        return DB_OK;
    size_t n = upsquad__workflow__v1__node_ioframe__get_packed_size(fr);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return DB_ENOMEM;
    upsquad__workflow__v1__node_ioframe__pack(fr, buf);
    hs_prompt_frame p = {
        .org_id = ev->org_id,
        .run_id = ev->run_id,
        .prompt_id = fr->user_prompt->prompt_id,
        .step_name = fr->node_id,
        .action_id = ev->action_id,
        .iteration = fr->iteration,
        .body = buf,
        .len = n,
    };
    int rc = hs_put_prompt_frame(h->pool, &p, err, errlen);
    free(buf);
    if (rc != DB_OK) log_warn("hub.project", "prompt frame of run %s: %s", ev->run_id, err);
    return rc;
}

static int project_io_event(hub *h, const uint8_t *data, size_t len) {
    char err[512];
    NodeIOEvent *ev = upsquad__internal__v1__node_ioevent__unpack(NULL, len, data);
    if (!ev || !ids_uuid_valid(ev->org_id) || !ids_uuid_valid(ev->run_id)) {
        if (ev) upsquad__internal__v1__node_ioevent__free_unpacked(ev, NULL);
        return 1;
    }
    int rc = DB_OK;
    Upsquad__Workflow__V1__TranscriptEvent *te = ev->transcript;
    if (te && te->session_id && te->session_id[0]) {
        size_t n = upsquad__workflow__v1__transcript_event__get_packed_size(te);
        uint8_t *buf = malloc(n ? n : 1);
        if (!buf) {
            upsquad__internal__v1__node_ioevent__free_unpacked(ev, NULL);
            return -1;
        }
        upsquad__workflow__v1__transcript_event__pack(te, buf);
        const char *step = ev->step_name && ev->step_name[0]
                               ? ev->step_name
                               : (ev->frame ? ev->frame->node_id : "");
        hs_transcript_event t = {
            .org_id = ev->org_id,
            .run_id = ev->run_id,
            .step_name = step,
            .action_id = ev->action_id,
            .session_id = te->session_id,
            .iteration = ev->iteration,
            .seq = te->seq,
            .body = buf,
            .len = n,
        };
        rc = hs_put_transcript(h->pool, &t, err, sizeof err);
        free(buf);
        if (rc != DB_OK)
            log_warn("hub.project", "transcript of run %s: %s", ev->run_id, err);
        else
            metric_inc(h->m_projected[PR_TRANSCRIPT]);
    }
    if (rc == DB_OK) rc = project_prompt(h, ev, err, sizeof err);
    upsquad__internal__v1__node_ioevent__free_unpacked(ev, NULL);
    return rc == DB_OK ? 0 : (rc == DB_EPRIVILEGE || rc == DB_ECHECK ? 1 : -1);
}

static void consume(hub *h, bus_pull *p, int (*fn)(hub *, const uint8_t *, size_t),
                    const char *what) {
    char err[256];
    while (!h->stopping) {
        natsMsgList list = {0};
        if (bus_js_fetch(p, PROJ_BATCH, PROJ_WAIT_MS, &list, err, sizeof err) != BUS_OK) {
            if (h->stopping) break;
            log_warn("hub.project", "%s: fetch: %s", what, err);
            struct timespec ts = {0, 200000000};
            nanosleep(&ts, NULL);
            continue;
        }
        for (int i = 0; i < list.Count; i++) {
            natsMsg *m = list.Msgs[i];
            int rc = fn(h, (const uint8_t *)natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m));
            if (rc == 0) {
                bus_ack(m);
            } else if (rc > 0) {
                log_warn("hub.project", "%s: dropping an undecodable or foreign message on %s",
                         what, natsMsg_GetSubject(m));
                metric_inc(h->m_proj_errors);
                bus_term(m);
            } else {
                metric_inc(h->m_proj_errors);
                bus_nak(m, 500); /* Postgres trouble: again in a moment */
            }
        }
        natsMsgList_Destroy(&list);
    }
}

void *hub_proj_events_main(void *arg) {
    hub *h = arg;
    consume(h, h->pull_events, project_run_msg, "run events");
    return NULL;
}

void *hub_proj_io_main(void *arg) {
    hub *h = arg;
    consume(h, h->pull_io, project_io_event, "node I/O");
    return NULL;
}

/* The fan-out of visible runs (fanout_int.h; the rules at the top of fanout.c): an org's run
 * events filtered per subscriber (teams, ownership, status), entries into and exits from its
 * set, the set's snapshot, and its re-snapshot after an overflow. */
#include "fanout_int.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

/* ---- visible runs ---- */

static int sub_sees(const hub_sub *s, const char *visibility, const char *team, const char *owner) {
    if (visibility && strcmp(visibility, "private") == 0)
        return owner && owner[0] && strcmp(owner, s->member) == 0;
    if (!team || !team[0]) return 0;
    for (size_t i = 0; i < s->n_teams; i++)
        if (strcmp(s->teams[i], team) == 0) return 1;
    return 0;
}

void fanout__vis_apply(hub_sub *s, const char *run_id, int64_t seq, int match, rpc_frame *f,
                       rpc_frame *leave) {
    seen *v = fanout__seen_get(&s->seen, run_id, 1);
    if (!v) return;
    if (seq <= v->seq) return;
    v->seq = seq;
    if (match < 0) match = v->in_set; /* no run status on this event: membership unchanged */
    rpc_frame *out = NULL;
    if (match) {
        out = f;
        v->in_set = 1;
    } else if (v->in_set) {
        out = leave;
        v->in_set = 0;
    }
    if (!out) return;
    if (fanout__push(s, out) == RPC_EFULL) {
        s->state = SS_RESYNC; /* dropped: re-snapshot the set once the client drains */
        metric_inc(s->h->m_gaps);
        fanout__wake(s->h);
    }
}

/* One event of an org topic's message; more: events wait behind this one. */
static void org_event(hub_topic *t, const uint8_t *data, size_t len, int more,
                      const char *subject) {
    rpc_frame *f = NULL, *leave = NULL;
    int fanned = 0;
    RunEvent *ev = upsquad__internal__v1__run_event__unpack(NULL, len, data);
    if (!ev || !ev->scope) {
        log_warn("hub.decode", "undecodable run event on %s", subject);
        goto done;
    }
    const Upsquad__Internal__V1__RunScope *sc = ev->scope;
    VisEvent v = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
    v.run_id = sc->run_id;
    v.workflow_id = sc->workflow_id;
    v.workflow_name = sc->workflow_name;
    const char *status = "";
    if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_NODE && ev->node) {
        Upsquad__Internal__V1__NodeTransition *n = ev->node;
        status = n->run_status;
        v.needs_input = n->needs_input;
        v.needs_approval = n->needs_approval;
        v.prompt_kind = n->prompt_kind;
        v.prompt_id = n->prompt_id;
        v.asked_by_role = n->asked_by_role;
        v.is_waiting = n->is_waiting;
        if (n->update) v.last_action_status = n->update->status;
    } else if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_RUN && ev->run) {
        status = ev->run->status;
    } else {
        goto done;
    }
    v.status = (char *)status;
    f = rpc_frame_encode(&v.base);
    VisEvent l = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
    l.run_id = sc->run_id;
    l.workflow_id = sc->workflow_id;
    l.workflow_name = sc->workflow_name;
    l.status = (char *)status;
    l.leaving = 1;
    leave = rpc_frame_encode(&l.base);
    if (!f || !leave) goto done;
    int bit = status[0] ? hub_status_bit(status) : 0;
    /* a deleted workflow's run leaves every set for good (spec DeleteWorkflow: its runs
     * "become UNDISCOVERABLE through the workflow") */
    int gone = sc->workflow_deleted;
    pthread_mutex_lock(&t->mu);
    seen *tr = fanout__seen_get(&t->runs, sc->run_id, 1);
    if (tr && ev->seq > tr->seq) tr->seq = ev->seq;
    fanout__batch_begin(t, more);
    for (hub_sub *s = t->subs; s; s = s->next) {
        if (!sub_sees(s, sc->visibility, sc->team_id, sc->owner_id)) continue;
        int match = gone ? 0 : status[0] ? (s->status_mask & bit) != 0 : -1;
        if (s->state == SS_SNAP)
            fanout__pending_add(s, f, leave, ev->seq, sc->run_id, "", match, 0);
        else if (s->state == SS_LIVE)
            fanout__vis_apply(s, sc->run_id, ev->seq, match, f, leave);
    }
    fanout__batch_end(t);
    pthread_mutex_unlock(&t->mu);
    fanned = 1;
done:
    if (!fanned) fanout__batch_skip(t, more);
    rpc_frame_unref(f);
    rpc_frame_unref(leave);
    if (ev) upsquad__internal__v1__run_event__free_unpacked(ev, NULL);
}

void fanout__on_org_msg(bus *b, natsMsg *m, void *ud) {
    (void)b;
    hub_topic *t = ud;
    hub_evit it;
    const uint8_t *ev;
    size_t len;
    int more = fanout__burst_more(t), rc;
    hub_evit_init(&it, (const uint8_t *)natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m));
    while ((rc = hub_evit_next(&it, &ev, &len)) == 1)
        org_event(t, ev, len, more, natsMsg_GetSubject(m));
    if (rc < 0) log_warn("hub.decode", "malformed run event batch on %s", natsMsg_GetSubject(m));
}

static void vis_row(VisEvent *v, const hs_run *r, int is_snapshot) {
    v->run_id = (char *)r->run_id;
    v->workflow_id = (char *)r->workflow_id;
    v->workflow_name = (char *)r->workflow_name;
    v->status = (char *)r->status;
    v->nodes_total = r->nodes_total;
    v->nodes_done = r->nodes_done;
    v->needs_input = r->needs_input;
    v->needs_approval = r->needs_approval;
    v->asked_by_role = (char *)r->asked_by_role;
    v->prompt_id = (char *)r->prompt_id;
    v->is_snapshot = is_snapshot;
    v->display_name = (char *)r->display_name;
    v->prompt_kind = r->prompt_kind;
    v->is_waiting = r->is_waiting;
    /* spec: open_prompt_count is populated on snapshot rows only, with explicit presence
     * (present-and-0 is authoritative); absent when the store could not determine it */
    if (is_snapshot && r->has_open_prompt_count) {
        v->_open_prompt_count_case =
            UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT___OPEN_PROMPT_COUNT_OPEN_PROMPT_COUNT;
        v->open_prompt_count = r->open_prompt_count;
    }
}

int fanout__snapshot_visible(hub_sub *s, int resync) {
    hub *h = s->h;
    char err[256];
    static const char *const names[] = {"pending",   "running", "paused",
                                        "completed", "failed",  "cancelled"};
    const char *st[6], *teams[AUTH_MAX_TEAMS];
    size_t nst = 0;
    for (int i = 0; i < 6; i++)
        if (s->status_mask & (1 << i)) st[nst++] = names[i];
    for (size_t i = 0; i < s->n_teams; i++)
        teams[i] = s->teams[i];
    hs_run *rows = NULL;
    size_t n = 0;
    if (hs_visible_runs(h->pool, s->t->org, s->member, teams, s->n_teams, st, nst,
                        (int)h->cfg->visible_max, &rows, &n, err, sizeof err) != DB_OK) {
        log_warn("hub.snapshot", "visible runs: %s", err);
        return -1;
    }
    int rc = 0;
    if (resync)
        for (seen *v = s->seen; v; v = v->next)
            v->in_set = 0 - v->in_set; /* -1: was in */
    for (size_t i = 0; i < n && rc == 0; i++) {
        VisEvent v = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
        vis_row(&v, &rows[i], !resync);
        seen *sn = fanout__seen_get(&s->seen, rows[i].run_id, 1);
        if (sn) {
            if (rows[i].last_seq > sn->seq) sn->seq = rows[i].last_seq;
            sn->in_set = 1;
        }
        if (!resync) {
            rc = fanout__send_msg(s, &v.base);
        } else {
            rpc_frame *f = rpc_frame_encode(&v.base);
            rc = f && fanout__push_unlocked(s, f) == RPC_OK ? 0 : -1;
            rpc_frame_unref(f);
        }
    }
    for (seen *v = s->seen; resync && v && rc == 0; v = v->next) {
        if (v->in_set != -1) continue;
        v->in_set = 0;
        VisEvent l = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
        l.run_id = v->key;
        l.leaving = 1;
        rpc_frame *f = rpc_frame_encode(&l.base);
        rc = f && fanout__push_unlocked(s, f) == RPC_OK ? 0 : -1;
        rpc_frame_unref(f);
    }
    for (seen *v = s->seen; v; v = v->next)
        if (v->in_set < 0) v->in_set = 1; /* not told yet: retried by the next resync */
    free(rows);
    if (rc || resync) return rc;
    VisEvent done = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
    done.snapshot_done = 1;
    return fanout__send_msg(s, &done.base);
}

/* 1 when the store has not yet caught up with every run event the topic has seen (the
 * re-snapshot would miss what was dropped); topic->mu held by nobody. */
static int store_behind(hub_sub *s) {
    size_t n = 0, i = 0;
    int behind = 1;
    char err[256];
    pthread_mutex_lock(&s->t->mu);
    for (seen *v = s->t->runs; v; v = v->next)
        n++;
    const char **ids = calloc(n ? n : 1, sizeof *ids);
    int64_t *seqs = calloc(n ? n : 1, sizeof *seqs);
    char(*keys)[64] = calloc(n ? n : 1, sizeof *keys);
    for (seen *v = s->t->runs; v && ids && seqs && keys; v = v->next, i++) {
        memcpy(keys[i], v->key, sizeof keys[i]);
        ids[i] = keys[i];
        seqs[i] = v->seq;
    }
    pthread_mutex_unlock(&s->t->mu);
    if (ids && seqs && keys &&
        hs_runs_behind(s->h->pool, s->t->org, ids, seqs, n, &behind, err, sizeof err) != DB_OK) {
        log_warn("hub.resync", "%s", err);
        behind = 1;
    }
    free(ids);
    free(seqs);
    free(keys);
    return behind != 0;
}

void fanout__resync_visible(hub_sub *s) {
    pthread_mutex_lock(&s->t->mu);
    if (s->state != SS_RESYNC) {
        pthread_mutex_unlock(&s->t->mu);
        return;
    }
    s->state = SS_SNAP; /* from here on, live events are held */
    fanout__pending_clear(s);
    pthread_mutex_unlock(&s->t->mu);
    int rc = store_behind(s) ? 1 : fanout__snapshot_visible(s, 1);
    pthread_mutex_lock(&s->t->mu);
    if (s->state == SS_SNAP) {
        if (rc == 0) {
            fanout__flush_pending(s);
        } else {
            fanout__pending_clear(s); /* the store lags (or the client is full again): next tick */
            s->state = SS_RESYNC;
        }
    }
    pthread_mutex_unlock(&s->t->mu);
}

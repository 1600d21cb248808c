/* Schedules (interp.h): cron and interval triggers, their next firing, the firing thread. */
#include "gates.h"
#include "interp_int.h"

/* ---- schedules ---- */

/* One cron field into a Postgres int array text; *star when it was "*". */
static int cron_field(const char *f, int lo, int hi, char *out, size_t outlen, int *star) {
    unsigned char set[64] = {0};
    char buf[128];
    snprintf(buf, sizeof buf, "%s", f);
    *star = !strcmp(f, "*");
    for (char *save = NULL, *part = strtok_r(buf, ",", &save); part;
         part = strtok_r(NULL, ",", &save)) {
        int a = lo, b = hi, step = 1;
        char *slash = strchr(part, '/');
        if (slash) {
            *slash = 0;
            char *end;
            step = (int)strtol(slash + 1, &end, 10);
            if (*end || step <= 0) return -1;
        }
        if (strcmp(part, "*")) {
            char *end;
            a = (int)strtol(part, &end, 10);
            if (end == part) return -1;
            b = a;
            if (*end == '-') {
                char *e2;
                b = (int)strtol(end + 1, &e2, 10);
                if (e2 == end + 1 || *e2) return -1;
            } else if (*end) {
                return -1;
            } else if (slash) {
                b = hi;
            }
        }
        if (a < lo || b > hi || a > b) return -1;
        for (int v = a; v <= b; v += step)
            set[v] = 1;
    }
    size_t o = 0;
    out[o++] = '{';
    for (int v = lo; v <= hi; v++)
        if (set[v])
            o += (size_t)snprintf(out + o, outlen - o, "%s%d", o > 1 ? "," : "",
                                  v % (hi == 7 ? 7 : 1000));
    if (o == 1) return -1;
    out[o++] = '}';
    out[o] = 0;
    return 0;
}

/* The usual cron macros, as their five fields. NULL: not a macro. */
static const char *cron_macro(const char *m) {
    static const char *const names[][2] = {{"@yearly", "0 0 1 1 *"},  {"@annually", "0 0 1 1 *"},
                                           {"@monthly", "0 0 1 * *"}, {"@weekly", "0 0 * * 0"},
                                           {"@daily", "0 0 * * *"},   {"@midnight", "0 0 * * *"},
                                           {"@hourly", "0 * * * *"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(m, names[i][0])) return names[i][1];
    return NULL;
}

/* "interval": a duration string ("90s", "15m", "1h", "1d"; a bare number is seconds) as
 * seconds; -1 when it is not one. */
static double interval_of(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return -1;
    double unit = !*end || !strcmp(end, "s") ? 1
                  : !strcmp(end, "m")        ? 60
                  : !strcmp(end, "h")        ? 3600
                  : !strcmp(end, "d")        ? 86400
                                             : -1;
    return unit < 0 ? -1 : v * unit;
}

int wf_schedule_next(db_pool *p, const char *spec_json, int64_t after_ms, int64_t *next_ms,
                     char *err, size_t errlen) {
    cJSON *spec = cJSON_Parse(spec_json);
    int rc = -1;
    const cJSON *iv = item(spec, "interval_seconds");
    const char *cron = str(spec, "cron"), *macro = cron ? cron_macro(cron) : NULL;
    const char *tz = str(spec, "timezone") ? str(spec, "timezone") : "UTC";
    /* interval_seconds, or "interval" as a duration; -1: neither */
    double secs = !iv ? -1 : cJSON_IsNumber(iv) ? iv->valuedouble : 0;
    if (macro) cron = macro;
    if (!iv && str(spec, "interval") && (secs = interval_of(str(spec, "interval"))) <= 0) {
        snprintf(err, errlen,
                 "interval must be a duration such as \"90s\", \"15m\", \"1h\" or "
                 "\"1d\"");
        goto done;
    }
    if (!cJSON_IsObject(spec)) {
        snprintf(err, errlen, "must be an object");
    } else if (secs >= 0) {
        if (secs < 1 || secs > 86400 * 366 || secs != (double)(int64_t)secs) {
            snprintf(err, errlen,
                     "interval_seconds (or interval) must be a whole number of "
                     "seconds from 1 to 31622400");
        } else {
            int64_t step = (int64_t)secs * 1000;
            *next_ms = (after_ms / step + 1) * step; /* epoch-aligned slots */
            rc = 0;
        }
    } else if (!cron) {
        snprintf(err, errlen, "cron (\"m h dom mon dow\") or interval_seconds is required");
    } else {
        char f[5][64], arr[5][256];
        int stars[5];
        static const int lo[] = {0, 0, 1, 1, 0}, hi[] = {59, 23, 31, 12, 7};
        if (sscanf(cron, "%63s %63s %63s %63s %63s", f[0], f[1], f[2], f[3], f[4]) != 5) {
            snprintf(err, errlen, "cron must have five fields: minute hour day month weekday");
            goto done;
        }
        for (int i = 0; i < 5; i++)
            if (cron_field(f[i], lo[i], hi[i], arr[i], sizeof arr[i], &stars[i]) != 0) {
                snprintf(err, errlen, "cron field %d (\"%s\") is not valid", i + 1, f[i]);
                goto done;
            }
        char e2[256];
        if (st_cron_next(p, arr[0], arr[1], arr[2], arr[3], arr[4], stars[2], stars[4], tz,
                         after_ms, next_ms, e2, sizeof e2) != DB_OK) {
            snprintf(err, errlen, "timezone \"%s\" is not known", tz);
            goto done;
        }
        if (*next_ms < 0) {
            snprintf(err, errlen, "cron never fires within 400 days");
            goto done;
        }
        rc = 0;
    }
done:
    cJSON_Delete(spec);
    return rc;
}

/* Fires one due schedule; 1 when one was handled. A (workflow, slot) firing row makes each
 * firing start exactly one run however many replicas see it. */
static int fire_one(wf_engine *e) {
    char err[512], run_id[37], wf[37], org[37];
    db_tx *tx = NULL;
    PGresult *r = NULL, *w = NULL;
    wf_run run = {0};
    int handled = 0, inserted = 0, found = 0;
    if (st_begin_service(e->pool, &tx, err, sizeof err) ||
        st_schedule_due(tx, &r, err, sizeof err) || PQntuples(r) == 0)
        goto done;
    handled = 1;
    snprintf(wf, sizeof wf, "%s", st_s(r, 0, 0));
    snprintf(org, sizeof org, "%s", st_s(r, 0, 1));
    int64_t slot = st_i(r, 0, 3), next = 0;
    if (st_scope_org(tx, org, err, sizeof err) || st_wf_row(tx, wf, &w, err, sizeof err)) goto fail;
    if (PQntuples(w) == 0 || !st_null(w, 0, WF_DELETED_AT) || !st_b(w, 0, WF_ENABLED) ||
        strcmp(st_s(w, 0, WF_STATUS), "archived") == 0) {
        if (st_schedule_drop(tx, wf, err, sizeof err)) goto fail;
    } else {
        ids_uuid_v7(run_id);
        if (st_firing_insert(tx, org, wf, slot, run_id, &inserted, err, sizeof err)) goto fail;
        if (inserted && (st_run_insert(tx, run_id, org, wf, NULL, "{}", st_s(w, 0, WF_DEF), NULL,
                                       err, sizeof err) ||
                         wf_run_load(tx, run_id, 1, &run, &found, err, sizeof err) ||
                         wf_run_transition(&run, "pending", "schedule", err, sizeof err) ||
                         wf_run_flush(&run, err, sizeof err)))
            goto fail;
        int64_t now = wf_now_ms();
        if (wf_schedule_next(e->pool, st_s(r, 0, 2), now > slot ? now : slot, &next, err,
                             sizeof err) ||
            st_schedule_advance(tx, wf, next, err, sizeof err))
            goto fail;
    }
    if (db_tx_commit(tx, err, sizeof err)) {
        tx = NULL;
        goto fail;
    }
    tx = NULL;
    if (inserted) {
        log_info("schedule.fired", "workflow=%s run=%s", wf, run_id);
        metric_inc(e->m_runs_started);
        wf_engine_kick(e);
    }
    goto done;
fail:
    log_warn("schedule.fire", "workflow=%s: %s", wf, err);
    handled = 0; /* back off for a poll period rather than spin on a failing schedule */
done:
    db_tx_rollback(tx);
    wf_run_free(&run);
    PQclear(r);
    PQclear(w);
    return handled;
}

/* The pending-approvals gauges, on the sweep's beat: one service-scoped count (the gates of
 * every org as ids and times, pending_gates). */
static void pending_gauges(wf_engine *e) {
    char err[512];
    db_tx *tx = NULL;
    int64_t n = 0;
    double oldest = 0;
    if (st_begin_service(e->pool, &tx, err, sizeof err) ||
        st_pending_gates(tx, &n, &oldest, err, sizeof err)) {
        log_warn("metrics.pending_approvals", "%s", err);
    } else {
        metric_set(e->m_pending_gates, (double)n);
        metric_set(e->m_oldest_gate, oldest);
    }
    db_tx_rollback(tx);
}

void *wf_scheduler_thread(void *arg) {
    wf_engine *e = arg;
    int64_t swept = 0;
    while (!e->stop) {
        /* due approval timers fire on the same beat, at least once a period however many
         * schedules are due */
        if (wf_now_ms() - swept >= e->cfg->schedule_poll_ms) {
            wf_session_gates_sweep(e);
            pending_gauges(e);
            swept = wf_now_ms();
        }
        if (!fire_one(e)) {
            struct timespec ts;
            util_deadline(&ts, e->cfg->schedule_poll_ms);
            pthread_mutex_lock(&e->mu); /* only stop or the interval end this */
            while (!e->stop && pthread_cond_timedwait(&e->sched_cv, &e->mu, &ts) != ETIMEDOUT) {
            }
            pthread_mutex_unlock(&e->mu);
        }
    }
    return NULL;
}

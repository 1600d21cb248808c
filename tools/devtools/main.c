/* devtools: wiring only. Configuration (docs/devtools.md):
 *   devtools [--print-config]   serve until SIGTERM/SIGINT; prints "ready" once it serves. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cfg.h"
#include "devtools.h"
#include "log.h"
#include "subjects.h"

static char *nats_url, *catalog_path, *fixtures_dir, *provider_name, *stats_subject;
static long long dedup_keys, dedup_bytes, announce_ms, workers, queue_len;

static const cfg_var vars[] = {
    {"UPSQUAD_NATS_URL", CFG_STR, NULL, "NATS server(s), nats://host:port", &nats_url, 0, 0,
     CFG_REQUIRED},
    {"UPSQUAD_DEVTOOLS_CATALOG", CFG_STR, "services/workflow-engine/catalog/tools.json",
     "the tool catalogue whose every action is served (the validator's file)", &catalog_path, 0, 0,
     0},
    {"UPSQUAD_DEVTOOLS_FIXTURES", CFG_STR, "tools/devtools/fixtures",
     "folder of <tool>.<action>.json fixtures, one per catalogued action", &fixtures_dir, 0, 0, 0},
    {"UPSQUAD_DEVTOOLS_PROVIDER", CFG_STR, "devtools", "provider name in ToolAnnounce",
     &provider_name, 0, 0, 0},
    {"UPSQUAD_DEVTOOLS_STATS_SUBJECT", CFG_STR, "devtools.stats",
     "request/reply subject answering JSON execution counts", &stats_subject, 0, 0, 0},
    {"UPSQUAD_DEVTOOLS_DEDUP_KEYS", CFG_INT, "65536",
     "idempotency keys remembered (least recently used evicted beyond)", &dedup_keys, 1, 16 << 20,
     0},
    {"UPSQUAD_DEVTOOLS_DEDUP_BYTES", CFG_INT, "67108864",
     "bytes of recorded responses remembered (LRU beyond)", &dedup_bytes, 1 << 16, 1LL << 34, 0},
    {"UPSQUAD_DEVTOOLS_ANNOUNCE_INTERVAL", CFG_MS, "30s", "period of ToolAnnounce on tool.announce",
     &announce_ms, 100, 3600000, 0},
    {"UPSQUAD_DEVTOOLS_WORKERS", CFG_INT, "16",
     "threads running invocations with a delay cue, a batch's included", &workers, 1, 1024, 0},
    {"UPSQUAD_DEVTOOLS_QUEUE", CFG_INT, "1024",
     "delayed invocations waiting for a worker (full: retryable \"overloaded\"; a batch's call "
     "runs on the batch's thread)",
     &queue_len, 1, 1 << 20, 0},
};
#define N_VARS (sizeof vars / sizeof vars[0])

int main(int argc, char **argv) {
    char err[1024] = "";
    int rc = 1;
    bus *b = NULL;
    dt_provider *p = NULL;
    dt_catalog cat = {0};
    if (argc > 1 && strcmp(argv[1], "--print-config") == 0) {
        cfg_print_markdown(vars, N_VARS, stdout);
        return 0;
    }
    log_init_env("devtools");
    /* Termination signals are taken by sigwait below, never by nats.c's threads. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    if (cfg_load(vars, N_VARS, err, sizeof err) != 0) goto done;
    cfg_log(vars, N_VARS);
    if (dt_catalog_load(catalog_path, fixtures_dir, &cat, err, sizeof err) != 0) goto done;
    /* a thread per subscription (a handful: two per tool, announce, stats): a batch waits on
     * its subscription's thread for its delayed calls, which must not hold up another tool's
     * requests as a shared delivery thread would */
    bus_set_delivery_threads(0);
    if (bus_connect(nats_url, "devtools", &b, err, sizeof err) != BUS_OK) goto done;
    dt_opts o = {.provider = provider_name,
                 .stats_subject = stats_subject,
                 .dedup_keys = dedup_keys,
                 .dedup_bytes = dedup_bytes,
                 .announce_ms = announce_ms,
                 .workers = workers,
                 .queue = queue_len};
    if (dt_provider_start(b, &cat, &o, &p, err, sizeof err) != 0) goto done;
    size_t n_actions = 0;
    for (size_t i = 0; i < cat.n_tools; i++)
        n_actions += cat.tools[i].n_actions;
    log_info("devtools.ready", "serving %zu actions of %zu tools on %s.<tool>; stats on %s",
             n_actions, cat.n_tools, SUBJ_TOOL_INVOKE, stats_subject);
    printf("ready\n");
    fflush(stdout);
    int sig = 0;
    sigwait(&sigs, &sig);
    log_info("devtools.stop", "signal %d: stopping", sig);
    rc = 0;
done:
    if (rc != 0) log_error("devtools.fail", "%s", err);
    dt_provider_stop(p);
    bus_close(b);
    bus_library_shutdown();
    dt_catalog_free(&cat);
    cfg_free(vars, N_VARS);
    return rc;
}

/* wf-responder: wiring only. Answers the engine's agent steps in tests and local runs
 * (docs/devtools.md, "wf-responder"); prints "ready" once its consumer is bound. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cfg.h"
#include "log.h"
#include "responder.h"
#include "subjects.h"

static char *nats_url, *durable, *stats_subject;
static long long workers, keys, ack_wait_ms;

static const cfg_var vars[] = {
    {"UPSQUAD_NATS_URL", CFG_STR, NULL, "NATS server(s), nats://host:port", &nats_url, 0, 0,
     CFG_REQUIRED},
    {"UPSQUAD_WF_RESPONDER_DURABLE", CFG_STR, DURABLE_AGENT_STEPS,
     "durable pull consumer of AGENT_STEPS (the orchestrator's by default)", &durable, 0, 0, 0},
    {"UPSQUAD_WF_RESPONDER_STATS_SUBJECT", CFG_STR, "wf-responder.stats",
     "request/reply subject answering JSON counts", &stats_subject, 0, 0, 0},
    {"UPSQUAD_WF_RESPONDER_WORKERS", CFG_INT, "4",
     "threads, each with its own pull subscription (steps sleeping on cue hold one each)", &workers,
     1, 256, 0},
    {"UPSQUAD_WF_RESPONDER_KEYS", CFG_INT, "65536",
     "idempotency keys remembered (least recently used evicted beyond)", &keys, 1, 16 << 20, 0},
    {"UPSQUAD_WF_RESPONDER_ACK_WAIT", CFG_MS, "30s",
     "a dispatch not acked within this is delivered again", &ack_wait_ms, 100, 3600000, 0},
};
#define N_VARS (sizeof vars / sizeof vars[0])

int main(int argc, char **argv) {
    char err[1024] = "";
    int rc = 1;
    bus *b = NULL;
    wr *r = NULL;
    if (argc > 1 && strcmp(argv[1], "--print-config") == 0) {
        cfg_print_markdown(vars, N_VARS, stdout);
        return 0;
    }
    log_init_env("wf-responder");
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL); /* taken by sigwait, never by nats.c threads */
    if (cfg_load(vars, N_VARS, err, sizeof err) != 0) goto done;
    cfg_log(vars, N_VARS);
    if (bus_connect(nats_url, "wf-responder", &b, err, sizeof err) != BUS_OK) goto done;
    wr_opts o = {.durable = durable,
                 .stats_subject = stats_subject,
                 .workers = workers,
                 .keys = keys,
                 .ack_wait_ms = ack_wait_ms};
    if (wr_start(b, &o, &r, err, sizeof err) != 0) goto done;
    log_info("wf_responder.ready", "consuming %s as %s; stats on %s", STREAM_AGENT_STEPS, durable,
             stats_subject);
    printf("ready\n");
    fflush(stdout);
    int sig = 0;
    sigwait(&sigs, &sig);
    rc = 0;
done:
    if (rc != 0) log_error("wf_responder.fail", "%s", err);
    wr_stop(r);
    bus_close(b);
    bus_library_shutdown();
    cfg_free(vars, N_VARS);
    return rc;
}

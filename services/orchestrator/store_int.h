/* Internals shared by the orchestrator's store files (store.c, store_session.c,
 * store_pause.c, store_tree.c): the transaction wrapper and the statements one concept's
 * transaction borrows from another (audit appends, session ends, pause commits). */
#ifndef ORCH_STORE_INT_H
#define ORCH_STORE_INT_H

#include "store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ids.h"
#include "util.h"

#define ZERO_HASH "0000000000000000000000000000000000000000000000000000000000000000"

static inline void copy(char *dst, size_t cap, const char *src) {
    snprintf(dst, cap, "%s", src ? src : "");
}

static inline int64_t to_ms(const char *ms) {
    return ms && ms[0] ? (int64_t)atoll(ms) : 0;
}

/* Runs fn inside one transaction scoped to org; commits when it returns DB_OK. */
#define TX_BEGIN(org)                                                                              \
    db_tx *tx = NULL;                                                                              \
    int rc = db_tx_begin(p, (org), &tx, err, errlen);                                              \
    if (rc != DB_OK) return rc;                                                                    \
    PGconn *c = db_tx_conn(tx)

/* Every transaction ends here: committed on DB_OK, else rolled back (a not-found, a refused
 * state or a replay changes nothing) with rc passed up. */
static inline int tx_end(db_tx *tx, int rc, char *err, size_t errlen) {
    if (rc == DB_OK) return db_tx_commit(tx, err, errlen);
    db_tx_rollback(tx);
    return rc;
}

static inline int terminal(const char *state) {
    return !strcmp(state, "terminated") || !strcmp(state, "error") || !strcmp(state, "crashed");
}

/* Cross-file statements, each inside the caller's transaction (c is its connection). */
int orch_store__audit_tx(PGconn *c, const char *sid, const char *type, const char *agent_id,
                         const char *parent, const char *detail, char *action_id, char *err,
                         size_t errlen);
char *orch_store__json_str(const char *s, size_t max);
int orch_store__session_end_tx(PGconn *c, const char *session_id, const char *agent,
                               const char *reason, char *err, size_t errlen);
int orch_store__latest_checkpoint_tx(PGconn *c, const char *session_id, char key[64], int *loop,
                                     char *err, size_t errlen);
int orch_store__pause_commit_tx(PGconn *c, const char *session_id, const char *agent,
                                const char *parent, orch_pause *pz, char *err, size_t errlen);
/* The newest prior turns of a session with turn_no < before (0: all), at most max_turns and
 * max_bytes of text, oldest first. *turns heap: orch_turns_free. */
int orch_store__prior_turns_tx(PGconn *c, const char *session_id, int before, int max_turns,
                               size_t max_bytes, orch_turn **turns, size_t *n, char *err,
                               size_t errlen);
/* The lease of a turn (docs/orchestrator.md, "Dead turns"), named by its audit row. */
int orch_store__lease_tx(PGconn *c, const char *action_id, const char *session_id,
                         const char *owner, char *err, size_t errlen);

#endif

/* upsquad-agents: provisions agent definitions and BYOK provider keys of one org into the
 * orchestrator's schema (docs/orchestrator.md, "Agents and keys").
 *
 *   upsquad-agents [--org ORG] apply FILE...      upsert every agent of the files
 *   upsquad-agents [--org ORG] list               id, role, model, display name
 *   upsquad-agents [--org ORG] show ID            the stored definition (JSON)
 *   upsquad-agents [--org ORG] keys set PROVIDER  the key is read from stdin, never from argv
 *
 * A file holds one agent object or an array of them. Every file is parsed and validated before
 * anything is written: one bad file (or one bad agent) and nothing changes; the error names the
 * file and the JSON pointer. Exit 0 on success, 1 on a refused input, 2 on usage/config errors. */
#include <getopt.h>
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agentdef.h"
#include "cfg.h"
#include "db.h"
#include "ids.h"
#include "keys.h"
#include "log.h"
#include "store.h"

static char *ag_dsn, *ag_kek, *ag_org;
static const cfg_var ag_cfg[] = {
    {"UPSQUAD_PG_DSN", CFG_STR, NULL,
     "Postgres connection string of the orchestrator login role (falls back to "
     "UPSQUAD_PG_DSN_ORCHESTRATOR)",
     &ag_dsn, 0, 0, CFG_SECRET},
    {"UPSQUAD_KEK", CFG_STR, NULL, "key-encryption keys `kid:64-hex[,...]` (keys set)", &ag_kek, 0,
     0, CFG_SECRET},
    {"UPSQUAD_ORG_ID", CFG_STR, NULL, "the org (UUID); --org wins", &ag_org},
};
#define AG_NCFG (sizeof ag_cfg / sizeof ag_cfg[0])
#define FILE_MAX (4 << 20)

static void usage(FILE *f) {
    fprintf(f, "usage: upsquad-agents [--org ORG] apply FILE...\n"
               "       upsquad-agents [--org ORG] list\n"
               "       upsquad-agents [--org ORG] show AGENT_ID\n"
               "       upsquad-agents [--org ORG] keys set PROVIDER   (key on stdin)\n\n");
    cfg_print_markdown(ag_cfg, AG_NCFG, f);
}

static char *read_all(FILE *f, size_t *len) {
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    while (b) {
        size_t r = fread(b + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
        if (n + 1 == cap) {
            if (cap >= FILE_MAX) {
                free(b);
                return NULL;
            }
            char *nb = realloc(b, cap * 2);
            if (!nb) {
                free(b);
                return NULL;
            }
            b = nb;
            cap *= 2;
        }
    }
    if (b) b[n] = 0;
    *len = n;
    return b;
}

typedef struct doc {
    const char *file;
    cJSON *root;
} doc;

static int load(const char *file, doc *d) {
    FILE *f = fopen(file, "rb");
    size_t len;
    if (!f) {
        fprintf(stderr, "%s: cannot open\n", file);
        return -1;
    }
    char *text = read_all(f, &len);
    fclose(f);
    if (!text) {
        fprintf(stderr, "%s: cannot read (larger than 4 MiB?)\n", file);
        return -1;
    }
    const char *end = NULL;
    d->file = file;
    d->root = strlen(text) == len ? cJSON_ParseWithOpts(text, &end, 1) : NULL;
    if (!d->root) {
        fprintf(stderr, "%s: not valid JSON near byte %ld\n", file, end ? (long)(end - text) : 0L);
        free(text);
        return -1;
    }
    free(text);
    char err[512];
    if (cJSON_IsArray(d->root)) {
        int i = 0;
        if (cJSON_GetArraySize(d->root) == 0) {
            fprintf(stderr, "%s: an empty array defines no agent\n", file);
            return -1;
        }
        for (cJSON *a = d->root->child; a; a = a->next, i++)
            if (agentdef_validate(a, err, sizeof err)) {
                fprintf(stderr, "%s: /%d%s\n", file, i, err);
                return -1;
            }
        return 0;
    }
    if (agentdef_validate(d->root, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", file, err);
        return -1;
    }
    return 0;
}

static int apply(db_pool *p, const char *org, int nfiles, char **files) {
    doc *docs = calloc((size_t)nfiles, sizeof *docs);
    int rc = 1;
    char err[512];
    if (!docs) return 2;
    for (int i = 0; i < nfiles; i++)
        if (load(files[i], &docs[i])) goto done;
    /* roles are unique per org: two definitions of one role in this batch are refused */
    for (int i = 0; i < nfiles; i++) {
        cJSON *list = cJSON_IsArray(docs[i].root) ? docs[i].root->child : docs[i].root;
        for (cJSON *a = list; a; a = cJSON_IsArray(docs[i].root) ? a->next : NULL) {
            char id[37], *json = cJSON_PrintUnformatted(a);
            int created = 0;
            agentdef_id(a, org, id);
            const char *role = cJSON_GetObjectItemCaseSensitive(a, "role")->valuestring;
            int r = json ? orch_store_agent_upsert(
                               p, org, id, role,
                               cJSON_GetObjectItemCaseSensitive(a, "display_name")->valuestring,
                               cJSON_GetObjectItemCaseSensitive(a, "model")->valuestring, json,
                               &created, err, sizeof err)
                         : DB_ENOMEM;
            free(json);
            if (r != DB_OK) {
                fprintf(stderr, "%s: agent %s (%s): %s\n", docs[i].file, id, role,
                        r == DB_EUNIQUE ? "another agent of this org has this role" : err);
                goto done;
            }
            printf("%s %s %s\n", id, role, created ? "created" : "updated");
        }
    }
    rc = 0;
done:
    for (int i = 0; i < nfiles; i++)
        cJSON_Delete(docs[i].root);
    free(docs);
    return rc;
}

static void print_agent(const orch_agent_row *r, void *ud) {
    (void)ud;
    printf("%s  %-20s %-28s %s\n", r->agent_id, r->role, r->model, r->display_name);
}

static int keys_set(db_pool *p, const char *org, const char *provider) {
    keys_ring ring;
    char err[512];
    unsigned char nonce[KEYS_NONCE], *ct = NULL;
    size_t ctlen = 0, len = 0;
    const char *kid = NULL;
    int rc = 1;
    if (keys_ring_parse(ag_kek, &ring, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    char *key = read_all(stdin, &len);
    while (key && len && (key[len - 1] == '\n' || key[len - 1] == '\r'))
        key[--len] = 0;
    if (!key || len == 0 || len > KEYS_PLAIN_MAX) {
        fprintf(stderr, "keys set: the key (on stdin) must have 1..%d bytes\n", KEYS_PLAIN_MAX);
        goto done;
    }
    if (keys_encrypt(&ring, org, provider, (unsigned char *)key, len, nonce, &ct, &ctlen, &kid)) {
        fprintf(stderr, "keys set: encryption failed\n");
        goto done;
    }
    if (orch_store_key_set(p, org, provider, kid, nonce, ct, ctlen, err, sizeof err) != DB_OK) {
        fprintf(stderr, "keys set: %s\n", err);
        goto done;
    }
    printf("provider key %s stored for org %s (encrypted under %s)\n", provider, org, kid);
    rc = 0;
done:
    if (key) OPENSSL_cleanse(key, len);
    free(key);
    free(ct);
    keys_ring_wipe(&ring);
    return rc;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"org", required_argument, 0, 'o'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    char err[1024];
    const char *org = NULL, *dsn;
    db_pool *p = NULL;
    int opt, rc = 2;
    log_init_env("upsquad-agents");
    while ((opt = getopt_long(argc, argv, "+o:h", opts, NULL)) != -1) {
        if (opt == 'o')
            org = optarg;
        else {
            usage(opt == 'h' ? stdout : stderr);
            return opt == 'h' ? 0 : 2;
        }
    }
    if (cfg_load(ag_cfg, AG_NCFG, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    if (!org) org = ag_org;
    /* the fallback is borrowed from the environment: ag_dsn stays cfg_free's to release */
    dsn = ag_dsn && ag_dsn[0] ? ag_dsn : getenv("UPSQUAD_PG_DSN_ORCHESTRATOR");
    if (optind >= argc) {
        usage(stderr);
        goto out;
    }
    if (!org || !ids_uuid_valid(org)) {
        fprintf(stderr, "the org: --org or UPSQUAD_ORG_ID, a UUID\n");
        goto out;
    }
    if (!dsn || !dsn[0]) {
        fprintf(stderr, "UPSQUAD_PG_DSN (or UPSQUAD_PG_DSN_ORCHESTRATOR) is required\n");
        goto out;
    }
    if (db_pool_open(dsn, 1, &p, err, sizeof err)) {
        fprintf(stderr, "postgres: %s\n", err);
        goto out;
    }
    const char *cmd = argv[optind];
    if (!strcmp(cmd, "apply") && optind + 1 < argc) {
        rc = apply(p, org, argc - optind - 1, argv + optind + 1);
    } else if (!strcmp(cmd, "list") && optind + 1 == argc) {
        rc = orch_store_agent_list(p, org, print_agent, NULL, err, sizeof err) == DB_OK ? 0 : 1;
        if (rc) fprintf(stderr, "list: %s\n", err);
    } else if (!strcmp(cmd, "show") && optind + 2 == argc) {
        orch_agent_row a;
        if (!ids_uuid_valid(argv[optind + 1])) {
            fprintf(stderr, "show: not a UUID\n");
            rc = 1;
        } else {
            int r = orch_store_agent_get(p, org, argv[optind + 1], &a, err, sizeof err);
            if (r == ORCH_ENOTFOUND) {
                fprintf(stderr, "show: no agent %s in org %s\n", argv[optind + 1], org);
                rc = 1;
            } else if (r != DB_OK) {
                fprintf(stderr, "show: %s\n", err);
                rc = 1;
            } else {
                cJSON *j = cJSON_Parse(a.definition);
                char *pretty = j ? cJSON_Print(j) : NULL;
                printf("{\"id\": \"%s\", \"updated_at\": \"%s\", \"definition\": %s}\n", a.agent_id,
                       a.updated_at, pretty ? pretty : a.definition);
                free(pretty);
                cJSON_Delete(j);
                free(a.definition);
                rc = 0;
            }
        }
    } else if (!strcmp(cmd, "keys") && optind + 3 == argc && !strcmp(argv[optind + 1], "set")) {
        rc = keys_set(p, org, argv[optind + 2]);
    } else {
        usage(stderr);
    }
out:
    db_pool_close(p);
    cfg_free(ag_cfg, AG_NCFG);
    /* stdout to a pipe is fully buffered: a write error (EPIPE, ENOSPC) shows only here */
    if (fflush(stdout) || ferror(stdout)) {
        fprintf(stderr, "upsquad-agents: writing the output failed\n");
        if (!rc) rc = 1;
    }
    return rc;
}

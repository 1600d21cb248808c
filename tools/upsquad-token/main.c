/* upsquad-token: mints a development token (HS256) for local runs.
 *
 *   upsquad-token --sub S --org O [--clearance N] [--team T]... [--ttl SECONDS] [--iss ISSUER]
 *
 * The secret comes from UPSQUAD_JWT_SECRET (or the file named by UPSQUAD_JWT_SECRET_FILE),
 * the audience from UPSQUAD_JWT_AUDIENCE (default "upsquad"), the issuer from --iss or
 * UPSQUAD_JWT_ISSUER (default: none). Prints the token and a newline on stdout. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth.h"
#include "cfg.h"
#include "log.h"

static char *tok_secret, *tok_audience, *tok_issuer;
static const cfg_var tok_cfg[] = {
    {"UPSQUAD_JWT_SECRET", CFG_STR, NULL, "HS256 signing secret (at least 32 bytes)", &tok_secret,
     0, 0, CFG_REQUIRED | CFG_SECRET},
    {"UPSQUAD_JWT_AUDIENCE", CFG_STR, "upsquad", "audience (`aud`) of the token", &tok_audience, 0,
     0, 0},
    {"UPSQUAD_JWT_ISSUER", CFG_STR, NULL, "issuer (`iss`) of the token; --iss wins", &tok_issuer, 0,
     0, 0},
};
#define TOK_NCFG (sizeof tok_cfg / sizeof tok_cfg[0])

static void usage(FILE *f) {
    fprintf(f, "usage: upsquad-token --sub SUB --org ORG_ID [--clearance 1..5] [--team TEAM]...\n"
               "                     [--ttl SECONDS] [--iss ISSUER]\n"
               "Mints an HS256 development token. Environment:\n\n");
    cfg_print_markdown(tok_cfg, TOK_NCFG, f);
}

static int parse_long(const char *s, long long lo, long long hi, long long *out) {
    char *end;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {{"sub", required_argument, 0, 's'},
                                         {"org", required_argument, 0, 'o'},
                                         {"clearance", required_argument, 0, 'c'},
                                         {"team", required_argument, 0, 't'},
                                         {"ttl", required_argument, 0, 'l'},
                                         {"iss", required_argument, 0, 'i'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *teams[AUTH_MAX_TEAMS];
    auth_claims c = {.clearance = 5, .ttl_s = 3600};
    auth_signer *signer = NULL;
    char err[512], *token = NULL;
    long long v;
    int opt, rc = 2;

    log_init_env("upsquad-token");
    while ((opt = getopt_long(argc, argv, "s:o:c:t:l:i:h", opts, NULL)) != -1) {
        switch (opt) {
        case 's':
            c.sub = optarg;
            break;
        case 'o':
            c.org_id = optarg;
            break;
        case 'i':
            c.issuer = optarg;
            break;
        case 'c':
            if (parse_long(optarg, 1, 5, &v) != 0) {
                fprintf(stderr, "upsquad-token: --clearance must be 1..5\n");
                return 2;
            }
            c.clearance = (int)v;
            break;
        case 'l':
            if (parse_long(optarg, 1, 366LL * 86400, &v) != 0) {
                fprintf(stderr, "upsquad-token: --ttl must be 1..31622400 seconds\n");
                return 2;
            }
            c.ttl_s = v;
            break;
        case 't':
            if (c.n_teams == AUTH_MAX_TEAMS) {
                fprintf(stderr, "upsquad-token: at most %d --team\n", AUTH_MAX_TEAMS);
                return 2;
            }
            teams[c.n_teams++] = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind != argc || !c.sub || !c.org_id) {
        usage(stderr);
        return 2;
    }
    if (cfg_load(tok_cfg, TOK_NCFG, err, sizeof err) != 0) {
        fprintf(stderr, "upsquad-token: %s\n", err);
        return 2;
    }
    c.teams = teams;
    c.audience = tok_audience;
    if (!c.issuer) c.issuer = tok_issuer;
    if (auth_signer_new("HS256", tok_secret, &signer, err, sizeof err) != AUTH_OK ||
        auth_mint(signer, &c, &token, err, sizeof err) != AUTH_OK) {
        fprintf(stderr, "upsquad-token: %s\n", err);
        rc = 1;
        goto done;
    }
    printf("%s\n", token);
    rc = fflush(stdout) == 0 ? 0 : 1;
done:
    free(token);
    auth_signer_free(signer);
    cfg_free(tok_cfg, TOK_NCFG);
    return rc;
}

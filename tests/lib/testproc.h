/* Test helper (header-only): start a service executable on a free loopback port, read the
 * "port=N" / "metrics_port=M" lines it prints, stop it by pid. */
#ifndef UPSQUAD_TESTPROC_H
#define UPSQUAD_TESTPROC_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct testproc {
    pid_t pid;
    int port, metrics_port;
    FILE *out;
} testproc;

/* env: NULL-terminated "NAME=value" overrides added to the current environment. */
static int testproc_start(testproc *p, const char *binary, const char *const *env) {
    int fds[2];
    char line[128];
    memset(p, 0, sizeof *p);
    if (pipe(fds) != 0) return -1;
    p->pid = fork();
    if (p->pid < 0) return -1;
    if (p->pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        setenv("UPSQUAD_GRPC_ADDR", "127.0.0.1:0", 1);
        setenv("UPSQUAD_METRICS_ADDR", "127.0.0.1:0", 1);
        setenv("UPSQUAD_LOG_LEVEL", "warn", 1);
        for (size_t i = 0; env && env[i]; i++)
            putenv((char *)env[i]);
        execl(binary, binary, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    p->out = fdopen(fds[0], "r");
    while (p->out && fgets(line, sizeof line, p->out)) {
        if (strncmp(line, "port=", 5) == 0) p->port = atoi(line + 5);
        if (strncmp(line, "metrics_port=", 13) == 0) {
            p->metrics_port = atoi(line + 13);
            break;
        }
    }
    return p->port > 0 ? 0 : -1;
}

/* SIGTERM, then wait; returns the exit status (or -1). */
static int testproc_stop(testproc *p) {
    int st = 0;
    if (p->pid <= 0) return -1;
    kill(p->pid, SIGTERM);
    waitpid(p->pid, &st, 0);
    p->pid = 0;
    if (p->out) fclose(p->out);
    p->out = NULL;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* GET http://127.0.0.1:port/path into buf (NUL-terminated); returns bytes read or -1. */
static int test_http_get(int port, const char *path, char *buf, size_t len) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    int fd = socket(AF_INET, SOCK_STREAM, 0), n = 0, r;
    char req[256];
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n", path);
    if (write(fd, req, strlen(req)) < 0) n = -1;
    while (n >= 0 && (size_t)n < len - 1 && (r = (int)read(fd, buf + n, len - 1 - (size_t)n)) > 0)
        n += r;
    close(fd);
    if (n >= 0) buf[n] = 0;
    return n;
}

/* Value of one metric series ("name{labels}") in a /metrics page, 0 when absent. */
static double test_metric(int port, const char *series) {
    static char page[1 << 20];
    if (test_http_get(port, "/metrics", page, sizeof page) < 0) return -1;
    size_t n = strlen(series);
    for (char *l = page; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (strncmp(l, series, n) == 0 && l[n] == ' ') return atof(l + n + 1);
    return 0;
}

#endif

/* Test helper (header-only): start a program that prints "ready" on stdout once it serves
 * (devtools, wf-responder), wait for that line within a bound, stop it by pid. */
#ifndef UPSQUAD_READYPROC_H
#define UPSQUAD_READYPROC_H

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct readyproc {
    pid_t pid;
    int out; /* read end of the program's stdout */
} readyproc;

/* env: NULL-terminated "NAME=value" overrides added to the current environment. Waits up to
 * timeout_ms for the "ready" line; 0 on success, -1 otherwise (the program is then stopped). */
static int readyproc_start(readyproc *p, const char *binary, const char *const *env,
                           int timeout_ms) {
    int fds[2];
    memset(p, 0, sizeof *p);
    if (pipe(fds) != 0) return -1;
    p->pid = fork();
    if (p->pid < 0) return -1;
    if (p->pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        if (!getenv("UPSQUAD_LOG_LEVEL")) setenv("UPSQUAD_LOG_LEVEL", "warn", 1);
        for (size_t i = 0; env && env[i]; i++)
            putenv((char *)env[i]);
        execl(binary, binary, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    p->out = fds[0];
    char buf[256];
    size_t len = 0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        int left =
            timeout_ms - (int)((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000);
        struct pollfd pf = {.fd = p->out, .events = POLLIN};
        if (left <= 0 || poll(&pf, 1, left) <= 0) break;
        ssize_t n = read(p->out, buf + len, sizeof buf - 1 - len);
        if (n <= 0) break;
        len += (size_t)n;
        buf[len] = '\0';
        if (strstr(buf, "ready\n")) return 0;
        if (len == sizeof buf - 1) len = 0;
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    close(p->out);
    p->pid = 0;
    return -1;
}

/* SIGTERM, then wait; returns the exit status, or -1 when it did not exit normally. */
static int readyproc_stop(readyproc *p) {
    int st = 0;
    if (p->pid <= 0) return -1;
    kill(p->pid, SIGTERM);
    waitpid(p->pid, &st, 0);
    p->pid = 0;
    close(p->out);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#endif

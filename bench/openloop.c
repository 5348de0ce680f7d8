/* openloop: a small open-loop HTTP/1.1 load generator (epoll, one thread, keep-alive).
 *
 * Why: wrk is a closed loop. Each of its connections sends the next request only when the
 * previous answer arrived, and it measures latency from that send. When the server stalls
 * (a GC pause, a slow Redis round trip), wrk simply sends less, and the requests that *would*
 * have been sent during the stall are never measured: coordinated omission. A real crowd of
 * pollers does not wait for the server, so here request k is *scheduled* at
 * t0 + k / rate, whatever happens, and its latency runs from that intended time to the end
 * of its response. If no connection is free when a request is due, it waits in a backlog and
 * that wait is part of its latency.
 *
 * Usage: openloop -p PORT -r RATE -d SECONDS [-w WARMUP_S] [-c CONNS] [-t DRAIN_S] -f FILE
 *   FILE holds complete raw HTTP requests, each followed by one NUL byte; they are sent in
 *   order, round-robin (the bench shuffles them for a mix). Host is always 127.0.0.1.
 * Output: one JSON object on stdout. Latencies of requests scheduled during the warm-up are
 * not recorded. Responses must carry Content-Length (Starlette sets it; a 304 has none and
 * no body).
 *
 * Build: gcc -O2 -o openloop openloop.c   (the bench does it)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BUF 65536

typedef struct {
    int fd;
    int busy;            /* a request is in flight */
    int64_t intended;    /* its intended send time (ns) */
    const char *out;     /* bytes still to write */
    size_t out_left;
    char in[BUF];        /* response bytes read so far */
    size_t in_len;
} conn_t;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int port, nconns = 200, epfd;
static struct sockaddr_in addr;
static conn_t *conns;
static int *idle, nidle;             /* stack of free connections */
static char **reqs;                  /* the request file, split at NUL */
static size_t *req_len, nreqs;
static int64_t *lat;                 /* recorded latencies (ns) */
static size_t nlat, cap_lat;
static long status_count[6];         /* by first digit: 1xx..5xx; [0] = unparsable */
static long errors_connect, errors_io, responses, sent;

static int open_conn(conn_t *c) {
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (c->fd < 0) return -1;
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) < 0 && errno != EINPROGRESS) {
        close(c->fd);
        return -1;
    }
    c->busy = 0;
    c->in_len = 0;
    c->out_left = 0;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    return epoll_ctl(epfd, EPOLL_CTL_ADD, c->fd, &ev);
}

/* A connection failed: count it, drop its request, reconnect, and make it free again. */
static void reset_conn(conn_t *c) {
    int was_busy = c->busy;
    if (was_busy) errors_io++;
    epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    while (open_conn(c) < 0) {
        errors_connect++;
        usleep(1000);
    }
    if (was_busy) idle[nidle++] = (int)(c - conns); /* an idle one is on the stack already */
}

static void want_write(conn_t *c, int on) {
    struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

static void flush_out(conn_t *c) {
    while (c->out_left) {
        ssize_t n = write(c->fd, c->out, c->out_left);
        if (n < 0) {
            if (errno == EAGAIN) { want_write(c, 1); return; }
            reset_conn(c);
            return;
        }
        c->out += n;
        c->out_left -= (size_t)n;
    }
    want_write(c, 0);
}

static void send_req(conn_t *c, size_t k, int64_t intended) {
    c->busy = 1;
    c->intended = intended;
    c->out = reqs[k % nreqs];
    c->out_left = req_len[k % nreqs];
    sent++;
    flush_out(c);
}

/* Length of a complete response at the start of c->in, or 0 if more bytes are needed. */
static size_t complete_len(conn_t *c, int *status) {
    c->in[c->in_len] = 0;
    char *end = strstr(c->in, "\r\n\r\n");
    if (!end) return 0;
    size_t head = (size_t)(end - c->in) + 4;
    *status = (c->in_len > 12 && !strncmp(c->in, "HTTP/1.", 7)) ? atoi(c->in + 9) : 0;
    size_t body = 0;
    for (char *p = c->in; p < end; p++) {
        if (*p == '\n' && !strncasecmp(p + 1, "content-length:", 15)) {
            body = strtoul(p + 16, NULL, 10);
            break;
        }
    }
    return c->in_len >= head + body ? head + body : 0;
}

static void on_readable(conn_t *c, int64_t warm_end, int64_t t_end) {
    for (;;) {
        if (c->in_len >= BUF - 1) { reset_conn(c); return; } /* response too large */
        ssize_t n = read(c->fd, c->in + c->in_len, BUF - 1 - c->in_len);
        if (n == 0) { reset_conn(c); return; }
        if (n < 0) {
            if (errno == EAGAIN) return;
            reset_conn(c);
            return;
        }
        c->in_len += (size_t)n;
        int status;
        size_t len = complete_len(c, &status);
        if (len == 0) continue;
        if (!c->busy) { reset_conn(c); return; } /* bytes nobody asked for */
        int64_t t = now_ns();
        responses++;
        status_count[(status >= 100 && status < 600) ? status / 100 : 0]++;
        if (c->intended >= warm_end && c->intended < t_end && nlat < cap_lat)
            lat[nlat++] = t - c->intended;
        memmove(c->in, c->in + len, c->in_len - len);
        c->in_len -= len;
        c->busy = 0;
        idle[nidle++] = (int)(c - conns);
        return;
    }
}

/* Nearest-rank percentile over every request scheduled in the measured window: requests
 * never sent or never answered count as infinitely slow (-1 = beyond what was recorded), so a
 * saturated server cannot look fast by dropping its slowest requests from the sample. */
static size_t window;
static int64_t pct(double q) {
    if (!window) return -1;
    size_t i = (size_t)(q / 100.0 * (double)window + 0.999999);
    if (i < 1) i = 1;
    if (i > nlat) return -1;
    return lat[i - 1];
}

static double pct_ms(double q) {
    int64_t v = pct(q);
    return v < 0 ? -1.0 : (double)v / 1e6;
}

static void load_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    rewind(f);
    char *data = malloc((size_t)size + 1);
    if (fread(data, 1, (size_t)size, f) != (size_t)size) { perror("read"); exit(2); }
    fclose(f);
    for (long i = 0; i < size; i++) nreqs += data[i] == 0;
    reqs = malloc(nreqs * sizeof *reqs);
    req_len = malloc(nreqs * sizeof *req_len);
    size_t k = 0;
    char *start = data;
    for (long i = 0; i < size; i++) {
        if (data[i] == 0) {
            reqs[k] = start;
            req_len[k++] = (size_t)(data + i - start);
            start = data + i + 1;
        }
    }
    if (!nreqs) { fprintf(stderr, "no requests in %s\n", path); exit(2); }
}

int main(int argc, char **argv) {
    double rate = 1000, duration = 10, warmup = 2, drain = 10;
    const char *file = NULL;
    int opt;
    while ((opt = getopt(argc, argv, "p:r:d:w:c:t:f:")) != -1) {
        switch (opt) {
        case 'p': port = atoi(optarg); break;
        case 'r': rate = atof(optarg); break;
        case 'd': duration = atof(optarg); break;
        case 'w': warmup = atof(optarg); break;
        case 'c': nconns = atoi(optarg); break;
        case 't': drain = atof(optarg); break;
        case 'f': file = optarg; break;
        default: fprintf(stderr, "see the header of openloop.c\n"); return 2;
        }
    }
    if (!port || !file || rate <= 0) { fprintf(stderr, "need -p, -r and -f\n"); return 2; }
    load_file(file);

    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)port);
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    epfd = epoll_create1(0);
    conns = calloc((size_t)nconns, sizeof *conns);
    idle = malloc((size_t)nconns * sizeof *idle);
    for (int i = 0; i < nconns; i++) {
        if (open_conn(&conns[i]) < 0) { perror("connect"); return 1; }
        idle[nidle++] = i;
    }
    usleep(200000); /* let the connections establish before the clock starts */

    const int64_t interval = (int64_t)(1e9 / rate);
    const int64_t t0 = now_ns();
    const int64_t warm_end = t0 + (int64_t)(warmup * 1e9);
    const int64_t t_end = warm_end + (int64_t)(duration * 1e9);
    const int64_t hard_end = t_end + (int64_t)(drain * 1e9);
    const size_t total = (size_t)((t_end - t0) / interval);
    cap_lat = (size_t)(duration * rate) + 16;
    lat = malloc(cap_lat * sizeof *lat);
    size_t next = 0;        /* next request to send (its intended time is t0 + next*interval) */
    size_t max_backlog = 0; /* most requests that were due but had no free connection */
    struct epoll_event events[256];

    for (;;) {
        int64_t t = now_ns();
        if (t >= hard_end) break;
        /* send everything that is due, as long as connections are free */
        while (next < total && t0 + (int64_t)next * interval <= t && nidle > 0) {
            conn_t *c = &conns[idle[--nidle]];
            send_req(c, next, t0 + (int64_t)next * interval);
            next++;
        }
        if (next < total) {
            size_t due = (size_t)((t - t0) / interval) + 1;
            if (due > total) due = total;
            if (due > next && due - next > max_backlog) max_backlog = due - next;
        } else if (nidle == nconns) {
            break; /* all sent, all answered */
        }
        /* sleep until the next request is due, or a socket is ready (ns-precision wait) */
        struct timespec wait = {0, 0};
        if (next < total && nidle > 0) {
            int64_t d = t0 + (int64_t)next * interval - now_ns();
            if (d > 0) { wait.tv_sec = d / 1000000000LL; wait.tv_nsec = d % 1000000000LL; }
        } else {
            wait.tv_nsec = 1000000; /* backlogged or draining: wake at least every ms */
        }
        int n = epoll_pwait2(epfd, events, 256, &wait, NULL);
        for (int i = 0; i < n; i++) {
            conn_t *c = events[i].data.ptr;
            if (events[i].events & (EPOLLERR | EPOLLHUP)) { reset_conn(c); continue; }
            if (events[i].events & EPOLLOUT) flush_out(c);
            if (events[i].events & EPOLLIN) on_readable(c, warm_end, t_end);
        }
    }
    int64_t finished = now_ns();
    long in_flight = 0;
    for (int i = 0; i < nconns; i++) in_flight += conns[i].busy;

    size_t first = (size_t)((warm_end - t0 + interval - 1) / interval);
    window = total > first ? total - first : 0;
    qsort(lat, nlat, sizeof *lat, cmp_i64);
    double sum = 0;
    for (size_t i = 0; i < nlat; i++) sum += (double)lat[i];
    printf("{\"rate\": %.0f, \"duration\": %.3f, \"warmup\": %.3f, \"connections\": %d,"
           " \"scheduled\": %zu, \"sent\": %ld, \"responses\": %ld, \"measured\": %zu,"
           " \"recorded\": %zu, \"unsent\": %zu, \"unanswered\": %ld,"
           " \"elapsed\": %.3f, \"achieved_rps\": %.1f, \"max_backlog\": %zu,"
           " \"errors\": {\"connect\": %ld, \"io\": %ld},"
           " \"status\": {\"1xx\": %ld, \"2xx\": %ld, \"3xx\": %ld, \"4xx\": %ld, \"5xx\": %ld,"
           " \"other\": %ld},"
           " \"latency_ms\": {\"mean\": %.3f, \"p50\": %.3f, \"p90\": %.3f, \"p99\": %.3f,"
           " \"p99.9\": %.3f, \"max\": %.3f}}\n",
           rate, duration, warmup, nconns, total, sent, responses, window, nlat,
           total - next, in_flight, (double)(finished - t0) / 1e9,
           (double)nlat / duration, max_backlog, errors_connect, errors_io, status_count[1],
           status_count[2], status_count[3], status_count[4], status_count[5], status_count[0],
           nlat ? sum / (double)nlat / 1e6 : -1.0, pct_ms(50), pct_ms(90), pct_ms(99),
           pct_ms(99.9), nlat ? (double)lat[nlat - 1] / 1e6 : -1.0);
    return 0;
}

#define _GNU_SOURCE
// The floor of any HTTP server on this machine (bench/throughput.py's "HTTP floor, C" row): a
// do-nothing HTTP/1.1 responder in C, epoll, one fixed answer (the size of the scorer's) per read.
// It parses nothing, so it is only right for a closed-loop generator with one request in flight per
// connection, each sent in one write (wrk without pipelining). Binds 127.0.0.1 only, SO_REUSEPORT
// (several may serve one port). Usage: floor PORT
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <fcntl.h>
#define BODY "{\"model_name\":\"scorer\",\"model_version\":\"v1\",\"id\":\"0123456789abcdef.v1\",\"outputs\":" \
  "[{\"name\":\"score\",\"datatype\":\"FP32\",\"shape\":[1,1],\"data\":[0.5]}]}"
static const char HEAD[] = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n\r\n%s";
int main(int argc, char **argv) {
  if (argc != 2) { fprintf(stderr, "usage: floor PORT\n"); return 2; }
  int port = atoi(argv[1]), one = 1;
  char answer[512];
  int alen = snprintf(answer, sizeof answer, HEAD, sizeof BODY - 1, BODY);
  int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  setsockopt(ls, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
  struct sockaddr_in a = {0}; a.sin_family = AF_INET; a.sin_port = htons(port); a.sin_addr.s_addr = htonl(0x7f000001);
  if (bind(ls, (void *)&a, sizeof a) || listen(ls, 512)) { perror("bind"); return 1; }
  int ep = epoll_create1(0);
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls}, evs[256];
  epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
  char buf[65536];
  for (;;) {
    int n = epoll_wait(ep, evs, 256, -1);
    for (int i = 0; i < n; i++) {
      int fd = evs[i].data.fd;
      if (fd == ls) {
        int c;
        while ((c = accept4(ls, 0, 0, SOCK_NONBLOCK)) >= 0) {
          setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          struct epoll_event ce = {.events = EPOLLIN, .data.fd = c};
          epoll_ctl(ep, EPOLL_CTL_ADD, c, &ce);
        }
        continue;
      }
      ssize_t r = read(fd, buf, sizeof buf);
      if (r <= 0) { close(fd); continue; }
      if (write(fd, answer, alen) < 0) close(fd);
    }
  }
}

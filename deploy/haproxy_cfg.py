"""Writes an HAProxy configuration for K xllm_async replicas on one host.

    python deploy/haproxy_cfg.py --replicas 8 --base-port 8001 --listen 0.0.0.0:8000 > /etc/haproxy/haproxy.cfg

Every choice below is there so that restarting or losing a replica costs as few requests as possible:
- health checks on /health: a replica that is draining (SIGTERM) answers 503 and leaves the rotation;
- `balance leastconn`: each request goes to the replica with the fewest outstanding requests, so a
  slow replica (a busier device, a larger batch) gets less, instead of a round-robin share;
- user affinity: a request with an `X-User-Id` header goes to the backend `users`, which hashes the
  header onto the same replicas (`hash-type consistent`: a replica that leaves moves only its own
  users), so that a user's next request meets the replica that served the last one (its history's
  keys and values, once replicas keep a prefix cache). `hash-balance-factor` bounds the load: a
  replica with more than that share of the average outstanding requests (150 = 1.5x) passes the
  next user on to the following replica of the ring, so one hot user cannot overload a replica.
  Its servers `track` the other backend's, so each replica is health-checked once;
- `retry-on conn-failure empty-response` and `option redispatch 1`: a request is retried, on another
  replica, when the connection could not be made or closed before any byte of an answer came back.
  A completion has no side effects, so the retry costs compute, not correctness. It covers the
  connection a draining replica's kernel completes between the replica's last accept and the
  close of its listener (reset with the request unread: a 502 without it, one in 6,000 requests
  of a rolling restart under load) and a replica that dies before answering. A stream that has
  begun is never retried;
- `option http-server-close`: one request per connection to a replica, so no request is ever sent
  on a kept-alive connection that a draining replica is closing (the classic lost request); a new
  connection to a replica that stopped listening is refused at once, and retried elsewhere;
- timeouts long enough for a queued request and for the gaps of a token stream;
- the client's X-Request-Id is passed through (the replica echoes it and logs it); a request
  without one gets a fresh one here, so the balancer's log and the replica's access log share it.
"""

from __future__ import annotations

import argparse
import sys

GLOBAL = """\
global
{maxconn}    log stdout format raw local0
{stats}
defaults
    mode http
    log global
    # request id, replica, status, termination state, retries, total ms
    log-format "%[capture.req.hdr(0)] %b/%s %ST %tsc %rc %Ta"
    option http-server-close
    option http-no-delay
    option redispatch 1
    retries {retries}
    retry-on conn-failure empty-response
    timeout connect {connect_timeout}
    timeout client {stream_timeout}
    timeout server {stream_timeout}
    timeout http-request 30s
    timeout http-keep-alive 30s
    timeout queue 30s
    timeout check {check_timeout}

frontend xllm
    bind {listen}
    http-request set-header X-Request-Id %[uuid] unless {{ req.hdr(x-request-id) -m found }}
    http-request capture req.hdr(x-request-id) len 128
    use_backend users if {{ req.hdr(x-user-id) -m found }}
    default_backend replicas

backend replicas
    balance {balance}
    option httpchk GET /health
    http-check expect status 200
    default-server check inter {inter} fall {fall} rise {rise}
"""

USERS = """
backend users
    balance hdr(x-user-id)
    hash-type consistent
    hash-balance-factor {factor}
"""


def render(servers: list[str], listen: str = "127.0.0.1:8000", balance: str = "leastconn", inter: str = "1s",
           fall: int = 1, rise: int = 2, stats_socket: str | None = None, retries: int = 3,
           connect_timeout: str = "2s", stream_timeout: str = "300s", maxconn: int | None = None,
           balance_factor: int = 150) -> str:
    """The configuration text for `servers` (host:port each, named r0, r1, ...). Without `maxconn`,
    HAProxy derives it from the open-files limit it runs under."""
    maxconn_line = f"    maxconn {maxconn}\n" if maxconn else ""
    stats = f"    stats socket {stats_socket} mode 600 level admin\n" if stats_socket else ""
    text = GLOBAL.format(maxconn=maxconn_line, stats=stats, retries=retries, connect_timeout=connect_timeout,
                         stream_timeout=stream_timeout, check_timeout=connect_timeout, listen=listen,
                         balance=balance, inter=inter, fall=fall, rise=rise)
    text += "".join(f"    server r{i} {address}\n" for i, address in enumerate(servers))
    text += USERS.format(factor=balance_factor)
    return text + "".join(f"    server r{i} {address} track replicas/r{i}\n" for i, address in enumerate(servers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=8, help="K replicas on consecutive ports")
    parser.add_argument("--base-port", type=int, default=8001, help="port of the first replica")
    parser.add_argument("--host", default="127.0.0.1", help="address the replicas listen on")
    parser.add_argument("--server", action="append", default=[], metavar="HOST:PORT",
                        help="a replica's address (repeatable; replaces --replicas/--base-port)")
    parser.add_argument("--listen", default="127.0.0.1:8000", help="address:port HAProxy listens on")
    parser.add_argument("--balance", default="leastconn", choices=["leastconn", "roundrobin"])
    parser.add_argument("--inter", default="1s", help="health check interval (HAProxy time: 200ms, 1s)")
    parser.add_argument("--fall", type=int, default=1, help="failed checks before a replica leaves")
    parser.add_argument("--rise", type=int, default=2, help="passed checks before a replica comes back")
    parser.add_argument("--stats-socket", help="unix socket for HAProxy's runtime API (show stat, set server)")
    parser.add_argument("--stream-timeout", default="300s", help="longest silence of a client or a replica")
    parser.add_argument("--balance-factor", type=int, default=150,
                        help="X-User-Id affinity: a replica takes a user's request while its outstanding "
                             "requests are within this percentage of the average (hash-balance-factor)")
    args = parser.parse_args(argv)
    servers = args.server or [f"{args.host}:{args.base_port + i}" for i in range(args.replicas)]
    sys.stdout.write(render(servers, args.listen, args.balance, args.inter, args.fall, args.rise,
                            args.stats_socket, stream_timeout=args.stream_timeout,
                            balance_factor=args.balance_factor))
    return 0


if __name__ == "__main__":
    sys.exit(main())

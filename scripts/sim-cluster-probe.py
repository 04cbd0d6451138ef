#!/usr/bin/python3
"""The simulated cluster's link probe (scripts/sim-cluster.sh --probe): TCP round trips of one
byte and a bulk transfer between two hosts, printed as measured (no latency is assumed)."""
import socket
import sys
import time

PORT = 45123
ROUNDS = 2000
BULK = 64 << 20  # bytes sent for the bandwidth figure


def serve(addr):
    with socket.create_server((addr, PORT)) as srv:
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(ROUNDS):
                conn.sendall(conn.recv(1))
            left = BULK
            while left > 0:
                got = conn.recv(min(left, 1 << 20))
                if not got:
                    break
                left -= len(got)
            conn.sendall(b"k")


def measure(addr):
    end = time.monotonic() + 10
    while True:
        try:
            conn = socket.create_connection((addr, PORT), timeout=30)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(ROUNDS):
            t = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            rtts.append(time.perf_counter() - t)
        rtts.sort()
        chunk = b"\0" * (1 << 20)
        t = time.perf_counter()
        for _ in range(BULK // len(chunk)):
            conn.sendall(chunk)
        conn.recv(1)
        secs = time.perf_counter() - t
    print(f"sim-cluster: probe h0 -> {addr}: TCP round trip median {rtts[len(rtts) // 2] * 1e6:.0f} us "
          f"(p90 {rtts[len(rtts) * 9 // 10] * 1e6:.0f} us), bulk {BULK * 8 / secs / 1e9:.3f} Gbit/s "
          f"({BULK >> 20} MiB in {secs:.3f} s)", file=sys.stderr)


if __name__ == "__main__":
    {"serve": serve, "measure": measure}[sys.argv[1]](sys.argv[2])

#!/usr/bin/env python3
"""What polling the replicas' feeds costs Envoy while no request flows (docs/reports/feed-cost.md).

Two measurements, each a table:

- `--part dead`: 4 live simulated replicas and 252 configured ones with nothing listening (256 in
  all, the filter's most), Envoy `--concurrency 2`, under the default `feed_backoff_max_ms` (3000),
  with the backoff off (`feed_backoff_max_ms` equal to `feed_period_ms`), and the 4 live replicas
  alone. Per row: Envoy's CPU (utime+stime from /proc, ms of CPU per s of wall time; its main
  thread apart), the connect attempts per second per dead replica on the feed clusters
  (`upstream_cx_total`, all of which fail: `upstream_cx_connect_fail`), the failed polls the
  filter counts for them (`kvsteer_feed_errors_<replica>`), and the active health checks of the
  `replicas` cluster (`health_check.attempt`, per host: Envoy's own, not the filter's). A fourth
  row sets `feed_backoff_max_ms` to 60000, so that what is left is what 256 configured replicas
  cost whatever their state (Envoy's health checks among it); a fifth serves the 252 from one
  simulator until Envoy has polled every feed, then kills it (dead replicas the filter had seen,
  whose polls go to one VM, the lease holder: a replica never seen is polled by every VM, each
  needing a snapshot of its own).
- `--part live`: 128 live replicas served by one `kvsteer-sim serve --replicas 128` process, against
  4, Envoy `--concurrency 8` by default. Per row: feed polls per second for the proxy (the feed
  clusters' `upstream_rq_total`), Envoy's and the simulator's CPU ms/s while idle, and then, at 1
  request in flight, the p50 of `--requests` small completions (64 token ids, 1 output token)
  through Envoy, interleaved with as many sent straight to one replica (what Envoy and the filter
  add is the difference).

Each configuration gets fresh replicas and a fresh Envoy; after Envoy is ready and the live feeds
are polled, `--settle` s pass (the dead replicas' backoff reaches its longest wait within about
4 s) before the `--seconds` s window. Loopback only; every process it starts is stopped at the
end (or when it is interrupted), as in every e2e script (`e2e/stack.py`). Not a test: it prints
figures.

    .venv/bin/python e2e/bench_feed_cost.py                  # both parts, about 8 minutes
    .venv/bin/python e2e/bench_feed_cost.py --part dead --seconds 30
    .venv/bin/python e2e/bench_feed_cost.py --part live --requests 200
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from client import Client, tokens  # noqa: E402
from stack import Replica, Stack, StackError, free_ports, sim_path  # noqa: E402

TICK_S = os.sysconf("SC_CLK_TCK")
FEED_PERIOD_MS = 200  # envoy/envoy.yaml's feed_period_ms


def cpu_ms(pid: int) -> dict[str, float]:
    """CPU time used so far (utime+stime, ms): the whole process, its main thread (tid == pid:
    Envoy's main thread, which polls the feeds), and its worker threads (`wrk:*`)."""
    def stat(path: Path) -> tuple[str, float]:
        text = path.read_text()
        comm = text[text.index("(") + 1:text.rindex(")")]
        f = text[text.rindex(")") + 2:].split()
        return comm, (int(f[11]) + int(f[12])) * 1000.0 / TICK_S
    out = {"total": stat(Path(f"/proc/{pid}/stat"))[1], "main": 0.0, "workers": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm, ms = stat(task / "stat")
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        if int(task.name) == pid:
            out["main"] = ms
        elif comm.startswith("wrk:"):
            out["workers"] += ms
    return out


def ports_free(base: int, n: int) -> bool:
    socks = []
    try:
        for p in range(base, base + n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def start_fleet(s: Stack, n: int, time_scale: str, prefix: str = "r") -> None:
    """`n` simulated replicas from one `kvsteer-sim serve --replicas n` process, on consecutive
    ports, named <prefix>0..<prefix>{n-1} in the filter's configuration."""
    import random
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20000, 60000 - n)
        if ports_free(base, n):
            break
    else:
        raise StackError(f"no {n} consecutive free ports")
    argv = [str(sim_path()), "serve", "--replicas", str(n), "--host", "127.0.0.1", "--port",
            str(base), "--name-prefix", prefix, "--time-scale", time_scale]
    proc = s.spawn(f"sim-{prefix}{n}", argv)
    deadline = time.monotonic() + 60
    while sum(ln.startswith("ready ") for ln in proc.lines) < n:
        if not proc.alive():
            raise StackError(f"sim exited:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise StackError(f"sim not ready in 60 s:\n{proc.tail()}")
        time.sleep(0.05)
    names = {}
    for ln in proc.lines:
        if ln.startswith("ready "):
            _, name, ep = ln.split()
            names[int(ep.rsplit(":", 1)[1])] = name
    for i in range(n):
        s.replicas.append(Replica(f"{prefix}{i}", base + i, proc, names.get(base + i, "")))


def start_envoy(s: Stack, concurrency: int, plugin: dict | None) -> None:
    """Envoy with envoy/envoy.yaml for every replica in `s.replicas` (dead ones too): ready once
    the live replicas are healthy in the `replicas` cluster and their feeds were polled."""
    live = [r for r in s.replicas if r.proc is not None]
    # Stack.start_envoy waits for every host to pass its health checks; dead ones never do.
    s.wait_healthy = lambda *a, **k: None  # type: ignore[method-assign]
    s.start_envoy("envoy", concurrency=concurrency, plugin_overrides=plugin, wait_feeds=False)
    deadline = time.monotonic() + 60
    want = {r.endpoint for r in live}
    while not want <= s.healthy_hosts("replicas"):
        if time.monotonic() > deadline:
            raise StackError("live replicas not healthy in 60 s")
        time.sleep(0.2)
    while not all(s.feed_polls(r) > 0 for r in live):
        if time.monotonic() > deadline:
            raise StackError("live feeds not polled in 60 s")
        time.sleep(0.2)


FEED_STAT = re.compile(r"^cluster\.kvsteer_feed_(\w+?)\.(upstream_cx_total|upstream_cx_connect_fail|"
                       r"upstream_rq_total)$")


def snapshot(s: Stack) -> dict:
    """The counters a row is made of, per replica name where they are per replica."""
    feed: dict[tuple[str, str], int] = {}
    for k, v in s.stats(r"^cluster\.kvsteer_feed_").items():
        m = FEED_STAT.match(k)
        if m:
            feed[(m.group(1), m.group(2))] = v
    errors = {k.rsplit("kvsteer_feed_errors_", 1)[1]: v
              for k, v in s.stats("kvsteer_feed_errors_").items()}
    hc = s.stats(r"^cluster\.replicas\.health_check\.attempt$")
    return {"t": time.monotonic(), "feed": feed, "errors": errors,
            "hc": hc.get("cluster.replicas.health_check.attempt", 0)}


def window(s: Stack, sim_pid: int | None, seconds: float) -> dict:
    """Counters and CPU over `seconds` s of idle."""
    pid = s.envoy.popen.pid
    a = snapshot(s)
    c0, w0 = cpu_ms(pid), time.monotonic()
    s0 = cpu_ms(sim_pid)["total"] if sim_pid else 0.0
    time.sleep(seconds)
    c1, w1 = cpu_ms(pid), time.monotonic()
    s1 = cpu_ms(sim_pid)["total"] if sim_pid else 0.0
    b = snapshot(s)
    wall = w1 - w0
    span = b["t"] - a["t"]

    def per_s(names: set[str], stat: str) -> float:
        return sum(b["feed"].get((n, stat), 0) - a["feed"].get((n, stat), 0) for n in names) / span

    return {
        "cpu": (c1["total"] - c0["total"]) / wall,
        "main": (c1["main"] - c0["main"]) / wall,
        "workers": (c1["workers"] - c0["workers"]) / wall,
        "sim": (s1 - s0) / wall,
        "span": span,
        "per_s": per_s,
        "errors_per_s": lambda names: sum(b["errors"].get(n, 0) - a["errors"].get(n, 0)
                                          for n in names) / span,
        "hc_per_s": (b["hc"] - a["hc"]) / span,
    }


def p50_ms(s: Stack, n: int) -> tuple[float, float, int]:
    """`n` small completions through Envoy interleaved with `n` straight to r0, one at a time:
    their p50s in ms, and how many through Envoy failed."""
    via, direct = Client("127.0.0.1", s.listen_port), Client("127.0.0.1", s.replicas[0].port)
    tv, td, bad = [], [], 0
    try:
        for i in range(n + 20):  # the first 20 of each warm the connections up, not counted
            prompt = tokens(64, 7000 + i)
            rv = via.complete(prompt, max_tokens=1)
            rd = direct.complete(prompt[::-1], max_tokens=1)
            if i >= 20:
                bad += not rv.ok
                if rv.ok:
                    tv.append(rv.total_s * 1000)
                if rd.ok:
                    td.append(rd.total_s * 1000)
    finally:
        via.close()
        direct.close()
    return statistics.median(tv), statistics.median(td), bad


def dead_part(args) -> list[str]:
    rows = []
    # (label, dead replicas, plugin overrides, whether the dead ones were alive and seen first)
    configs = [
        ("4 live + 252 dead, default backoff (`feed_backoff_max_ms` 3000)", 252, None, False),
        ("4 live + 252 dead, backoff off (`feed_backoff_max_ms` 200)", 252,
         {"feed_backoff_max_ms": FEED_PERIOD_MS}, False),
        # The filter's polls of the dead nearly stopped: what remains is what 256 configured
        # replicas cost whatever their state (Envoy's own health checks of the `replicas` cluster,
        # every host once a second in envoy/envoy.yaml, among it).
        ("4 live + 252 dead, `feed_backoff_max_ms` 60000", 252, {"feed_backoff_max_ms": 60000},
         False),
        ("4 live alone", 0, None, False),
        # The 252 served by one simulator until every feed was polled, then that process killed:
        # each VM has seen them, so one VM (the lease holder) polls each, where a replica never
        # seen is polled by every VM (each needs a snapshot of its own).
        ("4 live + 252 killed after their feeds were seen, default backoff", 252, None, True),
    ]
    if args.dead_configs:
        configs = [configs[int(i)] for i in args.dead_configs.split(",")]
    for label, dead, plugin, killed in [c for _ in range(args.repeats) for c in configs]:
        with Stack() as s:
            start_fleet(s, 4, args.time_scale)
            if killed:
                start_fleet(s, dead, args.time_scale, prefix="d")
            else:
                for i, port in enumerate(free_ports(dead)):
                    s.replicas.append(Replica(f"d{i}", port, None))  # type: ignore[arg-type]
            start_envoy(s, args.dead_concurrency, plugin)
            if killed:
                s.replicas[-1].proc.kill()
            time.sleep(args.settle)
            w = window(s, None, args.seconds)
            dead_names = {r.name for r in s.replicas if r.proc is None or not r.proc.alive()}
            live_names = {r.name for r in s.replicas} - dead_names
            nd = max(1, len(dead_names))
            cx = w["per_s"](dead_names, "upstream_cx_total") / nd if dead else float("nan")
            fail = w["per_s"](dead_names, "upstream_cx_connect_fail") / nd if dead else float("nan")
            err = w["errors_per_s"](dead_names) / nd if dead else float("nan")
            live_polls = w["per_s"](live_names, "upstream_rq_total") / len(live_names)
            hc = w["hc_per_s"] / len(s.replicas)
            rows.append(f"| {label} | {w['cpu']:.0f} | {w['main']:.0f} | {w['workers']:.0f} | "
                        f"{cx:.2f} | {fail:.2f} | {err:.2f} | {live_polls:.2f} | {hc:.2f} |")
            print(rows[-1], flush=True)
    head = [f"Envoy `--concurrency {args.dead_concurrency}`, idle {args.seconds:g} s after "
            f"{args.settle:g} s settling; per dead replica and per live one, per second:",
            "",
            "| configuration | Envoy CPU ms/s | main thread | workers | feed connects / dead | "
            "of which failed | failed polls / dead (filter) | feed polls / live | health checks / host |",
            "|---|---|---|---|---|---|---|---|---|"]
    return head + rows


def live_part(args) -> list[str]:
    rows = []
    for n in [n for _ in range(args.repeats) for n in (4, args.replicas)]:
        with Stack() as s:
            start_fleet(s, n, args.time_scale)
            start_envoy(s, args.live_concurrency, None)
            time.sleep(args.settle)
            w = window(s, s.replicas[0].proc.popen.pid, args.seconds)
            names = {r.name for r in s.replicas}
            polls = w["per_s"](names, "upstream_rq_total")
            if args.requests:
                via, direct, bad = p50_ms(s, args.requests)
                req = f"{via:.2f} | {direct:.2f} | {via - direct:.2f} | {bad}"
            else:
                req = "- | - | - | -"
            rows.append(f"| {n} | {polls:.1f} | {polls / n:.2f} | {w['cpu']:.0f} | "
                        f"{w['main']:.0f} | {w['workers']:.0f} | {w['sim']:.0f} | {req} |")
            print(rows[-1], flush=True)
    head = [f"Envoy `--concurrency {args.live_concurrency}`, idle {args.seconds:g} s after "
            f"{args.settle:g} s settling; then {args.requests} completions one at a time "
            "(64 ids, 1 output token), each followed by one straight to r0:",
            "",
            "| live replicas | feed polls/s (proxy) | per replica | Envoy CPU ms/s | main thread | "
            "workers | simulator CPU ms/s | p50 via Envoy ms | p50 direct ms | added ms | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    return head + rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("dead", "live", "both"), default="both")
    ap.add_argument("--seconds", type=float, default=30.0, help="idle window per configuration")
    ap.add_argument("--settle", type=float, default=12.0, help="s after start before the window")
    ap.add_argument("--dead-concurrency", type=int, default=2)
    ap.add_argument("--live-concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200, help="0: no request-path p50")
    ap.add_argument("--time-scale", default="1000")
    ap.add_argument("--dead-configs", default="",
                    help="which of the dead part's rows, by index (e.g. 0,2); empty: all")
    ap.add_argument("--replicas", type=int, default=128, help="the live fleet set against 4")
    ap.add_argument("--repeats", type=int, default=1, help="each part's rows this many times, "
                    "interleaved")
    args = ap.parse_args()
    out = []
    if args.part in ("dead", "both"):
        out += ["", "Dead replicas' feed polling", ""] + dead_part(args)
    if args.part in ("live", "both"):
        out += ["", "Feed polling by live fleet size", ""] + live_part(args)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

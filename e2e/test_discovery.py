"""End-to-end: membership that changes at run time, through Envoy 1.40 (`--concurrency 2`) with
envoy/envoy-discovery.yaml, the built filter, `kvsteer-discover` serving a member list from a file,
and simulated replicas (docs/design/discovery.md).

`E2E_DISCOVERY_REPLICAS` simulated replicas (32 by default: a fleet at scale with churn; about
18 s on 2 cores) start, each its own process, and
the member list names the first half. A steady bounded client (4 threads, short completions of
distinct prompts) runs throughout while the list changes: the second half joins, then a bad list is
written (kvsteer-discover answers 503 for it, and the filter keeps the last good membership), then
the first quarter leaves. Every request must succeed; every joining replica must get requests once
it is listed; a replica that left gets none from one discovery period (500 ms) after its removal on.
Which replica answered is read from Envoy's per-host request counts of the `replicas` cluster.
"""

from __future__ import annotations

import json
import os
import threading
import time
import unittest
from pathlib import Path

import envoy_config
from client import Client, tokens
from stack import (Stack, StackError, envoy_path, free_ports, target_dir, wait_http,
                   wasm_path)

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "10")
REPLICAS = int(os.environ.get("E2E_DISCOVERY_REPLICAS", "32"))
CLIENTS = 4
PERIOD_S = 0.5  # discovery.period_ms in envoy-discovery.yaml


def discover_path() -> Path:
    return Path(os.environ.get("KVSTEER_DISCOVER") or target_dir() / "release" / "kvsteer-discover")


def endpoints(ports: list[int]) -> list[dict]:
    return [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
            for p in ports]


class Discovery(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        if not discover_path().exists():
            raise StackError(f"{discover_path()} not built: cargo build -p kvsteer-feed --release")
        cls.stack = s = Stack()
        try:
            s.start_replicas(REPLICAS, extra=["--time-scale", TIME_SCALE])
            cls.members_file = s.workdir / "members.json"
            cls.write_members(s.replicas[: REPLICAS // 2])
            disco_port, s.listen_port, s.admin_port = free_ports(3)
            cls.discover = s.spawn("discover", [
                str(discover_path()), "--listen", f"127.0.0.1:{disco_port}",
                "--members-file", str(cls.members_file)])
            wait_http(f"http://127.0.0.1:{disco_port}/health", 10, cls.discover)
            doc = envoy_config.rewrite(
                envoy_config.load("envoy-discovery"),
                [(r.name, r.endpoint) for r in s.replicas], s.listen_port, s.admin_port,
                str(wasm_path()),
                plugin_overrides={"discovery": {"max_members": max(16, REPLICAS)}})
            for c in doc["static_resources"]["clusters"]:
                if c["name"] == "kvsteer_discovery":
                    c["load_assignment"]["endpoints"] = [{"lb_endpoints": endpoints([disco_port])}]
            path = s.workdir / "envoy-discovery.json"
            path.write_text(json.dumps(doc, indent=1))
            s.envoy = s.spawn("envoy-discovery", [
                str(envoy_path()), "-c", str(path), "--concurrency", "2",
                "--base-id", str(int.from_bytes(os.urandom(3), "big") + 1000),
                "--log-level", "warn", "--component-log-level", "wasm:info"])
            wait_http(f"http://127.0.0.1:{s.admin_port}/ready", 60, s.envoy)
            s.variant = "envoy-discovery"
        except BaseException:
            s.close()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close()

    @classmethod
    def write_members(cls, replicas) -> None:
        doc = {"members": [{"name": r.name, "endpoint": r.endpoint} for r in replicas]}
        tmp = cls.members_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(cls.members_file)  # atomically: the server never reads half a list

    def served(self) -> dict[str, int]:
        """Requests each replica has been sent through the `replicas` cluster (Envoy's counts)."""
        by_port = {f"127.0.0.1:{r.port}": r.name for r in self.stack.replicas}
        out = {r.name: 0 for r in self.stack.replicas}
        for line in self.stack.admin("/clusters").splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == "replicas" and parts[2] == "rq_total":
                if parts[1] in by_port:
                    out[by_port[parts[1]]] = int(parts[3])
        return out

    def stat(self, name: str) -> int:
        """One of the filter's metrics (Envoy prefixes them `wasmcustom.`)."""
        return self.stack.stats(name).get(f"wasmcustom.{name}", 0)

    def wait_for(self, what: str, cond, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                self.fail(f"{what} not within {timeout_s} s: {self.served()}")
            time.sleep(0.1)

    def test_members_join_and_leave_while_a_client_runs(self) -> None:
        s = self.stack
        first, second = s.replicas[: REPLICAS // 2], s.replicas[REPLICAS // 2:]
        leaving = s.replicas[: max(1, REPLICAS // 4)]
        # The first members are seated before the client starts.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.stat("kvsteer_discovery_members") == len(first):
                break
            time.sleep(0.1)
        else:
            self.fail(f"discovery never seated {len(first)} members: {s.stats('kvsteer_discovery')}")
        results: list = []
        stop = threading.Event()
        lock = threading.Lock()

        def client(k: int) -> None:
            c = Client("127.0.0.1", s.listen_port, timeout_s=30)
            i = 0
            while not stop.is_set():
                r = c.complete(tokens(64, seed=k * 1_000_000 + i), max_tokens=2)
                with lock:
                    results.append(r)
                i += 1
            c.close()

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        try:
            time.sleep(2)
            before = self.served()
            for r in second:
                self.assertEqual(before[r.name], 0, f"{r.name} is not a member yet: {before}")
            # The second half joins: each is routed to within a few periods (its first feed poll).
            self.write_members(first + second)
            self.wait_for("every joining replica routed to",
                          lambda: all(self.served()[r.name] > 0 for r in second))
            # A bad list: served as 503, so the filter keeps the membership it has.
            self.members_file.write_text('{"members": [{"name": "x", ')
            time.sleep(4 * PERIOD_S)
            # The first quarter leaves.
            self.write_members([r for r in first + second if r not in leaving])
            time.sleep(2 * PERIOD_S + 0.5)
            at_removal = self.served()
            time.sleep(3)
            after = self.served()
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        failed = [r for r in results if not r.ok]
        self.assertFalse(failed, f"{len(failed)} of {len(results)} failed: {failed[:3]}")
        self.assertGreater(len(results), 50)
        for r in leaving:
            self.assertEqual(after[r.name], at_removal[r.name],
                             f"{r.name} left but was still sent requests: {after}")
        staying = [r for r in first + second if r not in leaving]
        self.assertTrue(all(after[r.name] > at_removal[r.name] for r in staying[:1]),
                        f"the members that stay keep serving: {at_removal} -> {after}")
        self.assertGreater(self.stat("kvsteer_discovery_poll_failures"), 0)
        self.assertGreater(self.stat("kvsteer_discovery_left"), 0)
        self.assertEqual(self.stat("kvsteer_discovery_members"), REPLICAS - len(leaving))
        # The members' feeds were polled through the feed cluster, each at its own address
        # (override_host on the destination header): a prefix sent once is found on the member that
        # served it, and the requests that share it go there with it cached.
        c = Client("127.0.0.1", s.listen_port, timeout_s=30)
        prefix = tokens(512, seed=4242)
        first_answer = c.complete(prefix + tokens(16, seed=1), max_tokens=2)
        self.assertTrue(first_answer.ok, first_answer)
        time.sleep(1.0)
        again = [c.complete(prefix + tokens(16, seed=2 + i), max_tokens=2) for i in range(4)]
        c.close()
        self.assertTrue(all(r.replica == first_answer.replica for r in again),
                        f"{first_answer.replica} then {[r.replica for r in again]}")
        self.assertTrue(all(r.cached_tokens >= 496 for r in again), [r.cached_tokens for r in again])
        self.assertFalse(s.vm_failures(), s.vm_failures())


if __name__ == "__main__":
    unittest.main()

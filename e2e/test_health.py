"""End-to-end: a replica that fails fast loses its share of the filter's choices and gets it back
when it recovers, through Envoy 1.40 (`--concurrency 2`) with envoy/envoy.yaml, the
built filter and 4 simulated replicas.

Six clients send short non-streamed completions of distinct prompts (so only load and health steer
them) on fresh connections, as fast as they are answered. After a healthy start, replica r1 fails
every generation at once with HTTP 500 (the sim's `error_rate` fault); later it serves again. Every
second the test reads the filter's decision counters from Envoy's /stats and reports r1's share of
the choices. With `retry_on: 5xx` each failed attempt is retried on the filter's second choice, so
clients see no failures, and the filter learns r1 failed from Envoy's `upstream.address` (the answer
came from another replica).
"""

from __future__ import annotations

import os
import threading
import time
import unittest

from client import Client, tokens
from stack import Stack, envoy_fleet

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "10")
BAD = "r1"
CLIENTS = 6
HEALTHY_S = 4
FAILING_S = 15
RECOVERY_LIMIT_S = 30


class Fleet(unittest.TestCase):
    """Four simulated replicas behind Envoy, one fleet per test class."""

    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        cls.stack = envoy_fleet(4, TIME_SCALE)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()


class FailingReplica(Fleet):

    def decisions(self) -> dict[str, int]:
        """The filter's decisions per replica so far (all workers)."""
        out: dict[str, int] = {}
        for k, v in self.stack.stats("kvsteer_decisions_").items():
            name = k.rsplit("_", 1)[-1]
            out[name] = out.get(name, 0) + v
        return out

    def test_a_replica_failing_every_request_is_shed_and_taken_back(self):
        stop = threading.Event()
        results: list[tuple[float, int]] = []
        lock = threading.Lock()

        def client(n: int) -> None:
            i = 0
            while not stop.is_set():
                c = Client("127.0.0.1", self.stack.listen_port, timeout_s=30)
                try:
                    res = c.complete(tokens(48, 1_000_000 * n + i), max_tokens=2)
                    status = res.status
                except Exception:
                    status = -1
                finally:
                    c.close()
                with lock:
                    results.append((time.monotonic(), status))
                i += 1

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(CLIENTS)]
        for t in threads:
            t.start()
        # (second since the fault started, decisions per replica at that time)
        samples: list[tuple[float, dict[str, int]]] = []
        try:
            time.sleep(1.0)
            start = self.decisions()
            time.sleep(HEALTHY_S - 1.0)
            healthy_from = self.decisions()
            before_share, before_n = self.share(start, healthy_from)
            self.stack.set_fault(BAD, {"error_rate": 1.0})
            fault_at = time.monotonic()
            samples.append((0.0, healthy_from))
            while time.monotonic() - fault_at < FAILING_S:
                time.sleep(1.0)
                samples.append((time.monotonic() - fault_at, self.decisions()))
            self.stack.set_fault(BAD, {"error_rate": 0.0})
            recovered_at = time.monotonic()
            recovered_from = len(samples)
            samples.append((recovered_at - fault_at, self.decisions()))
            back_after = None
            while time.monotonic() - recovered_at < RECOVERY_LIMIT_S:
                time.sleep(1.0)
                samples.append((time.monotonic() - fault_at, self.decisions()))
                share, n = self.share(samples[-2][1], samples[-1][1])
                if n > 0 and share > 0.10:
                    back_after = time.monotonic() - recovered_at
                    break
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=40)

        per_second = [self.share(a[1], b[1]) for a, b in zip(samples, samples[1:])]
        report = [f"{b[0]:.1f}s:{s:.3f}/{n}" for (a, b), (s, n)
                  in zip(zip(samples, samples[1:]), per_second)]
        # Shed: every failing second from the 10th on; overall from the 5th second to the end.
        late = [s for (t, _), (s, n) in zip(samples[1:], per_second[:recovered_from - 1])
                if t >= 10.0]
        mid_share, mid_n = self.share(samples[5][1], samples[recovered_from - 1][1])
        failed = sum(1 for _, st in results if st != 200)
        retries = sum(v for k, v in self.stack.stats("cluster.replicas.upstream_rq_retry").items()
                      if k == "cluster.replicas.upstream_rq_retry")
        rate = len(results) / max(1e-9, results[-1][0] - results[0][0]) if results else 0.0
        print(f"\nbefore the fault r1 had {before_share:.3f} of {before_n} decisions; "
              f"failing replica's share of decisions per second (share/decisions): {report}; "
              f"5-{FAILING_S} s after the fault {mid_share:.3f} of {mid_n}; back after "
              f"{back_after} s; {len(results)} requests at {rate:.0f}/s, {failed} failed at the "
              f"client, {retries} retried by Envoy", flush=True)
        self.assertGreater(before_share, 0.10, "healthy, it had its share")
        self.assertGreater(mid_n, 100, "enough traffic to measure a share")
        self.assertLess(mid_share, 0.05)
        self.assertTrue(late and all(s < 0.08 for s in late), report)
        # Whatever the request rate: from the 3rd failing second on, only probes go there, one a
        # second for the whole proxy (claimed in shared data), so about one decision a second.
        for (t0, a), (t1, b) in zip(samples[2:recovered_from - 1], samples[3:recovered_from]):
            per_s = (b.get(BAD, 0) - a.get(BAD, 0)) / max(t1 - t0, 0.5)
            self.assertLessEqual(per_s, 3, f"{per_s:.1f} decisions a second at {t1:.1f} s: {report}")
        self.assertIsNotNone(back_after, f"not back within {RECOVERY_LIMIT_S} s: {report}")
        # The retries hid the failures from clients.
        self.assertGreater(retries, 0)
        self.assertLessEqual(failed, 2, "failures reached the clients")
        self.assertGreater(self.stat("kvsteer_upstream_failures_r1"), 0)
        self.assertEqual(self.stat("kvsteer_upstream_failures_r0"), 0)
        self.assertGreater(self.stat("kvsteer_health_probes_r1"), 0)

    def stat(self, needle: str) -> int:
        return sum(v for k, v in self.stack.stats(needle).items() if needle in k)

    @staticmethod
    def share(before: dict[str, int], after: dict[str, int]) -> tuple[float, int]:
        n = sum(after.values()) - sum(before.values())
        bad = after.get(BAD, 0) - before.get(BAD, 0)
        return (bad / n if n > 0 else 0.0), n


class OversizedBodies(Fleet):
    """A client cannot get healthy replicas ejected. Bodies over the filter's `max_body_bytes` and
    Envoy's 16 MiB buffers are routed unread; Envoy then answers them itself (507 when its retry
    buffer overflows) or the replica cuts the connection on them (503 `connection_termination`).
    Neither is a replica's own failure: sent in a loop for several seconds while normal requests
    flow, no replica is ejected and no failure is recorded against any."""

    ATTACK_S = 6.0
    ATTACKERS = 2
    CLIENTS = 3
    BODY = b'{"prompt": "' + b"a" * (20 << 20) + b'", "max_tokens": 2}'

    def per_replica(self, needle: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for k, v in self.stack.stats(needle).items():
            name = k.rsplit("_", 1)[-1]
            out[name] = out.get(name, 0) + v
        return out

    def test_oversized_bodies_eject_no_replica(self):
        stop = threading.Event()
        lock = threading.Lock()
        attacks: list[int] = []
        normal: list[int] = []

        def attacker() -> None:
            while not stop.is_set():
                c = Client("127.0.0.1", self.stack.listen_port, timeout_s=30)
                try:
                    status, _, _ = c.request("POST", "/v1/completions", self.BODY,
                                             {"content-type": "application/json"})
                except Exception:
                    status = -1
                finally:
                    c.close()
                with lock:
                    attacks.append(status)

        def client(n: int) -> None:
            i = 0
            while not stop.is_set():
                c = Client("127.0.0.1", self.stack.listen_port, timeout_s=30)
                try:
                    status = c.complete(tokens(48, 7_000_000 * (n + 1) + i), max_tokens=2).status
                except Exception:
                    status = -1
                finally:
                    c.close()
                with lock:
                    normal.append(status)
                i += 1

        failures_before = self.per_replica("kvsteer_upstream_failures_")
        threads = [threading.Thread(target=attacker, daemon=True) for _ in range(self.ATTACKERS)]
        threads += [threading.Thread(target=client, args=(n,), daemon=True)
                    for n in range(self.CLIENTS)]
        for t in threads:
            t.start()
        ejected_max: dict[str, int] = {}
        try:
            start = time.monotonic()
            while time.monotonic() - start < self.ATTACK_S:
                time.sleep(0.25)
                for name, v in self.per_replica("kvsteer_ejected_").items():
                    ejected_max[name] = max(ejected_max.get(name, 0), v)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=40)
        time.sleep(0.3)
        failures_after = self.per_replica("kvsteer_upstream_failures_")
        not_blamed = sum(self.stack.stats("kvsteer_failures_not_blamed").values())
        codes = {c: attacks.count(c) for c in sorted(set(attacks))}
        print(f"\n{len(attacks)} oversized requests in {self.ATTACK_S:.0f} s (statuses {codes}), "
              f"{len(normal)} normal ones ({sum(1 for s in normal if s != 200)} failed); "
              f"ejected at most {ejected_max}; failures recorded before {failures_before}, after "
              f"{failures_after}; {not_blamed} failures blamed on no replica", flush=True)
        self.assertGreaterEqual(len(attacks), 20, "the attack ran")
        self.assertTrue(all(s != 200 for s in attacks), codes)
        self.assertGreater(len(normal), 50, "normal requests flowed")
        self.assertTrue(all(s == 200 for s in normal), "normal requests all served")
        self.assertEqual(len(ejected_max), 4, ejected_max)
        self.assertTrue(all(v == 0 for v in ejected_max.values()), ejected_max)
        self.assertEqual(failures_after, failures_before)
        self.assertGreater(not_blamed, 0, "the refused bodies were seen and blamed on no replica")


if __name__ == "__main__":
    unittest.main()

"""The peers bench's own logic, without the peer routers (CI does not install them): slices built from
the traces keep the prefix structure the routers route on, and the report reads a result the way it
says it does."""

from __future__ import annotations

import os
import unittest
import xml.dom.minidom

import bench_peers as bp


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Slices(unittest.TestCase):
    def test_block_text_depends_on_the_block_only(self):
        a = bp.block_text("ns", 7, 16)
        self.assertEqual(a, bp.block_text("ns", 7, 16))
        self.assertNotEqual(a, bp.block_text("ns", 8, 16))
        self.assertNotEqual(a, bp.block_text("other", 7, 16))
        self.assertEqual(len(a.split()), 16)
        self.assertTrue(a.startswith(" "))

    def test_coding_sessions_share_the_tool_prefix_and_nothing_after_it(self):
        doc = bp.coding_slice(3, 2, 2, 64, 1.0)
        self.assertEqual(len(doc["sessions"]), 3)
        self.assertEqual(doc["concurrency"], 3)
        firsts = [s["turns"][0]["prompt"] for s in doc["sessions"]]
        shared = common_prefix(firsts[0], firsts[1])
        # Some shared words (the global tool+system blocks), and not the whole prompt.
        self.assertGreater(shared, 0)
        self.assertLess(shared, min(len(firsts[0]), len(firsts[1])))
        for s in doc["sessions"]:
            for t in s["turns"]:
                self.assertLessEqual(t["max_tokens"], 64)
                self.assertLessEqual(t["think_us"], 1_000_000)
            # A session's next turn extends most of its previous prompt.
            a, b = s["turns"][0]["prompt"], s["turns"][1]["prompt"]
            self.assertGreater(common_prefix(a, b), len(a) // 2)

    def test_mooncake_requests_that_share_blocks_share_text(self):
        doc = bp.mooncake_slice(40, 4, 8, 16)
        self.assertEqual(len(doc["sessions"]), 40)
        prompts = [s["turns"][0]["prompt"] for s in doc["sessions"]]
        # Each block is 4 words of 5 bytes; some pair of the trace's last 40 requests shares a
        # first block.
        block = 4 * 5
        starts = [p[:block] for p in prompts]
        self.assertLess(len(set(starts)), len(starts))
        self.assertTrue(all(t["max_tokens"] <= 16 for s in doc["sessions"] for t in s["turns"]))


def summary(session_p99: float, ttft_p99: float) -> dict:
    return {"requests": 10, "failed": 0,
            "ttft_ms": {"p50": ttft_p99 / 2, "p90": ttft_p99, "p99": ttft_p99},
            "tpot_ms": {"p50": 10.0, "p90": 11.0, "p99": 12.0},
            "e2e_s": {"p50": 1.0, "p99": 2.0},
            "rollout_s": {"p50": session_p99 / 2, "p99": session_p99},
            "output_tokens_per_s": 100.0, "hit_rate": 0.5, "decode_cv": None,
            "requests_per_replica": {}, "prompt_tokens": 1000, "errors": [],
            "command_example": "router --policy x"}


class Report(unittest.TestCase):
    def test_verdicts_compare_the_medians_and_list_every_run(self):
        k, p = summary(10.0, 100.0), summary(20.0, 50.0)
        results = {
            "commit": "abc", "time_scale": 5.0, "repeat": 1, "wall_s": 1.0,
            "versions": {"sglang-router": "x", "vllm-router": "y", "envoy": "z"},
            "slices": {"rl": {"kvsteer kv_load": k, "vllm power_of_two": p}},
            "slice_meta": {"rl": {"source": "s", "sessions": 1, "requests": 10,
                                  "concurrency": 1, "prompt_tokens_per_request": 100.0}},
            "runs": {"rl": {"kvsteer kv_load": [k], "vllm power_of_two": [p]}},
        }
        lines = bp.verdicts(results)
        self.assertEqual(len(lines), 1)
        self.assertIn("session p99 10.0 vs 20.0 s, 0.50x, at least as good (runs: 10.0 vs 20.0)",
                      lines[0])
        self.assertIn("TTFT p99 100 vs 50 ms, 2.00x, behind", lines[0])
        md = bp.report(results)
        self.assertIn("| vllm power_of_two |", md)
        xml.dom.minidom.parseString(bp.svg(results))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    unittest.main()

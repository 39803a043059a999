"""The stalls bench's own logic, without running it: every repeat runs each (policy, condition)
cell once, in an order that rotates, and the report reads a result the way it says it does."""

from __future__ import annotations

import unittest
import xml.dom.minidom

import bench_stalls as bs


def run(p99: float, repeat: int) -> dict:
    return {"repeat": repeat, "failed": 0, "loadavg_start": [1.0, 1.0, 1.0],
            "loadavg_end": [2.0, 1.5, 1.0], "hit_rate": 0.5,
            "ttft": {"p50": p99 / 10, "p90": p99 / 2, "p99": p99, "mean": p99 / 5,
                     "over_stall": int(p99 >= 300),
                     "less_stalls": {"p50": p99 / 10, "p99": p99 * 0.9, "mean": p99 / 6},
                     "met_stall": int(p99 >= 300) * 2},
            "requests_per_replica": {"r0_0": 5, "r1_0": 5},
            "stalls_per_replica": {"r0": 1, "r1": None},
            "learned_speed_milli": {"r0": [1100], "r1": [900]}}


class Cells(unittest.TestCase):
    def test_each_repeat_runs_every_cell_once_and_the_first_cell_rotates(self):
        want = {(p, c) for p in bs.POLICIES for c in bs.CONDITIONS}
        firsts = set()
        for rep in range(4):
            order = bs.cells(rep)
            self.assertEqual(set(order), want)
            self.assertEqual(len(order), len(want))
            firsts.add(order[0])
        self.assertEqual(firsts, want)


class Figures(unittest.TestCase):
    def test_ttft_in_engine_ms_and_first_tokens_a_stall_long(self):
        rows = [{"ok": True, "ttft_s": t} for t in (0.01, 0.02, 0.2, 0.25)]
        rows.append({"ok": False, "ttft_s": 9.0})
        f = bs.ttft_figures(rows, 5.0, 1000)
        self.assertEqual((f["p50"], f["p99"], f["over_stall"]), (100.0, 1250.0, 2))
        self.assertAlmostEqual(f["mean"], 600.0)
        self.assertEqual(f["less_stalls"]["p99"], f["p99"])
        self.assertEqual(f["met_stall"], 0)

    def test_the_stall_time_a_request_waited_out_comes_off_its_ttft(self):
        held = {"r0_0": [[100.0, 101.0], [105.0, 106.0]], "r1_0": [[100.0, 110.0]]}
        rows = [
            # Issued half way through r0's first stall, first token 2 s later: 0.5 s waited out.
            {"ok": True, "replica": "r0_0", "issued_unix": 100.5, "ttft_s": 2.0},
            # Over both of r0's stalls: 2 s of its 6.
            {"ok": True, "replica": "r0_0", "issued_unix": 100.0, "ttft_s": 6.0},
            # Before r0's stalls: nothing; another replica's stall does not count.
            {"ok": True, "replica": "r0_0", "issued_unix": 90.0, "ttft_s": 1.0},
            # A row written before rows had a Unix issue time: nothing taken off.
            {"ok": True, "replica": "r1_0", "ttft_s": 4.0},
        ]
        self.assertEqual([bs.waited_out(r, held) for r in rows], [0.5, 2.0, 0.0, 0.0])
        f = bs.ttft_figures(rows, 1.0, 1000, held)
        self.assertEqual(f["met_stall"], 2)
        # TTFT less stalls: 1500, 4000, 1000, 4000 ms.
        self.assertAlmostEqual(f["less_stalls"]["mean"], 2625.0)
        self.assertEqual(f["less_stalls"]["p99"], 4000.0)


class Report(unittest.TestCase):
    def test_ratios_are_stalls_over_calm_of_the_medians_and_per_repeat(self):
        p99 = {("kv_time", "calm"): [100.0, 200.0, 300.0],
               ("kv_time", "stalls"): [110.0, 400.0, 300.0],
               ("kv_load", "calm"): [100.0, 100.0, 100.0],
               ("kv_load", "stalls"): [150.0, 150.0, 150.0]}
        runs = {p: {c: [run(v, i + 1) for i, v in enumerate(p99[(p, c)])]
                    for c in bs.CONDITIONS} for p in bs.POLICIES}
        results = {"commit": "abc", "time_scale": 1.0, "repeat": 3, "wall_s": 10.0,
                   "stall_flags": "--stall-every-s 30 --stall-ms 1000",
                   "slice_meta": {"coding": {"source": "s", "sessions": 2, "requests": 10,
                                             "concurrency": 2}},
                   "runs": {"coding": runs}}
        med, per = bs.ratios(results, "coding", "kv_time")
        self.assertAlmostEqual(med, 300.0 / 200.0)
        self.assertEqual([round(x, 2) for x in per], [1.1, 2.0, 1.0])
        md = bs.report(results)
        self.assertIn("| kv_time | 1.50 | 1.10 / 2.00 / 1.00 | 1.50 | 1.10 / 2.00 / 1.00 |", md)
        self.assertIn("| kv_load | 1.50 | 1.50 / 1.50 / 1.50 |", md)
        self.assertIn("| kv_time | stalls | 30 | 150 | 300 | 60 | 110 / 400 / 300 | 0 / 1 / 1 | "
                      "270 | 0 / 2 / 2 | 50.0 |", md)
        self.assertIn("- kv_time calm: 1.00->2.00, 1.00->2.00, 1.00->2.00", md)
        self.assertIn("- stalls: r0=1100 r1=900;", md)
        xml.dom.minidom.parseString(bs.svg(results))


if __name__ == "__main__":
    unittest.main()

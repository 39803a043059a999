"""The Envoy slice of the benchmark report (docs/reports/results.md): the same requests the harness replays
as `slice-rl`, through a real Envoy in front of 4 time-scaled simulated replicas, for the filter's
`kv_load` and `session_hash` and Envoy's own `round_robin`, `least_request` and `ring_hash` (on the
session header). Each configuration gets fresh replicas (cold caches) and a fresh Envoy.

Run by scripts/bench-envoy-slice (which installs Envoy and builds the binaries); see its header for
options. Writes <out>/envoy.json (configuration, commit, every request) and <out>/envoy.md (the table
and the ranking check against the harness), which `bench` includes in docs/reports/results.md.

Times: the client measures wall time; the replicas run `time_scale` times faster than the engine
model, so wall times are multiplied by `time_scale` to read as engine time, comparable with the
harness (Envoy's and Python's own overhead is multiplied too: at scale 5, 1 ms of proxy overhead reads
as 5 ms).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client import Client  # noqa: E402
from stack import REPO, Stack, StackError, target_dir  # noqa: E402

# (label, envoy/<variant>.yaml, filter policy or None)
CONFIGS = [
    ("kv_load", "envoy", "kv_load"),
    ("session_hash", "envoy", "session_hash"),
    ("envoy round_robin", "envoy-round-robin", None),
    ("envoy least_request", "envoy-least-request", None),
    ("envoy ring_hash", "envoy-ring-hash", None),
]


def pct(xs: list[float], p: float) -> float:
    """Nearest rank, as the harness's `Percentiles` (rank ceil(p/100 n), 1-based)."""
    s = sorted(x for x in xs if x == x)
    if not s:
        return float("nan")
    k = max(1, -(-int(p * len(s)) // 100))
    return s[min(len(s), k) - 1]


class Sampler(threading.Thread):
    """Reads every replica's `kvsteer_sim:decode_blocks` gauge every `period_s` (wall) for the
    decode-block CV, as docs/design/design.md section 7 defines it: population std / mean across replicas
    per sample, averaged over samples whose mean is not 0."""

    def __init__(self, endpoints: list[str], period_s: float):
        super().__init__(daemon=True)
        self.endpoints, self.period_s = endpoints, period_s
        self.stop = threading.Event()
        self.samples: list[list[float]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            row = []
            for ep in self.endpoints:
                try:
                    with urllib.request.urlopen(f"http://{ep}/metrics", timeout=2) as r:
                        text = r.read().decode()
                    v = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                         if ln.startswith("kvsteer_sim:decode_blocks")]
                    row.append(sum(v))
                except (OSError, ValueError, IndexError):
                    row.append(float("nan"))
            if all(x == x for x in row):
                self.samples.append(row)
            self.stop.wait(self.period_s)

    def cv(self) -> float | None:
        cvs = []
        for row in self.samples:
            m = sum(row) / len(row)
            if m > 0:
                cvs.append(statistics.pstdev(row) / m)
        return sum(cvs) / len(cvs) if cvs else None


def replay(port: int, slice_doc: dict, scale: float, progress,
           extra: dict | None = None, session_headers: tuple[str, ...] = ()) -> list[dict]:
    """Closed loop: `concurrency` sessions in flight, each turn after the previous one finished
    (plus its think time, scaled), as the harness's Driver does, against the proxy or router on
    127.0.0.1:`port`. Every request names its session in `x-session-id` and in each header of
    `session_headers` (a peer router's own session header). `extra`: more body fields (a real
    engine wants its own model name). One row per request, in completion order."""
    sessions = queue.Queue()
    for s in slice_doc["sessions"]:
        sessions.put(s)
    rows: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def slot() -> None:
        client = Client("127.0.0.1", port, timeout_s=600)
        try:
            while True:
                try:
                    s = sessions.get_nowait()
                except queue.Empty:
                    return
                for i, t in enumerate(s["turns"]):
                    if t.get("think_us"):
                        time.sleep(t["think_us"] / 1e6 / scale)
                    issued = time.perf_counter() - t0
                    issued_unix = time.time()
                    r = client.complete(t["prompt"], max_tokens=t["max_tokens"], stream=True,
                                        session=s["id"], ignore_eos=True, extra=extra,
                                        headers={h: s["id"] for h in session_headers})
                    with lock:
                        rows.append({
                            "session": s["id"], "turn": i, "issued_s": issued,
                            "issued_unix": issued_unix,
                            "ok": r.ok and r.completion_tokens > 0, "error": r.error[:200],
                            "status": r.status,
                            "replica": r.replica, "ttft_s": r.ttfb_s, "total_s": r.total_s,
                            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                            "completion_tokens": r.completion_tokens,
                        })
                        progress(len(rows))
        finally:
            client.close()

    threads = [threading.Thread(target=slot, daemon=True)
               for _ in range(max(1, slice_doc["concurrency"]))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return rows


def summarize(rows: list[dict], scale: float, cv: float | None) -> dict:
    ok = [r for r in rows if r["ok"]]
    ttft = [r["ttft_s"] * scale * 1e3 for r in ok]
    tpot = [(r["total_s"] - r["ttft_s"]) * scale * 1e3 / (r["completion_tokens"] - 1)
            for r in ok if r["completion_tokens"] > 1]
    e2e = [r["total_s"] * scale for r in ok]
    by_session: dict[str, list[dict]] = {}
    for r in rows:
        by_session.setdefault(r["session"], []).append(r)
    rollout = [(max(r["issued_s"] + r["total_s"] for r in rs) - min(r["issued_s"] for r in rs))
               * scale for rs in by_session.values()]
    span = (max((r["issued_s"] + r["total_s"] for r in ok), default=0)
            - min((r["issued_s"] for r in ok), default=0)) * scale
    prompt = sum(r["prompt_tokens"] for r in ok)
    replicas: dict[str, int] = {}
    for r in ok:
        replicas[r["replica"]] = replicas.get(r["replica"], 0) + 1
    return {
        "requests": len(ok), "failed": len(rows) - len(ok),
        "ttft_ms": {p: pct(ttft, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "tpot_ms": {p: pct(tpot, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "e2e_s": {p: pct(e2e, q) for p, q in (("p50", 50), ("p99", 99))},
        "rollout_s": {p: pct(rollout, q) for p, q in (("p50", 50), ("p99", 99))},
        "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / span if span else 0.0,
        "hit_rate": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
        "decode_cv": cv,
        "requests_per_replica": dict(sorted(replicas.items())),
    }


def median_summary(runs: list[dict]):
    """Leaf by leaf median of several runs' summaries (None where any run has None)."""
    first = runs[0]
    if isinstance(first, dict):
        keys = list(first) + sorted({k for r in runs for k in r} - set(first))
        return {k: median_summary([r[k] for r in runs if k in r]) for k in keys}
    if any(v is None for v in runs):
        return None
    return statistics.median(runs)


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# The harness's feed poll and tick periods (HarnessConfig::small), in engine time.
FEED_PERIOD_MS = 200
TICK_MS = 100

# Seeds of the harness side of the comparison. Seed 0 replays the very requests Envoy gets; seeds 1
# and 2 the same structure with other token ids, other engine seeds and other router tie-breaks.
HARNESS_SEEDS = 3

# A relative gap between two policies below which the harness calls them tied.
TIE = 0.05


def gap(values: dict[str, float]) -> float:
    """Relative difference of two values, to the larger one's magnitude (0 when both are 0)."""
    a, b = values.values()
    top = max(abs(a), abs(b))
    return abs(a - b) / top if top else 0.0


def rank(values: dict[str, float], lower_better: bool) -> list[str]:
    return sorted(values, key=lambda k: values[k] if lower_better else -values[k])


def report(results: dict, harness: dict | None, args, slice_doc: dict) -> str:
    md = ["## Through real Envoy: the slice\n"]
    n = sum(len(s["turns"]) for s in slice_doc["sessions"])
    md.append(
        f"`scripts/bench-envoy-slice`: the `{slice_doc['scenario']}` workload ({len(slice_doc['sessions'])} "
        f"rollouts, {n} requests, {slice_doc['concurrency']} in flight; the harness replays the very "
        f"same requests) through Envoy 1.40 (`--concurrency 2`) in front of 4 `kvsteer-sim serve` "
        f"replicas at `--time-scale {args.time_scale:g}`, fresh replicas and Envoy per configuration. "
        f"Times are the client's wall times x {args.time_scale:g} (engine time, so Envoy's and the "
        f"client's own overhead is magnified {args.time_scale:g} times); decode CV from each "
        f"replica's `kvsteer_sim:decode_blocks` gauge polled every {args.sample_s:g} s of wall time. "
        f"The filter's `feed_period_ms` and `tick_ms` are the harness's {FEED_PERIOD_MS} and "
        f"{TICK_MS} ms divided by the time scale (engine time alike in both). "
        f"Commit `{results['commit']}`, wall {results['wall_s']:.0f} s.\n")
    md.append("| configuration | TTFT p50 / p99 ms | TPOT p50 / p99 ms | rollout p50 / p99 s | "
              "output tok/s | hit rate % | decode CV | failed |")
    md.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, s in results["configs"].items():
        cv = "-" if s["decode_cv"] is None else f"{s['decode_cv']:.3f}"
        md.append(f"| {label} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | "
                  f"{s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p99']:.1f} | "
                  f"{s['rollout_s']['p50']:.1f} / {s['rollout_s']['p99']:.1f} | "
                  f"{s['output_tokens_per_s']:.0f} | {s['hit_rate'] * 100:.1f} | {cv} | "
                  f"{s['failed']} |")
    md.append("")
    if harness:
        by_policy: dict[str, list[dict]] = {}
        for r in harness["runs"]:
            if r["scenario"] == slice_doc["scenario"]:
                by_policy.setdefault(r["policy"], []).append(r["summary"])
        # Median over the harness's seeds, as the Envoy side is a median over its repeats: one seed's
        # tie-breaks can swing a 64-request slice (kv_load's decode CV is 0.64-0.94 across seeds).
        runs = {p: median_summary(v) for p, v in by_policy.items()}
        seeds = max((len(v) for v in by_policy.values()), default=0)
        md.append(f"### The slice in the harness (virtual time, median over {seeds} seed(s); seed 0 "
                  f"is the very requests Envoy got, the others the same structure with other "
                  f"tokens)\n")
        md.append("| policy | TTFT p50 / p99 ms | TPOT p50 / p99 ms | rollout p50 / p99 s | "
                  "output tok/s | hit rate % | decode CV |")
        md.append("|---|---:|---:|---:|---:|---:|---:|")
        for p, s in runs.items():
            cv = "-" if s["decode_cv"] is None else f"{s['decode_cv']:.3f}"
            md.append(f"| {p} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | "
                      f"{s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p99']:.1f} | "
                      f"{s['session_e2e_s']['p50']:.1f} / {s['session_e2e_s']['p99']:.1f} | "
                      f"{s['output_tokens_per_s']:.0f} | {s['hit_rate'] * 100:.1f} | {cv} |")
        md.append("")
        pols = [p for p in ("kv_load", "session_hash") if p in runs and p in results["configs"]]
        if len(pols) == 2:
            md.append("### Do harness and Envoy rank the filter's policies the same way?\n")
            reps = results.get("repeat", 1)
            md.append(f"Gap: kv_load against session_hash, relative to the larger of the two. A harness "
                      f"gap under {TIE * 100:.0f}% is a tie in virtual time, where Envoy's ranking is "
                      f"decided by wall-clock noise, so only the rows with a clear harness gap test the "
                      f"agreement. Envoy figures are the median of {reps} run(s) per configuration; "
                      f"'runs' counts the runs in which Envoy ranked the harness's winner first.\n")
            md.append("| metric | harness: better (gap) | Envoy: better (gap) | runs | same |")
            md.append("|---|---|---|---:|---|")
            checks = [
                ("rollout p99", lambda s: s["session_e2e_s"]["p99"], lambda s: s["rollout_s"]["p99"], True),
                ("TTFT p50", lambda s: s["ttft_ms"]["p50"], lambda s: s["ttft_ms"]["p50"], True),
                ("TTFT p99", lambda s: s["ttft_ms"]["p99"], lambda s: s["ttft_ms"]["p99"], True),
                ("TPOT p50", lambda s: s["tpot_ms"]["p50"], lambda s: s["tpot_ms"]["p50"], True),
                ("output tok/s", lambda s: s["output_tokens_per_s"],
                 lambda s: s["output_tokens_per_s"], False),
                ("hit rate", lambda s: s["hit_rate"], lambda s: s["hit_rate"], False),
                ("decode CV", lambda s: s["decode_cv"] or 0.0, lambda s: s["decode_cv"] or 0.0, True),
            ]
            # Run i of kv_load against run i of session_hash (the repeats interleave, so run i of
            # each saw the same patch of the machine).
            per_run = results.get("runs", {})
            pairs = list(zip(per_run.get(pols[0], []), per_run.get(pols[1], [])))
            clear = agree = 0
            for name, fh, fe, low in checks:
                hv = {p: fh(runs[p]) for p in pols}
                ev = {p: fe(results["configs"][p]) for p in pols}
                h, e = rank(hv, low)[0], rank(ev, low)[0]
                hg, eg = gap(hv), gap(ev)
                wins = sum(rank({pols[0]: fe(a), pols[1]: fe(b)}, low)[0] == h for a, b in pairs)
                runs_cell = f"{wins}/{len(pairs)}" if pairs else "-"
                if hg < TIE:
                    verdict = "tie in the harness" + ("" if h == e else f" (Envoy: {e})")
                else:
                    clear += 1
                    agree += h == e
                    verdict = "yes" if h == e else "**no**"
                md.append(f"| {name} | {h} ({hg * 100:.1f}%) | {e} ({eg * 100:.1f}%) | {runs_cell} | "
                          f"{verdict} |")
            md.append("")
            md.append(f"Of the {clear} metrics with a clear harness gap, Envoy ranks {agree} the same way.\n")
    return "\n".join(md) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-scale", type=float, default=5.0)
    ap.add_argument("--sample-s", type=float, default=0.2)
    ap.add_argument("--smoke", action="store_true", help="the tiny RL slice (seconds)")
    ap.add_argument("--out", default=str(REPO / "docs" / "reports" / "results"))
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per configuration (fresh replicas and Envoy each); figures are medians")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite envoy.md from the last run's envoy.json and harness results")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = target_dir() / "release" / "bench"
    work = REPO / "out" / "bench-envoy"
    work.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = json.loads((out / "envoy.json").read_text())
        harness = json.loads((work / "harness" / "results" / "harness.json").read_text())
        slice_doc = json.loads((work / "slice.json").read_text())
        args.time_scale = results["time_scale"]
        md = report(results, harness, args, slice_doc)
        (out / "envoy.md").write_text(md)
        print(md)
        return 0
    scale_flag = ["--smoke"] if args.smoke else []
    slice_path = work / "slice.json"
    subprocess.run([str(bench), *scale_flag, "--export-slice", str(slice_path)], check=True)
    slice_doc = json.loads(slice_path.read_text())
    print(f"== the same requests in the harness (all policies, {HARNESS_SEEDS} seeds)", file=sys.stderr)
    subprocess.run([str(bench), *scale_flag, "--only", "slice", "--seeds", str(HARNESS_SEEDS),
                    "--out", str(work / "harness")], check=True, stdout=subprocess.DEVNULL)
    harness = json.loads((work / "harness" / "results" / "harness.json").read_text())
    block = str(slice_doc["block_size"])
    total = sum(len(s["turns"]) for s in slice_doc["sessions"])
    wanted = [c for c in CONFIGS if c[0] in args.configs.split(",")]
    results = {"commit": commit(), "time_scale": args.time_scale, "slice": slice_doc["scenario"],
               "params": slice_doc["params"], "repeat": max(1, args.repeat), "configs": {},
               "runs": {}, "requests": {}}
    started = time.perf_counter()
    for rep in range(results["repeat"]):
        # Configurations interleave across repeats, so a slow patch of the machine hits them alike.
        for label, variant, policy in wanted:
            t_cfg = time.perf_counter()
            tag = label if results["repeat"] == 1 else f"{label} #{rep + 1}"
            with Stack() as st:
                st.start_replicas(4, extra=["--time-scale", str(args.time_scale),
                                            "--block-size", block])
                # The filter's clocks run in wall time while the replicas run `time_scale` times
                # faster: divide its feed poll and tick periods (200 and 100 ms, as in the
                # harness) by the scale, so the router hears from the replicas as often, in engine
                # time, as it does in the harness.
                overrides = ({"routing": {"policy": policy, "block_size": int(block)},
                              "feed_period_ms": max(1, round(FEED_PERIOD_MS / args.time_scale)),
                              "tick_ms": max(1, round(TICK_MS / args.time_scale))}
                             if policy else {})
                st.start_envoy(variant, plugin_overrides=overrides)
                sampler = Sampler([r.endpoint for r in st.replicas], args.sample_s)
                sampler.start()

                def progress(done: int, tag=tag, t_cfg=t_cfg) -> None:
                    print(f"\r{tag:<26} {done}/{total} requests "
                          f"{time.perf_counter() - t_cfg:5.1f}s", end="", file=sys.stderr, flush=True)

                rows = replay(st.listen_port, slice_doc, args.time_scale, progress)
                sampler.stop.set()
                sampler.join()
                print(file=sys.stderr)
                failures = st.vm_failures()
                if failures:
                    raise StackError(f"{tag}: wasm VM failures:\n" + "\n".join(failures[:5]))
            results["runs"].setdefault(label, []).append(
                summarize(rows, args.time_scale, sampler.cv()))
            results["requests"].setdefault(label, []).append(rows)
    for label, runs in results["runs"].items():
        results["configs"][label] = median_summary(runs)
        # A failed request in any run is reported, not averaged away.
        results["configs"][label]["failed"] = sum(r["failed"] for r in runs)
    results["wall_s"] = time.perf_counter() - started
    (out / "envoy.json").write_text(json.dumps(results, indent=1))
    md = report(results, harness, args, slice_doc)
    (out / "envoy.md").write_text(md)
    print(md)
    bad = {k: v["failed"] for k, v in results["configs"].items() if v["failed"]}
    if bad:
        print(f"failed requests: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

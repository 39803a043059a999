"""The fidelity check (docs/reports/fidelity.md): one small RL-like workload through 4 real vLLM CPU engines
and through 4 simulated replicas fitted to them (`kvsteer-sim serve --profile`, real time), both
behind Envoy with the filter, for round_robin, session_hash, kv_affinity and kv_load; hit rates,
TTFT p50/p99 and output tok/s side by side.

Real side: 4 engines of docs/guide/real-vllm.md (tiny random-weight Llama, block size 32, the engine's own
KV block count, `--enforce-eager`), two pinned to each core (`VLLM_CPU_OMP_THREADS_BIND` 0, 1, 0, 1),
a `kvsteer-feed` beside each (e2e/test_real_vllm.py's RealStack); the engines stay up across
policies, each policy starting on empty caches (`POST /reset_prefix_cache`, then a one-block request
so the engine publishes AllBlocksCleared and its adapter empties its view) and a fresh Envoy.
Sim side: 4 fresh `kvsteer-sim` replicas per policy with the fitted profile and the engine's block
count, token budget and sequence cap, and a fresh Envoy. Same Envoy configuration (envoy/envoy.yaml,
the policy and block size 32 changed), same feed period, same client (bench_envoy.replay: closed
loop, `concurrency` sessions in flight, streamed, `x-session-id` per session).

The workload (RL-like, GRPO-style): every rollout shares one system prompt; rollouts come in groups
of `group` that share a task prompt; each turn's prompt is the previous prompt plus the previous
answer (token ids drawn here, as long as the answer was: the engines' own outputs are random-weight
noise, so no later prompt contains them, on either side) plus a tool result; answers have a drawn
length (`ignore_eos`), a few of them long (stragglers), tools a drawn think time.

Run by scripts/fidelity. Writes <out>/fidelity.json (workload parameters, every request, summaries)
and <out>/fidelity.md (the table and the goals).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_envoy import commit, pct, replay, summarize  # noqa: E402
from client import Client, tokens  # noqa: E402
from stack import Stack, StackError, report_path, sim_path, wasm_path  # noqa: E402
from test_real_vllm import BLOCK, Engine, RealStack, prom, wait_until  # noqa: E402
from test_real_vllm import http as http_req  # noqa: E402

POLICIES = ["round_robin", "session_hash", "kv_affinity", "kv_load"]
REPLICAS = 4
ENGINE_START_S = 400
# A relative gap below which two policies are called tied (as bench_envoy.py).
TIE = 0.05


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload(a: argparse.Namespace) -> dict:
    """The rollouts, in bench_envoy's slice format (sessions of turns: prompt, max_tokens,
    think_us)."""
    rng = random.Random(a.seed)
    system = tokens(a.system, a.seed * 1_000_003)
    sessions = []
    for g in range(a.sessions // a.group):
        task = tokens(a.task, a.seed * 1_000_003 + 1 + g)
        for k in range(a.group):
            sid = f"s{g:03d}-{k}"
            prompt = system + task
            turns = []
            for i in range(a.turns):
                out = rng.randint(a.out_min, a.out_max)
                if rng.random() < a.straggler_frac:
                    out = a.straggler_out
                think = 0 if i == 0 else rng.randint(a.think_min_ms, a.think_max_ms) * 1000
                turns.append({"prompt": list(prompt), "max_tokens": out, "think_us": think})
                answer = [rng.randrange(1, 32000) for _ in range(out)]
                tool = [rng.randrange(1, 32000) for _ in range(rng.randint(a.tool_min, a.tool_max))]
                prompt = prompt + answer + tool
            sessions.append({"id": sid, "turns": turns})
    return {"scenario": "fidelity-rl", "sessions": sessions, "concurrency": a.concurrency,
            "block_size": BLOCK}


def plugin(policy: str, scale: float = 1.0) -> dict:
    doc: dict = {"routing": {"policy": policy, "block_size": BLOCK}}
    if scale != 1.0:
        # The filter's clocks run in wall time: its feed poll and tick (200 and 100 ms) divided by
        # the replicas' time scale, so it hears from them as often in engine time (bench_envoy.py).
        doc.update(feed_period_ms=max(1, round(200 / scale)), tick_ms=max(1, round(100 / scale)))
    return doc


def run_policy(st: Stack, doc: dict, policy: str, side: str,
               scale: float = 1.0) -> tuple[list[dict], float]:
    """Replays `doc`; with replicas `scale` times faster than real time, think times are divided
    and the rows' times multiplied by `scale` (engine time, as bench_envoy.py)."""
    total = sum(len(s["turns"]) for s in doc["sessions"])
    t0 = time.perf_counter()
    last = [0.0]

    def progress(done: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 5 or done == total:
            last[0] = now
            print(f"\r{side} {policy:<13} {done}/{total} requests {now - t0:6.1f}s", end="",
                  file=sys.stderr, flush=True)

    # The same body on both sides: vLLM serves the model as `tiny`; the sim echoes any name.
    rows = replay(st.listen_port, doc, scale, progress, extra={"model": "tiny", "temperature": 0})
    for r in rows:
        for k in ("issued_s", "ttft_s", "total_s"):
            r[k] *= scale
    print(file=sys.stderr)
    failures = st.vm_failures()
    if failures:
        raise StackError(f"{side} {policy}: wasm VM failures:\n" + "\n".join(failures[:5]))
    return rows, time.perf_counter() - t0


def direct(e: Engine, prompt: list[int], max_tokens: int = 1) -> None:
    c = Client("127.0.0.1", e.port, timeout_s=120)
    try:
        r = c.complete(prompt, max_tokens=max_tokens, ignore_eos=True,
                       extra={"model": "tiny", "temperature": 0})
    finally:
        c.close()
    if not r.ok:
        raise StackError(f"{e.name}: {r}")


def reset_caches(s: RealStack, salt: int) -> None:
    """Empties every engine's prefix cache and waits until its adapter has seen it."""
    for e in s.engines:
        before = prom(e.adapter_metrics(), "kvsteer_feed_engine_events_total", type="cleared")
        wait_until(f"{e.name} resets its prefix cache", lambda e=e: json.loads(
            http_req(f"http://{e.endpoint}/reset_prefix_cache", "POST", b"{}"))["success"], 30, 0.5)
        # vLLM publishes AllBlocksCleared with its next step's events: a short request of its own.
        for k in range(5):
            direct(e, tokens(40, salt + 10 * e.index + k))
            try:
                wait_until(f"{e.name}'s adapter sees AllBlocksCleared", lambda e=e: prom(
                    e.adapter_metrics(), "kvsteer_feed_engine_events_total", type="cleared") > before,
                    3)
                break
            except AssertionError:
                continue
        else:
            raise StackError(f"{e.name}: no AllBlocksCleared after 5 requests")


def real_side(doc: dict, policies: list[str], a: argparse.Namespace, results: dict) -> None:
    s = RealStack(gpu_blocks=None, max_model_len=a.max_model_len)
    try:
        results["real_engines_start_s"] = s.start_fleet(REPLICAS, ENGINE_START_S)
        log(f"real: 4 engines ready in {results['real_engines_start_s']:.0f} s")
        s.replicas = [_replica(e) for e in s.engines]
        for e in s.engines:
            wait_until(f"{e.name}'s adapter learns the block count",
                       lambda e=e: prom(e.adapter_metrics(), "kvsteer_feed_max_blocks") > 0, 30)
        info = [ln for ln in s.engines[0].engine_metrics().splitlines()
                if ln.startswith("vllm:cache_config_info")]
        results["real_cache_config"] = info[0] if info else ""
        results["vllm"] = json.loads(http_req(f"http://{s.engines[0].endpoint}/version"))["version"]
        # Warm-up: an engine's first requests pay one-off costs.
        for e in s.engines:
            for n in (64, 1024, 3000):
                direct(e, tokens(n, 90_000 + n + e.index), max_tokens=8)
        for j, policy in enumerate(policies):
            reset_caches(s, 95_000 + 100 * j)
            s.start_envoy_real(plugin(policy))
            log(f"real {policy}: envoy on 127.0.0.1:{s.listen_port}")
            rows, wall = run_policy(s, doc, policy, "real")
            assert s.envoy is not None
            s.envoy.stop()
            s.procs.remove(s.envoy)
            s.envoy = None
            results["real"][policy] = {"wall_s": wall, "summary": summarize(rows, 1.0, None),
                                       "rows": rows}
            _save(results, a)
    finally:
        s.close()


def _replica(e: Engine):
    from stack import Replica
    assert e.engine is not None
    return Replica(e.name, e.port, e.engine)


def sim_side(doc: dict, policies: list[str], a: argparse.Namespace, results: dict) -> None:
    prof = json.loads(Path(a.profile).read_text())
    meas = Path(a.profile).with_name(Path(a.profile).stem + ".measurements.json")
    eng = json.loads(meas.read_text()).get("engine", {}) if meas.exists() else {}
    blocks = a.kv_blocks or eng.get("num_gpu_blocks") or prof["kv_blocks_16"] * 16 // BLOCK
    extra = ["--profile", str(Path(a.profile).resolve()), "--kv-blocks", str(blocks),
             "--block-size", str(BLOCK),
             "--max-batch-tokens", str(eng.get("max_num_batched_tokens", 2048)),
             "--max-running", str(eng.get("max_num_seqs", 128)),
             "--max-model-len", str(a.max_model_len), "--model", "tiny",
             "--time-scale", str(a.sim_time_scale)]
    results["sim_flags"] = extra
    results["sim_slowdown"] = a.sim_slowdown
    results["sim_time_scale"] = a.sim_time_scale
    for policy in policies:
        with Stack(quiet=False) as st:
            st.start_replicas(REPLICAS, extra=extra)
            if a.sim_slowdown != 1.0:
                # Every step of every replica a.sim_slowdown times longer (the sim's fault knob).
                for r in st.replicas:
                    http_req(f"http://{r.endpoint}/admin/fault", "POST",
                             json.dumps({"slowdown": a.sim_slowdown}).encode())
            st.start_envoy("envoy", plugin_overrides=plugin(policy, a.sim_time_scale))
            rows, wall = run_policy(st, doc, policy, "sim", a.sim_time_scale)
        results["sim"][policy] = {"wall_s": wall, "summary": summarize(rows, 1.0, None),
                                  "rows": rows}
        _save(results, a)


def _save(results: dict, a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(results))
    (out / "fidelity.md").write_text(report(results))


def _winner(vals: dict[str, float], lower_better: bool) -> tuple[str, float]:
    (pa, va), (pb, vb) = vals.items()
    top = max(abs(va), abs(vb))
    g = abs(va - vb) / top if top else 0.0
    if lower_better:
        return (pa if va < vb else pb), g
    return (pa if va > vb else pb), g


def report(results: dict) -> str:
    md = []
    p = results["params"]
    n = p["requests"]
    md.append(f"Workload: {p['sessions']} rollouts x {p['turns']} turns = {n} requests, "
              f"{p['concurrency']} in flight; system prompt {p['system']} tokens, task prompt "
              f"{p['task']} (groups of {p['group']}), answers {p['out_min']}-{p['out_max']} tokens "
              f"({p['straggler_frac'] * 100:.0f}% stragglers of {p['straggler_out']}), "
              f"tool results {p['tool_min']}-{p['tool_max']} tokens, think "
              f"{p['think_min_ms']}-{p['think_max_ms']} ms; prompt tokens {p['prompt_tokens']:,}, "
              f"output tokens {p['output_tokens']:,}. Commit `{results['commit']}`.\n")
    md.append("| policy | hit rate % real / sim (diff pp) | TTFT p50 ms real / sim | "
              "TTFT p99 ms real / sim | output tok/s real / sim | wall s real / sim | failed |")
    md.append("|---|---:|---:|---:|---:|---:|---:|")
    for pol in results["policies"]:
        r = results["real"].get(pol, {}).get("summary")
        s = results["sim"].get(pol, {}).get("summary")

        def cell(f, fmt: str) -> str:
            a = format(f(r), fmt) if r else "-"
            b = format(f(s), fmt) if s else "-"
            return f"{a} / {b}"

        diff = f" ({(r['hit_rate'] - s['hit_rate']) * 100:+.1f})" if r and s else ""
        walls = (f"{results['real'].get(pol, {}).get('wall_s', 0):.0f} / "
                 f"{results['sim'].get(pol, {}).get('wall_s', 0):.0f}")
        failed = f"{r['failed'] if r else '-'} / {s['failed'] if s else '-'}"
        md.append(f"| {pol} | {cell(lambda x: x['hit_rate'] * 100, '.1f')}{diff} | "
                  f"{cell(lambda x: x['ttft_ms']['p50'], '.0f')} | "
                  f"{cell(lambda x: x['ttft_ms']['p99'], '.0f')} | "
                  f"{cell(lambda x: x['output_tokens_per_s'], '.0f')} | {walls} | {failed} |")
    md.append("")
    both = [pol for pol in results["policies"]
            if pol in results["real"] and pol in results["sim"]]
    if both:
        ok = [pol for pol in both if abs(results["real"][pol]["summary"]["hit_rate"]
                                         - results["sim"][pol]["summary"]["hit_rate"]) <= 0.05]
        md.append(f"Hit rates within 5 percentage points: {len(ok)} of {len(both)} policies"
                  + (f" (not: {', '.join(x for x in both if x not in ok)})" if len(ok) < len(both)
                     else "") + ".\n")
    if both:
        md.append("Where the time goes (real / sim): TTFT p50 of requests that found most of their "
                  "prompt cached (hit >= 50%) and of the others, their share, the requests per "
                  "replica, and time per output token p50.\n")
        md.append("| policy | TTFT p50 ms, hit >= 50% | TTFT p50 ms, hit < 50% | share hit >= 50% | "
                  "requests per replica | TPOT p50 ms |")
        md.append("|---|---:|---:|---:|---|---:|")
        for pol in both:
            cells = []
            for side in ("real", "sim"):
                rows = [r for r in results[side][pol]["rows"] if r["ok"]]
                hi = [r["ttft_s"] * 1e3 for r in rows
                      if r["prompt_tokens"] and r["cached_tokens"] >= 0.5 * r["prompt_tokens"]]
                lo = [r["ttft_s"] * 1e3 for r in rows
                      if not (r["prompt_tokens"] and r["cached_tokens"] >= 0.5 * r["prompt_tokens"])]
                per = results[side][pol]["summary"]["requests_per_replica"]
                cells.append((pct(hi, 50), pct(lo, 50), len(hi) / max(1, len(rows)),
                              "-".join(str(v) for v in sorted(per.values())),
                              results[side][pol]["summary"]["tpot_ms"]["p50"]))
            (a, b) = cells
            md.append(f"| {pol} | {a[0]:.0f} / {b[0]:.0f} | {a[1]:.0f} / {b[1]:.0f} | "
                      f"{a[2] * 100:.0f}% / {b[2] * 100:.0f}% | {a[3]} / {b[3]} | "
                      f"{a[4]:.1f} / {b[4]:.1f} |")
        md.append("")
    pair = ["kv_load", "session_hash"]
    if all(x in results["real"] and x in results["sim"] for x in pair):
        md.append("| kv_load vs session_hash | real: better (gap) | sim: better (gap) | same |")
        md.append("|---|---|---|---|")
        for name, f, low in (("TTFT p50", lambda x: x["ttft_ms"]["p50"], True),
                             ("TTFT p99", lambda x: x["ttft_ms"]["p99"], True),
                             ("output tok/s", lambda x: x["output_tokens_per_s"], False)):
            wr, gr = _winner({x: f(results["real"][x]["summary"]) for x in pair}, low)
            ws, gs = _winner({x: f(results["sim"][x]["summary"]) for x in pair}, low)
            same = "yes" if wr == ws else "**no**"
            if min(gr, gs) < TIE and wr != ws:
                same += f" (a gap under {TIE * 100:.0f}%)"
            md.append(f"| {name} | {wr} ({gr * 100:.1f}%) | {ws} ({gs * 100:.1f}%) | {same} |")
        md.append("")
    return "\n".join(md) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=["both", "real", "sim"], default="both")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--profile", default="out/fidelity/profile.json",
                    help="the fitted profile (scripts/fit-profile); its .measurements.json beside "
                         "it gives the engine's block count, budget and sequence cap")
    ap.add_argument("--kv-blocks", type=int, default=0, help="override the sim's KV blocks")
    ap.add_argument("--sim-slowdown", type=float, default=1.0,
                    help="every simulated step this many times longer (POST /admin/fault "
                         "slowdown): the CPU contention the profile, fitted on one engine, lacks")
    ap.add_argument("--sim-time-scale", type=float, default=1.0,
                    help="simulated replicas this many times faster than real time (times read as "
                         "engine time; the proxy's and client's own latency magnified as much)")
    ap.add_argument("--out", default="out/fidelity")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other side's results already in <out>/fidelity.json")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--sessions", type=int, default=160)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--task", type=int, default=512)
    ap.add_argument("--out-min", type=int, default=32)
    ap.add_argument("--out-max", type=int, default=192)
    ap.add_argument("--straggler-frac", type=float, default=0.05,
                    help="fraction of answers that are stragglers of --straggler-out tokens")
    ap.add_argument("--straggler-out", type=int, default=768)
    ap.add_argument("--tool-min", type=int, default=64)
    ap.add_argument("--tool-max", type=int, default=384)
    ap.add_argument("--think-min-ms", type=int, default=100)
    ap.add_argument("--think-max-ms", type=int, default=600)
    a = ap.parse_args()
    doc = workload(a)
    policies = a.policies.split(",")
    params = {k: v for k, v in vars(a).items()
              if k in ("seed", "sessions", "group", "turns", "concurrency", "system", "task",
                       "out_min", "out_max", "straggler_frac", "straggler_out", "tool_min",
                       "tool_max", "think_min_ms",
                       "think_max_ms", "max_model_len")}
    params["requests"] = sum(len(s["turns"]) for s in doc["sessions"])
    params["prompt_tokens"] = sum(len(t["prompt"]) for s in doc["sessions"] for t in s["turns"])
    params["output_tokens"] = sum(t["max_tokens"] for s in doc["sessions"] for t in s["turns"])
    results = {"commit": commit(), "params": params, "policies": policies, "real": {}, "sim": {},
               "wasm": report_path(wasm_path()), "sim_bin": report_path(sim_path())}
    out = Path(a.out) / "fidelity.json"
    if a.merge and out.exists():
        old = json.loads(out.read_text())
        if old.get("params") != params:
            raise SystemExit(f"--merge: {out} holds another workload: {old.get('params')}")
        for k, v in old.items():
            if k not in ("commit", "params", "policies", "real", "sim"):
                results.setdefault(k, v)
        results["real"], results["sim"] = old.get("real", {}), old.get("sim", {})
        results["policies"] = list(dict.fromkeys(old.get("policies", []) + policies))
    log(f"workload: {params}")
    t0 = time.monotonic()
    if a.side in ("both", "real"):
        results["real"] = {}
        real_side(doc, policies, a, results)
    if a.side in ("both", "sim"):
        results["sim"] = {}
        sim_side(doc, policies, a, results)
    results[f"wall_s_{a.side}"] = time.monotonic() - t0
    _save(results, a)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

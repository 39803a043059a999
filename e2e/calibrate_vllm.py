"""Calibration of `kv_time` against real vLLM CPU engines (docs/guide/real-vllm.md, "Calibration of
kv_time against the real engines"): each request's predicted time to first token, as the filter
prices it, against the time to first token the client sees.

The stack: 2 vLLM 0.32 CPU engines serving the tiny random-weight Llama (block size 32, one core
each, `--max-model-len 8192`, the engine's own KV cache), a `kvsteer-feed` beside each
(e2e/test_real_vllm.py's RealStack), and Envoy with the release filter configured with
`"policy": "kv_time"`, the profile `scripts/fit-profile` fitted (`--profile`) and `explain_header`,
so every answer carries each candidate's terms and the winner. All on 127.0.0.1.

`scripts/fit-profile` writes the simulator's profile form: its coefficients, without the two fields
`kv_time.profile` needs beyond them. This script adds them from the fit's measurements
(profile.measurements.json beside it): `kv_cache_tokens` (the engine's KV blocks x 32) and
`chunk_tokens` (the scheduler's `max_num_batched_tokens`); everything else is passed as fitted (the
filter accepts the simulator's extra fields and ignores them: `request_overhead_us` is one, so the
fixed cost of a request outside the engine's steps is not in the prediction). A coefficient the fit
put below zero (kv_time refuses it) is set to 0, and said so.

The workload, low load: one request in flight at a time, streamed, drawn from a fixed seed. Prompts
are fresh (length log-uniform from 16 tokens to near the context limit) or follow-ups that extend an
earlier prompt (or a cut of it) by 1 to 4,096 new tokens, so the cached share varies from none to
almost all. Before each request the filter has polled both feeds twice since the last one ended
and a worker tick has passed, so its view of the caches is current: the error measured is the
profile's and the path's, not the feed's lag (the filter's matched tokens are recorded beside the
engine's `cached_tokens` to show it).

Per request: the winner's predicted TTFT (`wait + prefill (+ adapter)` from the header, so with the
replica's learned speed), the replica, the filter's matched tokens, the engine's cached tokens, the
realized TTFT at the client (send to the first streamed event), and the prediction at the profile's
own speed (the header's divided by the learned factor in use, read from the filter's gauge
before the request). Then: the overhead the profile does not model, from probes whose prompt is
cached on both engines but for one token (so the engine computes one token wherever it goes): their
TTFT through Envoy and then straight to the engine that served them, against the prediction.
Finally the filter's `kvsteer_ttft_observed_per_predicted_milli_<replica>` gauges.

Writes <out>/results.json (parameters, the profile, every request, the probes, the summary) and
prints the tables. Run by scripts/calibrate-vllm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_envoy import commit, pct  # noqa: E402
from client import Client, Result, tokens  # noqa: E402
from stack import StackError, report_path, wasm_path  # noqa: E402
from test_real_vllm import (BLOCK, PEER_SETTLE_S, REPLICA_HEADER, Engine, RealStack,  # noqa: E402
                            feed_polls, prom, require_vllm, wait_until)
from test_real_vllm import http as http_req  # noqa: E402

REPLICAS = 2
ENGINE_START_S = 400
EXPLAIN = "x-kvsteer-explain"
REQUEST_TIMEOUT_S = 120


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the profile ------------------------------------------------------------------------------------


def kv_time_profile(path: Path) -> tuple[dict, dict]:
    """fit-profile's output in the form `kv_time.profile` takes, and the engine limits it was fitted
    with: the fitted coefficients plus `kv_cache_tokens` and `chunk_tokens` from the measurements
    file beside it."""
    prof = json.loads(path.read_text())
    meas = path.with_name(path.stem + ".measurements.json")
    eng = json.loads(meas.read_text()).get("engine", {}) if meas.exists() else {}
    out = dict(prof)
    if "kv_cache_tokens" not in out:
        blocks = eng.get("num_gpu_blocks") or prof.get("kv_blocks_16", 0) * 16 // BLOCK
        out["kv_cache_tokens"] = float(blocks * BLOCK)
    if "chunk_tokens" not in out:
        out["chunk_tokens"] = float(eng.get("max_num_batched_tokens", 2048))
    # A least-squares fit can come out below zero on a coefficient the data barely fixes (on a busy
    # machine, the KV read per decode token); kv_time refuses a negative one, so it becomes 0 (the
    # fit's own value is kept in `clamped`).
    clamped = {}
    for k in ("step_overhead_us", "per_seq_us", "weights_us", "kv_read_us_per_token",
              "compute_us_per_token", "attn_us_per_pair"):
        if out.get(k, 0.0) < 0:
            clamped[k] = out[k]
            out[k] = 0.0
    if clamped:
        eng = dict(eng, clamped=clamped)
        log(f"profile: negative fitted coefficients set to 0: {clamped}")
    return out, eng


def prefill_s(p: dict, uncached: float, cached: float) -> float:
    """`EngineProfile::prefill_s` (core/src/speed.rs), at the profile's own speed."""
    u, c = max(0.0, uncached), max(0.0, cached)
    chunks = max(1.0, math.ceil(u / p["chunk_tokens"]))
    linear = max(p["compute_us_per_token"] * u, p["weights_us"] * chunks)
    attention = p["attn_us_per_pair"] * u * (c + u / 2.0)
    return (linear + attention + p["step_overhead_us"] * chunks) * 1e-6


# -- the explain header -----------------------------------------------------------------------------

_TERM = re.compile(r"([a-z]+)=(-?[0-9.eE+-]+)")


def parse_explain(text: str) -> tuple[int, list[dict[str, float]]]:
    """`winner=R; 0: cost=.. wait=.. prefill=..; 1: ...` -> (R, terms per replica index)."""
    parts = [s.strip() for s in text.split(";")]
    winner = int(parts[0].split("=", 1)[1])
    cands: list[dict[str, float]] = []
    for part in parts[1:]:
        idx, _, rest = part.partition(":")
        terms = {k: float(v) for k, v in _TERM.findall(rest)}
        while len(cands) <= int(idx):
            cands.append({})
        cands[int(idx)] = terms
    return winner, cands


def predicted_ttft(t: dict[str, float]) -> float:
    return t.get("wait", 0.0) + t.get("prefill", 0.0) + t.get("adapter", 0.0)


# -- the workload -----------------------------------------------------------------------------------


def workload(a: argparse.Namespace) -> list[dict]:
    """One request after another: fresh prompts and follow-ups extending an earlier prompt."""
    rng = random.Random(a.seed)
    limit = a.max_model_len - a.max_tokens_max - 8
    prompts: list[list[int]] = []
    out = []
    for i in range(a.requests):
        salt = a.seed * 1_000_003 + 1_000 * i
        max_tokens = rng.randint(a.max_tokens_min, a.max_tokens_max)
        if not prompts or rng.random() < a.fresh_share:
            n = int(math.exp(rng.uniform(math.log(16), math.log(limit))))
            prompt, kind, parent = tokens(n, salt), "fresh", -1
        else:
            parent = rng.randrange(len(prompts))
            base = prompts[parent]
            ext = int(math.exp(rng.uniform(0.0, math.log(4096))))
            # A cut of the earlier prompt when it leaves no room (or one time in five): a shared
            # prefix shorter than the whole.
            keep = len(base)
            if keep + ext > limit or rng.random() < 0.2:
                keep = rng.randint(min(32, len(base)), max(min(32, len(base)), min(len(base), limit - ext)))
            prompt, kind = base[:keep] + tokens(ext, salt + 1), "follow-up"
        prompts.append(prompt)
        out.append({"i": i, "kind": kind, "parent": parent, "prompt": prompt,
                    "max_tokens": max_tokens})
    return out


# -- the stack --------------------------------------------------------------------------------------


def start(a: argparse.Namespace, profile: dict) -> RealStack:
    require_vllm()
    s = RealStack(gpu_blocks=None, max_model_len=a.max_model_len)
    try:
        log(f"engines ready in {s.start_fleet(REPLICAS, ENGINE_START_S):.0f} s")
        s.serve_engines(timeout_s=30)
        # Warm-up: an engine's first requests (and its first long ones) pay one-off costs.
        for e in s.engines:
            for n in (64, 1024, 4096, a.max_model_len - 64):
                direct(e, tokens(n, 70_000 + n + e.index), max_tokens=4)
        s.start_envoy_real({
            "routing": {"policy": "kv_time", "block_size": BLOCK,
                        "kv_time": {"profile": profile}},
            "explain_header": EXPLAIN,
        })
        log(f"envoy on 127.0.0.1:{s.listen_port} (admin {s.admin_port}), policy kv_time")
    except BaseException:
        s.close()
        raise
    return s


def complete(port: int, prompt: list[int], max_tokens: int) -> Result:
    c = Client("127.0.0.1", port, timeout_s=REQUEST_TIMEOUT_S)
    try:
        return c.complete(prompt, max_tokens=max_tokens, stream=True, ignore_eos=True,
                          extra={"model": "tiny", "temperature": 0})
    finally:
        c.close()


def direct(e: Engine, prompt: list[int], max_tokens: int = 4) -> Result:
    r = complete(e.port, prompt, max_tokens)
    if not r.ok:
        raise StackError(f"{e.name}: {r}")
    return r


def settle(s: RealStack) -> None:
    """Until the filter has polled every feed twice more (what the adapters hold now has been read),
    then a worker tick for the relay to the other worker."""
    for e in s.engines:
        n = feed_polls(s, e)
        wait_until(f"two more polls of {e.name}'s feed", lambda e=e, n=n: feed_polls(s, e) >= n + 2,
                   10, 0.05)
    time.sleep(PEER_SETTLE_S)


def gauges(s: RealStack) -> dict[str, int]:
    return {e.name: s.metric(f"kvsteer_ttft_observed_per_predicted_milli_{e.name}")
            for e in s.engines}


def routed(s: RealStack, prompt: list[int], max_tokens: int, profile: dict) -> dict:
    """One request through Envoy, with what the filter predicted and the client saw."""
    by_ep = {e.endpoint: e for e in s.engines}
    g0 = gauges(s)
    m0 = s.metric("kvsteer_matched_tokens")
    r = complete(s.listen_port, prompt, max_tokens)
    if not r.ok:
        raise StackError(f"request failed: {r}")
    text = r.headers.get(EXPLAIN)
    if not text:
        raise StackError(f"no {EXPLAIN} header on the answer (is the policy kv_time?): {r.headers}")
    winner, cands = parse_explain(text)
    served = by_ep.get(r.headers.get(REPLICA_HEADER, ""))
    if served is None or served.index != winner:
        raise StackError(f"served by {r.headers.get(REPLICA_HEADER)!r}, the filter chose {winner}")
    matched = s.metric("kvsteer_matched_tokens") - m0
    w = cands[winner]
    pred = predicted_ttft(w)
    # The learned factor in use: the winner's gauge as the workers last wrote it before the request
    # (1000 until a worker has routed). A check of it: the header's prefill against the profile's,
    # for the prompt the filter priced (whole blocks) and the tokens it matched, where the header's
    # four decimals leave it precise (a prefill of 5 ms or more).
    speed = (g0.get(served.name) or 1000) / 1e3
    pred1 = (w.get("wait", 0.0) + w.get("prefill", 0.0)) / speed + w.get("adapter", 0.0)
    priced = math.ceil(len(prompt) / BLOCK) * BLOCK
    p1 = prefill_s(profile, priced - matched, matched)
    header_speed = w["prefill"] / p1 if p1 >= 0.005 and w.get("prefill", 0) > 0 else None
    return {"replica": served.name, "winner": winner, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "matched_tokens": matched,
            "completion_tokens": r.completion_tokens, "ttft_s": r.ttfb_s, "total_s": r.total_s,
            "predicted_s": pred, "predicted_profile_s": pred1, "speed_in_use": speed,
            "speed_from_header": header_speed,
            "predicted_engine_view_s": prefill_s(profile, len(prompt) - r.cached_tokens,
                                                 r.cached_tokens),
            "terms": cands, "explain": text}


# -- overhead probes --------------------------------------------------------------------------------


def probes(s: RealStack, a: argparse.Namespace, profile: dict) -> list[dict]:
    """Prompts cached but for their last token on both engines, so that wherever the filter sends
    one it computes one token: each through Envoy, then straight to the engine that served it (same
    cache state, same engine), `probe_reps` times per length. What a request costs beyond the
    engine's computing one token, by path and prompt length."""
    out = []
    by_name = {e.name: e for e in s.engines}
    lengths = [32, 1024, 4096, (a.max_model_len - 64) // BLOCK * BLOCK]
    for n in lengths:
        prompt = tokens(n, 80_000 + n) + [7]
        for e in s.engines:
            direct(e, prompt)  # caches the n tokens' blocks on every engine
        for k in range(a.probe_reps):
            settle(s)
            v = routed(s, prompt, 4, profile)
            e = by_name[v["replica"]]
            d = direct(e, prompt)
            out.append({"engine": e.name, "prompt_tokens": n + 1, "rep": k,
                        "direct_ttft_s": d.ttfb_s, "direct_cached": d.cached_tokens,
                        "envoy_ttft_s": v["ttft_s"], "envoy_cached": v["cached_tokens"],
                        "predicted_s": v["predicted_s"],
                        "predicted_profile_s": v["predicted_profile_s"],
                        "speed_in_use": v["speed_in_use"], "explain": v["explain"]})
    return out


# -- statistics -------------------------------------------------------------------------------------


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(xs: list[float], ys: list[float]) -> float:
    """Pearson's correlation of the ranks."""
    if len(xs) < 3:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return sxy / (sx * sy) if sx and sy else float("nan")


def summarize(rows: list[dict], key: str = "predicted_s") -> dict:
    rows = [r for r in rows if r[key] == r[key] and r[key] > 0]
    if not rows:
        return {"n": 0}
    pred = [r[key] for r in rows]
    real = [r["ttft_s"] for r in rows]
    ratio = [b / a for a, b in zip(pred, real)]
    err = [abs(b - a) * 1e3 for a, b in zip(pred, real)]
    gap = [(b - a) * 1e3 for a, b in zip(pred, real)]
    return {"n": len(rows), "spearman": spearman(pred, real),
            "median_abs_error_ms": statistics.median(err),
            "median_gap_ms": statistics.median(gap),
            "ratio_p10": pct(ratio, 10), "ratio_p50": statistics.median(ratio),
            "ratio_p90": pct(ratio, 90),
            "predicted_p50_ms": statistics.median(pred) * 1e3,
            "realized_p50_ms": statistics.median(real) * 1e3}


def mostly_cached(r: dict) -> bool:
    return r["prompt_tokens"] > 0 and r["cached_tokens"] >= 0.5 * r["prompt_tokens"]


def groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    out = [("all", rows),
           ("mostly cached (>= 50%)", [r for r in rows if mostly_cached(r)]),
           ("mostly uncached", [r for r in rows if not mostly_cached(r)])]
    for lo, hi in ((0, 256), (256, 1024), (1024, 4096), (4096, 1 << 30)):
        sel = [r for r in rows if lo <= r["prompt_tokens"] - r["cached_tokens"] < hi]
        label = f"uncached {lo}-{hi - 1}" if hi < 1 << 30 else f"uncached >= {lo}"
        out.append((label, sel))
    return out


def probe_summary(ps: list[dict], profile: dict) -> list[dict]:
    out = []
    for n in sorted({p["prompt_tokens"] for p in ps}):
        sel = [p for p in ps if p["prompt_tokens"] == n]
        # What the profile says of the one token the engine computes (its exact count: the filter
        # prices the last, partial block as a whole one).
        exact = prefill_s(profile, 1, n - 1) * 1e3
        d = statistics.median(p["direct_ttft_s"] for p in sel) * 1e3
        v = statistics.median(p["envoy_ttft_s"] for p in sel) * 1e3
        pr = statistics.median(p["predicted_s"] for p in sel) * 1e3
        pr1 = statistics.median(p["predicted_profile_s"] for p in sel) * 1e3
        out.append({"prompt_tokens": n, "cached_tokens": min(p["envoy_cached"] for p in sel),
                    "n": len(sel), "engines": sorted({p["engine"] for p in sel}),
                    "direct_ms": d, "envoy_ms": v, "envoy_minus_direct_ms": v - d,
                    "envoy_minus_direct_each_ms": statistics.median(
                        (p["envoy_ttft_s"] - p["direct_ttft_s"]) * 1e3 for p in sel),
                    "predicted_ms": pr, "predicted_profile_ms": pr1, "exact_ms": exact,
                    "direct_minus_exact_ms": d - exact, "envoy_minus_predicted_ms": v - pr})
    return out


# -- report -----------------------------------------------------------------------------------------


def group_table(summary: list) -> list[str]:
    md = ["| requests | n | Spearman | median abs error ms | median realized - predicted ms | "
          "realized / predicted p10 / p50 / p90 | predicted p50 ms | realized p50 ms |",
          "|---|---:|---:|---:|---:|---|---:|---:|"]
    for label, s in summary:
        if not s.get("n"):
            md.append(f"| {label} | 0 | - | - | - | - | - | - |")
            continue
        rho = f"{s['spearman']:.3f}" if s["spearman"] == s["spearman"] else "-"
        md.append(f"| {label} | {s['n']} | {rho} | {s['median_abs_error_ms']:.1f} | "
                  f"{s['median_gap_ms']:+.1f} | {s['ratio_p10']:.2f} / {s['ratio_p50']:.2f} / "
                  f"{s['ratio_p90']:.2f} | {s['predicted_p50_ms']:.1f} | {s['realized_p50_ms']:.1f} |")
    return md


def table(res: dict) -> str:
    md = ["The winner's predicted TTFT as routed (wait + prefill (+ adapter), with the learned "
          "speed), against the client's:\n"]
    md += group_table(res["summary"])
    md.append("\nThe same at the profile's own speed (divided by the learned factor in use):\n")
    md += group_table(res["summary_profile_speed"])
    md.append("")
    ps = res["summary_engine_view"]
    if ps.get("n"):
        md.append(f"The profile priced with the engine's own cached tokens, exact token counts, speed "
                  f"1: Spearman {ps['spearman']:.3f}, median abs error {ps['median_abs_error_ms']:.1f} "
                  f"ms, realized / predicted {ps['ratio_p10']:.2f} / {ps['ratio_p50']:.2f} / "
                  f"{ps['ratio_p90']:.2f}.")
    v = res["view"]
    md.append(f"Filter's matched tokens against the engine's cached tokens: equal on {v['equal']} of "
              f"{v['n']} requests; the filter credited more on {v['filter_more']}, fewer on "
              f"{v['filter_less']} (largest gap {v['max_gap']} tokens).")
    md.append("")
    md.append("Overhead: prompts cached on both engines but for one token (median of the probes per "
              "length), TTFT through Envoy and then straight to the engine that served it, and the "
              "prediction:\n")
    md.append("| prompt tokens | cached | probes | via Envoy ms | direct ms | Envoy - direct ms "
              "(median of pairs) | predicted ms | at speed 1 ms | profile, 1 token ms | "
              "direct - profile, 1 token ms | via Envoy - predicted ms |")
    md.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in res["probe_summary"]:
        md.append(f"| {p['prompt_tokens']} | {p['cached_tokens']} | {p['n']} | {p['envoy_ms']:.1f} | "
                  f"{p['direct_ms']:.1f} | {p['envoy_minus_direct_each_ms']:+.1f} | "
                  f"{p['predicted_ms']:.1f} | {p['predicted_profile_ms']:.1f} | "
                  f"{p['exact_ms']:.1f} | {p['direct_minus_exact_ms']:+.1f} | "
                  f"{p['envoy_minus_predicted_ms']:+.1f} |")
    md.append("")
    md.append("Filter gauges `kvsteer_ttft_observed_per_predicted_milli_<replica>` at the end of the "
              "workload: " + ", ".join(f"{k} {v}" for k, v in res["gauges_end"].items()) +
              f" (after the probes: " + ", ".join(f"{k} {v}" for k, v in
                                                  res["gauges_after_probes"].items()) +
              f"); requests per replica: {res['per_replica']}.")
    md.append(f"Profile `request_overhead_us` (fitted, not used by kv_time): "
              f"{res['profile'].get('request_overhead_us', 0):.0f} us. Load average (1 min) during "
              f"the workload: {res['loadavg_min']:.2f}-{res['loadavg_max']:.2f}.")
    return "\n".join(md) + "\n"


def analyse(res: dict) -> None:
    """The summaries, from the rows and probes in `res`."""
    rows = res["rows"]
    res["summary"] = [(label, summarize(sel)) for label, sel in groups(rows)]
    res["summary_profile_speed"] = [(label, summarize(sel, "predicted_profile_s"))
                                    for label, sel in groups(rows)]
    res["summary_engine_view"] = summarize(rows, "predicted_engine_view_s")
    res["view"] = {"n": len(rows),
                   "equal": sum(1 for r in rows if r["matched_tokens"] == r["cached_tokens"]),
                   "filter_more": sum(1 for r in rows if r["matched_tokens"] > r["cached_tokens"]),
                   "filter_less": sum(1 for r in rows if r["matched_tokens"] < r["cached_tokens"]),
                   "max_gap": max((abs(r["matched_tokens"] - r["cached_tokens"]) for r in rows),
                                  default=0)}
    res["per_replica"] = {e: sum(1 for r in rows if r["replica"] == e)
                          for e in sorted({r["replica"] for r in rows})}
    res["probe_summary"] = probe_summary(res["probes"], res["profile"])
    res["table"] = table(res)


def top_processes() -> list[str]:
    try:
        out = subprocess.run(["ps", "-eo", "pcpu,etimes,comm", "--sort=-pcpu"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in out.splitlines()[1:9]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="out/fidelity/profile.json",
                    help="scripts/fit-profile's output (its .measurements.json beside it)")
    ap.add_argument("--out", default="out/calibration-vllm")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--fresh-share", type=float, default=0.4)
    ap.add_argument("--max-tokens-min", type=int, default=4)
    ap.add_argument("--max-tokens-max", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--probe-reps", type=int, default=8)
    ap.add_argument("--summarize", action="store_true",
                    help="only recompute and print the tables of <out>/results.json")
    a = ap.parse_args()
    if a.summarize:
        path = Path(a.out) / "results.json"
        res = json.loads(path.read_text())
        analyse(res)
        path.write_text(json.dumps(res, indent=1))
        print(res["table"])
        return 0
    t_start = time.monotonic()
    profile, eng = kv_time_profile(Path(a.profile))
    log(f"profile {profile.get('name')}: kv_cache_tokens {profile['kv_cache_tokens']:.0f}, "
        f"chunk_tokens {profile['chunk_tokens']:.0f} (added to fit-profile's output)")
    work = workload(a)
    res: dict = {
        "commit": commit(), "params": vars(a), "profile": profile, "profile_engine": eng,
        "wasm": report_path(wasm_path()), "started_utc": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                         time.gmtime()),
        "cpus": os.cpu_count(), "top_processes_start": top_processes(),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s = start(a, profile)
    try:
        res["vllm"] = json.loads(http_req(f"http://{s.engines[0].endpoint}/version"))["version"]
        rows = []
        t0 = time.monotonic()
        loads = []
        for w in work:
            settle(s)
            loads.append(os.getloadavg()[0])
            row = routed(s, w["prompt"], w["max_tokens"], profile)
            row.update({"i": w["i"], "kind": w["kind"], "parent": w["parent"],
                        "max_tokens": w["max_tokens"], "loadavg_1m": loads[-1],
                        "t_s": time.monotonic() - t0})
            rows.append(row)
            if w["i"] % 10 == 9 or w["i"] == len(work) - 1:
                log(f"{w['i'] + 1}/{len(work)} requests, {time.monotonic() - t0:.0f} s, "
                    f"load {loads[-1]:.2f}, speeds {gauges(s)}")
        res["workload_s"] = time.monotonic() - t0
        res["gauges_end"] = gauges(s)
        res["top_processes_mid"] = top_processes()
        t1 = time.monotonic()
        res["probes"] = probes(s, a, profile)
        res["probes_s"] = time.monotonic() - t1
        res["gauges_after_probes"] = gauges(s)
        failures = s.vm_failures()
        if failures:
            raise StackError("wasm VM failures:\n" + "\n".join(failures[:5]))
    finally:
        s.close()
    res["rows"] = rows
    res["loadavg_min"], res["loadavg_max"] = min(loads), max(loads)
    res["top_processes_end"] = top_processes()
    res["wall_s"] = time.monotonic() - t_start
    res["ended_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    analyse(res)
    text = res["table"]
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(text)
    log(f"calibrate-vllm: {res['wall_s']:.0f} s in all; {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

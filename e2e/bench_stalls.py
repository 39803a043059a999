"""Noisy replica timings through a real Envoy: does `kv_time`, which learns each replica's speed
from the first tokens it observes (docs/design/design.md section 2.7), keep its tail when the
replicas stall at random?

The peers bench's stack and client (e2e/bench_peers.py: its slices, `run_one`; e2e/bench_envoy.py:
`replay`, `summarize`, `pct`): Envoy 1.40 with kvsteer_filter.wasm (o200k tokenizer configured) in
front of 4 fresh `kvsteer-sim serve --tokenizer o200k_base` replicas per run, text prompts, closed
loop. Configurations: the filter with `routing.policy` `kv_time` (the default) and `kv_load` (the
block-count cost, which learns nothing from latency). Conditions:

- `calm`: the replicas as they are;
- `stalls`: every replica started with `--stall-every-s 30 --stall-ms 1000`: a 1 s stall (no engine
  step runs, its requests and new ones wait) after exponential gaps of mean 30 s of engine time,
  drawn from each replica's seed. A second-long stall is what the question named ("simulated
  replicas that stall at random"); every 30 s keeps a replica stalled about 3% of the time and gives
  a run of a minute or two on 4 replicas several stalls, enough to reach the TTFT p99 of a few
  hundred requests without making the fleet mostly stalled. Repeat r adds `--stall-seed r`, so
  each repeat draws other stall times (both policies of a repeat get the same ones, counted from
  the replicas' start), while the replicas' own seeds stay the stack's (1000 + index).

Real time by default (`--time-scale 1`): `kv_time` compares the first tokens it observes, on the
wall clock, with its profile's predictions in engine time, so a time-scaled replay shows it a fleet
`time-scale` times faster than its profile (learned factors pinned at the 4x bound) and a stall
shortened as much; at scale 1 what it learns is what it would learn in front of real engines.

Each repeat runs every (slice, policy, condition) cell once, on fresh replicas and a fresh Envoy,
the four cells of a slice in an order rotated each repeat, so host noise falls on all alike. Per
run: TTFT p50/p90/p99/mean (client wall time x time scale), requests per replica, the host's load
average (/proc/loadavg) before and after, the replicas' `kvsteer_sim:stalls_total` and the
filter's learned speeds (`kvsteer_ttft_observed_per_predicted_milli_<replica>`, Envoy's stats)
at the run's end, and the stalls that held each replica up (`GET /admin/stalls`), from which
every request's TTFT less the stall time it waited out on its replica is computed ("less stalls":
what routing and the queue a stall built decide, where the whole TTFT also holds the stall itself).
Writes <out>/stalls.json (every request), stalls.md (tables) and stalls.svg.
Run by scripts/bench-stalls, which installs Envoy and builds the filter and the sim.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402
from bench_envoy import commit, pct  # noqa: E402
from stack import REPO, prom  # noqa: E402

POLICIES = ["kv_time", "kv_load"]
CONDITIONS = ["calm", "stalls"]
SLICES = ["coding", "mooncake"]
SPEED_GAUGE = "kvsteer_ttft_observed_per_predicted_milli_"


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return []


def replica_stalls(endpoint: str) -> int | None:
    """A replica's `kvsteer_sim:stalls_total` (stalls that held up a step)."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:
            return int(prom(r.read().decode(), "kvsteer_sim:stalls_total"))
    except OSError:
        return None


def held_stalls(endpoint: str) -> tuple[str, list[list[float]]] | None:
    """The stalls that held up a step on a replica (`GET /admin/stalls`), as `[from, end]` on the
    Unix clock in seconds, keyed by the name the replica puts in `x-kvsteer-replica` (what each
    row's `replica` says)."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/admin/stalls", timeout=5) as r:
            name = r.headers.get("x-kvsteer-replica", "")
            doc = json.loads(r.read())
    except (OSError, ValueError):
        return None
    t0, scale = doc["clock_start_unix_us"] / 1e6, doc["time_scale"]
    windows = [[t0 + a / 1e6 / scale, t0 + b / 1e6 / scale] for rank in doc["ranks"]
               for a, b in rank]
    return name, windows


def on_done(st, rows: list[dict]) -> dict:
    """What a run keeps beside bench_peers' summary, read before its stack closes: every request,
    the filter's learned speeds (per replica, in thousandths; several entries when Envoy shows
    the gauge under more than one name), each replica's stalls and when they held it up."""
    speeds: dict[str, list[int]] = {}
    try:
        for name, v in sorted(st.stats("observed_per_predicted").items()):
            if SPEED_GAUGE in name:
                speeds.setdefault(name.split(SPEED_GAUGE, 1)[1], []).append(v)
    except OSError as e:
        speeds = {"error": [str(e)]}
    held = {}
    for r in st.replicas:
        got = held_stalls(r.endpoint)
        if got is not None:
            held[got[0]] = got[1]
    return {"rows": rows, "learned_speed_milli": speeds,
            "stalls_per_replica": {r.name: replica_stalls(r.endpoint) for r in st.replicas},
            "held_stalls": held}


def waited_out(row: dict, held: dict[str, list[list[float]]]) -> float:
    """Seconds of stall a request sat through before its first token: the overlap of its wait
    (from its issue to its first token, on the client's clock) with the held stalls of the replica
    that served it. Time no router could give back once the request was placed there; what is
    left of its TTFT after it is what the placement (and the queue the stall built) cost."""
    start = row.get("issued_unix")
    if start is None:
        return 0.0
    end = start + row["ttft_s"]
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in held.get(row["replica"], ()))


def ttft_figures(rows: list[dict], scale: float, stall_ms: float,
                 held: dict[str, list[list[float]]] | None = None) -> dict:
    """TTFT percentiles and mean in ms, how many first tokens took a stall's length or more
    (`over_stall`: in a calm run, what the slice's own tail puts there), and the same TTFT less
    the stall time each request waited out on its replica (`less_stalls`: p50, p99, mean; and
    `met_stall`, the requests that waited one out). `held`: the replicas' held stalls on the
    Unix clock (`held_stalls`); none in a calm run, where both figures are the same."""
    ok = [r for r in rows if r["ok"]]
    ttft = [r["ttft_s"] * scale * 1e3 for r in ok]
    out = {p: pct(ttft, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))}
    out["mean"] = statistics.fmean(ttft) if ttft else float("nan")
    out["over_stall"] = sum(t >= stall_ms for t in ttft)
    held = held or {}
    lost = [waited_out(r, held) * scale * 1e3 for r in ok]
    less = [t - w for t, w in zip(ttft, lost)]
    out["less_stalls"] = {p: pct(less, q) for p, q in (("p50", 50), ("p99", 99))}
    out["less_stalls"]["mean"] = statistics.fmean(less) if less else float("nan")
    out["met_stall"] = sum(w > 0 for w in lost)
    return out


def cells(rep: int) -> list[tuple[str, str]]:
    """The four (policy, condition) cells of a slice in repeat `rep`'s order: policies and
    conditions alternate, and the order rotates each repeat."""
    base = [("kv_time", "calm"), ("kv_load", "stalls"), ("kv_load", "calm"), ("kv_time", "stalls")]
    k = rep % len(base)
    return base[k:] + base[:k]


def run_all(args, slices: dict) -> dict:
    stall_flags = ("--stall-every-s", f"{args.stall_every_s:g}", "--stall-ms", str(args.stall_ms))
    results = {"commit": commit(), "time_scale": args.time_scale, "repeat": args.repeat,
               "stall_flags": " ".join(stall_flags), "args": vars(args), "slice_meta": {},
               "runs": {}}
    n_runs = args.repeat * len(slices) * len(POLICIES) * len(CONDITIONS)
    started, done = time.perf_counter(), 0
    print(f"== bench-stalls: {len(slices)} slice(s) x {len(POLICIES)} policies x "
          f"{len(CONDITIONS)} conditions x {args.repeat} repeat(s) = {n_runs} runs; stalls: "
          f"{results['stall_flags']}; time scale {args.time_scale:g}", file=sys.stderr)
    for rep in range(args.repeat):
        for sl, doc in slices.items():
            for policy, cond in cells(rep):
                done += 1
                tag = f"[{done}/{n_runs}] {sl} {policy} {cond} #{rep + 1}"
                before = loadavg()
                extra = (*stall_flags, "--stall-seed", str(rep + 1)) if cond == "stalls" else ()
                s = bench_peers.run_one(f"kvsteer {policy}", "kvsteer", policy, doc, args, tag,
                                        replica_extra=extra, on_done=on_done)
                s["repeat"], s["loadavg_start"], s["loadavg_end"] = rep + 1, before, loadavg()
                s["ttft"] = ttft_figures(s["rows"], args.time_scale, args.stall_ms,
                                         s.get("held_stalls"))
                results["runs"].setdefault(sl, {}).setdefault(policy, {}).setdefault(
                    cond, []).append(s)
                t = s["ttft"]
                print(f"   TTFT p50/p90/p99/mean {t['p50']:.0f}/{t['p90']:.0f}/{t['p99']:.0f}/"
                      f"{t['mean']:.0f} ms, less stalls p99 {t['less_stalls']['p99']:.0f} ms "
                      f"({t['met_stall']} met one), failed {s['failed']}, per replica "
                      f"{list(s['requests_per_replica'].values())}, stalls "
                      f"{list(s['stalls_per_replica'].values())}, learned "
                      f"{ {k: v[0] for k, v in s['learned_speed_milli'].items()} }, load "
                      f"{before[:1]}->{s['loadavg_end'][:1]}, wall {s['wall_s']:.0f} s; "
                      f"elapsed {time.perf_counter() - started:.0f} s", file=sys.stderr)
    for sl, doc in slices.items():
        results["slice_meta"][sl] = {
            "source": doc["source"], "sessions": len(doc["sessions"]),
            "requests": sum(len(s["turns"]) for s in doc["sessions"]),
            "concurrency": doc["concurrency"]}
    results["wall_s"] = time.perf_counter() - started
    return results


# ---- report ---------------------------------------------------------------------------------------

def fmt(v, f: str = ".0f") -> str:
    return "-" if v is None or v != v else format(v, f)


def less_p99(run: dict) -> float:
    """A run's TTFT p99 less the stall time each request waited out (NaN in a result written
    before the bench read the replicas' stalls)."""
    return run["ttft"].get("less_stalls", {}).get("p99", float("nan"))


def p99s(results: dict, sl: str, policy: str, cond: str, less: bool = False) -> list[float]:
    return [less_p99(r) if less else r["ttft"]["p99"]
            for r in results["runs"][sl][policy][cond]]


def ratios(results: dict, sl: str, policy: str,
           less: bool = False) -> tuple[float, list[float]]:
    """TTFT p99 stalls / calm: of the medians over repeats, and repeat by repeat. `less`: of the
    TTFT less the stall time waited out (a calm run has none to take off)."""
    calm = p99s(results, sl, policy, "calm", less)
    stalls = p99s(results, sl, policy, "stalls", less)
    per = [s / c if c else float("nan") for c, s in zip(calm, stalls)]
    return statistics.median(stalls) / statistics.median(calm), per


def slice_table(results: dict, sl: str) -> list[str]:
    md = ["| policy | condition | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TTFT mean ms | "
          "p99 per repeat | TTFT >= stall, per repeat | p99 less stalls ms | met a stall, per "
          "repeat | hit rate % | requests per replica (repeat 1) | stalls per replica (repeat 1) "
          "| failed |",
          "|---|---|---:|---:|---:|---:|---|---|---:|---|---:|---|---|---:|"]
    for policy in POLICIES:
        for cond in CONDITIONS:
            runs = results["runs"][sl][policy][cond]
            med = {k: statistics.median(r["ttft"][k] for r in runs)
                   for k in ("p50", "p90", "p99", "mean")}
            md.append(f"| {policy} | {cond} | {fmt(med['p50'])} | {fmt(med['p90'])} | "
                      f"{fmt(med['p99'])} | {fmt(med['mean'])} | "
                      f"{' / '.join(fmt(r['ttft']['p99']) for r in runs)} | "
                      f"{' / '.join(str(r['ttft'].get('over_stall', '-')) for r in runs)} | "
                      f"{fmt(statistics.median(less_p99(r) for r in runs))} | "
                      f"{' / '.join(str(r['ttft'].get('met_stall', '-')) for r in runs)} | "
                      f"{fmt(statistics.median(r['hit_rate'] for r in runs) * 100, '.1f')} | "
                      f"{' / '.join(str(v) for v in runs[0]['requests_per_replica'].values())} | "
                      f"{' / '.join(fmt(v, 'd') for v in runs[0]['stalls_per_replica'].values())}"
                      f" | {sum(r['failed'] for r in runs)} |")
    return md


def report(results: dict) -> str:
    md = ["# kv_time and kv_load with replicas that stall at random\n"]
    md.append(
        f"`scripts/bench-stalls --repeat {results['repeat']}` (e2e/bench_stalls.py): Envoy with "
        f"kvsteer_filter.wasm, `routing.policy` `kv_time` or `kv_load`, in front of 4 fresh "
        f"`kvsteer-sim serve --tokenizer o200k_base --time-scale {results['time_scale']:g}` "
        f"replicas per run; `stalls` adds `{results['stall_flags']} --stall-seed <repeat>` to every replica. Figures are "
        f"medians of {results['repeat']} repeat(s) (cells interleaved), times the client's wall "
        f"time x {results['time_scale']:g}. Commit `{results['commit']}`, wall "
        f"{results['wall_s']:.0f} s.\n")
    for sl in results["runs"]:
        meta = results["slice_meta"][sl]
        md.append(f"## {sl}\n")
        md.append(f"{meta['source']}. {meta['sessions']} sessions, {meta['requests']} requests, "
                  f"{meta['concurrency']} in flight.\n")
        md.extend(slice_table(results, sl))
        md.append("")
        md.append("TTFT p99, stalls / calm (above 1: the stalls cost tail; the bar asked for is "
                  "1.10). `less stalls`: each request's TTFT less the stall time it waited out on "
                  "its replica, what routing and the queue a stall built cost:\n")
        md.append("| policy | of the medians | per repeat | less stalls, of the medians | "
                  "less stalls, per repeat |")
        md.append("|---|---:|---|---:|---|")
        for policy in POLICIES:
            med, per = ratios(results, sl, policy)
            lmed, lper = ratios(results, sl, policy, less=True)
            md.append(f"| {policy} | {med:.2f} | {' / '.join(f'{x:.2f}' for x in per)} | "
                      f"{fmt(lmed, '.2f')} | {' / '.join(fmt(x, '.2f') for x in lper)} |")
        md.append("")
        md.append("Load average (1 min) before -> after each run, per repeat:\n")
        for policy in POLICIES:
            for cond in CONDITIONS:
                la = [f"{fmt(r['loadavg_start'][0], '.2f')}->{fmt(r['loadavg_end'][0], '.2f')}"
                      for r in results["runs"][sl][policy][cond]]
                md.append(f"- {policy} {cond}: {', '.join(la)}")
        md.append("")
        md.append("kv_time's learned speeds at each run's end (thousandths of the profile's time; "
                  "1000 on profile), per replica:\n")
        for cond in CONDITIONS:
            per = []
            for r in results["runs"][sl]["kv_time"][cond]:
                per.append(" ".join(f"{k}={v[0]}" for k, v in r["learned_speed_milli"].items()))
            md.append(f"- {cond}: " + "; ".join(per))
        md.append("")
    md.append("![TTFT p99 per run, calm and stalls](stalls.svg)\n")
    return "\n".join(md) + "\n"


def svg(results: dict) -> str:
    """One panel per slice: TTFT p99 of every run as a dot, per policy and condition, the median
    as a bar; each panel scaled to its own maximum."""
    slices = list(results["runs"])
    cols = [(p, c) for p in POLICIES for c in CONDITIONS]
    colors = {"calm": "#2166ac", "stalls": "#b2182b"}
    pw, ph, left, top = 320, 220, 60, 60
    width = left + len(slices) * (pw + 40) + 10
    height = top + ph + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="18" font-size="13">TTFT p99 per run (dots) and median (bar), calm '
           f'vs stalls ({results["stall_flags"]}); dashed: calm median +10%; open circles: stalls '
           f'p99 less the stall time each request waited out</text>',
           f'<text x="10" y="34">scripts/bench-stalls --repeat {results["repeat"]}, time scale '
           f'{results["time_scale"]:g}, commit {results["commit"]}; lower is better</text>']
    for si, sl in enumerate(slices):
        x0 = left + si * (pw + 40)
        vals = {pc: p99s(results, sl, *pc) for pc in cols}
        hi = max((v for vs in vals.values() for v in vs if v == v), default=1.0) * 1.1 or 1.0
        out.append(f'<text x="{x0}" y="{top - 8}" font-weight="bold">{sl}</text>')
        out.append(f'<line x1="{x0}" y1="{top + ph}" x2="{x0 + pw}" y2="{top + ph}" '
                   f'stroke="black"/>')
        out.append(f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{top + ph}" stroke="black"/>')
        for k in range(5):
            v = hi * k / 4
            y = top + ph - ph * k / 4
            out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.0f}</text>')
            out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + pw}" y2="{y:.1f}" '
                       f'stroke="#ddd"/>')
        step = pw / len(cols)
        for ci, (pc, vs) in enumerate(vals.items()):
            cx = x0 + step * (ci + 0.5)
            good = [v for v in vs if v == v]
            if good:
                med = statistics.median(good)
                y = top + ph - ph * med / hi
                out.append(f'<rect x="{cx - step * 0.3:.1f}" y="{y:.1f}" width="{step * 0.6:.1f}" '
                           f'height="{top + ph - y:.1f}" fill="{colors[pc[1]]}" '
                           f'fill-opacity="0.25"/>')
                out.append(f'<text x="{cx:.1f}" y="{y - 4:.1f}" text-anchor="middle">'
                           f'{med:.0f}</text>')
            for i, v in enumerate(good):
                dx = (i - (len(good) - 1) / 2) * 6
                y = top + ph - ph * v / hi
                out.append(f'<circle cx="{cx + dx:.1f}" cy="{y:.1f}" r="3" '
                           f'fill="{colors[pc[1]]}"/>')
            if pc[1] == "stalls":
                # Open circles: the same runs' p99 with the stall time each request waited out
                # taken off its TTFT.
                less = [v for v in p99s(results, sl, *pc, less=True) if v == v]
                for i, v in enumerate(less):
                    dx = (i - (len(less) - 1) / 2) * 6
                    y = top + ph - ph * v / hi
                    out.append(f'<circle cx="{cx + dx:.1f}" cy="{y:.1f}" r="3.5" fill="none" '
                               f'stroke="black"/>')
            calm = [v for v in vals[(pc[0], "calm")] if v == v]
            if pc[1] == "stalls" and calm:
                # The bar asked for: the calm runs' median + 10%.
                y = top + ph - ph * 1.1 * statistics.median(calm) / hi
                out.append(f'<line x1="{cx - step * 0.45:.1f}" y1="{y:.1f}" '
                           f'x2="{cx + step * 0.45:.1f}" y2="{y:.1f}" stroke="black" '
                           f'stroke-dasharray="4 3"/>')
                out.append(f'<text x="{cx + step * 0.45:.1f}" y="{y - 3:.1f}" '
                           f'text-anchor="end" font-size="9">calm +10%</text>')
            out.append(f'<text x="{cx:.1f}" y="{top + ph + 14}" text-anchor="middle">'
                       f'{pc[0]}</text>')
            out.append(f'<text x="{cx:.1f}" y="{top + ph + 27}" text-anchor="middle" '
                       f'fill="{colors[pc[1]]}">{pc[1]}</text>')
        out.append(f'<text x="{x0 - 45}" y="{top + ph / 2}" transform="rotate(-90 {x0 - 45} '
                   f'{top + ph / 2})" text-anchor="middle">TTFT p99 ms</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "out" / "bench-stalls"))
    ap.add_argument("--slices", default=",".join(SLICES), help="of rl, coding, mooncake")
    ap.add_argument("--stall-every-s", type=float, default=30.0,
                    help="mean engine seconds between a replica's stalls (kvsteer-sim's flag)")
    ap.add_argument("--stall-ms", type=int, default=1000, help="engine ms each stall lasts")
    bench_peers.add_slice_args(ap)
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite stalls.md and stalls.svg from the last run's stalls.json")
    args = ap.parse_args()
    args.repeat = max(1, args.repeat)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        work = REPO / "out" / "bench-stalls-work"
        work.mkdir(parents=True, exist_ok=True)
        builders = bench_peers.slice_builders(args, work)
        wanted = [s for s in args.slices.split(",") if s]
        for s in wanted:
            if s not in builders:
                ap.error(f"unknown slice {s!r} (known: {', '.join(builders)})")
        results = run_all(args, {s: builders[s]() for s in wanted})
        (out / "stalls.json").write_text(json.dumps(results, indent=1))
    results = json.loads((out / "stalls.json").read_text())
    (out / "stalls.md").write_text(report(results))
    (out / "stalls.svg").write_text(svg(results))
    print(report(results))
    failed = sum(r["failed"] for pol in results["runs"].values() for conds in pol.values()
                 for runs in conds.values() for r in runs)
    if failed:
        print(f"failed requests: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

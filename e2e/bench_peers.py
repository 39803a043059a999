"""The peer routers of the benchmark report (docs/reports/results/peers.md): the routers users would pick
instead of kvsteer, run as real processes in front of the same simulated replicas, next to Envoy with
kvsteer's `kv_load` (the default policy when this report was made; `kv_time` is now), through the
same client.

- sglang-router (SGLang's model gateway): `cache_aware`, `manual` (its session policy: the
  `x-smg-routing-key` header pins a key to a replica) and `power_of_two`;
- vllm-router: `cache_aware`, `consistent_hash` (on the `x-session-id` header) and `power_of_two`;
- Envoy 1.40 with kvsteer_filter.wasm, `kv_load`, with the o200k tokenizer configured
  (docs/design/tokenizer.md), so text prompts get the exact block identity.

Three slices, text prompts for everyone (sglang-router refuses token-id prompts):
- `rl`: the harness's `slice-rl` requests (`bench --export-slice`, as scripts/bench-envoy-slice),
  each token id written as one word;
- `coding`: sessions of the coding-agent trace (traces/weka_cc_sample36.jsonl.xz), every 64-token block
  of the trace written as `--coding-words` words, the system and tool prefix shared across sessions as
  the harness's reader shares it; output lengths and think times from the trace, capped;
- `mooncake`: the last requests of the Mooncake trace (traces/mooncake_synthetic_trace.jsonl.xz), every
  512-token block as `--mooncake-words` words (ids global, so requests share prefixes), replayed closed
  loop with `--mooncake-concurrency` in flight, one request a session.

A block's words are a function of the block's identity only, so prompts that share blocks share a text
prefix. The replicas run the o200k_base BPE (`kvsteer-sim --tokenizer o200k_base`), so token counts,
`cached_tokens` and vllm-router's renders are real token ids of that vocabulary.

Each (slice, router) run gets fresh replicas (cold caches) and a fresh router; runs interleave across
repeats. Times are the client's wall times x `--time-scale` (engine time): the routers' and the
client's own overhead is magnified as much. Run by scripts/bench-peers, which installs the routers
(scripts/peers-install) and Envoy and builds the binaries; see its header for options.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_envoy import (  # noqa: E402
    FEED_PERIOD_MS, TICK_MS, Sampler, commit, median_summary, replay, summarize)
from stack import REPO, Stack, StackError, envoy_path, free_ports, target_dir  # noqa: E402

PEERS = REPO / ".peers"

# (label, kind, policy). kind: kvsteer (Envoy + the filter), sglang, vllm.
CONFIGS = [
    ("kvsteer kv_load", "kvsteer", "kv_load"),
    ("sglang cache_aware", "sglang", "cache_aware"),
    ("sglang manual", "sglang", "manual"),
    ("sglang power_of_two", "sglang", "power_of_two"),
    ("vllm cache_aware", "vllm", "cache_aware"),
    ("vllm consistent_hash", "vllm", "consistent_hash"),
    ("vllm power_of_two", "vllm", "power_of_two"),
]

SLICES = ["rl", "coding", "mooncake"]

REPLICAS = 4
TOKENIZER = {"vocabulary": "o200k_base", "chat_template": "kvsteer_sim"}

# Words: two consonant-vowel syllables after a space (" kabo"), 10,000 of them.
_CONS = "bcdfghjklmnprstvwxyz"
_VOW = "aeiou"
_SYL = [c + v for c in _CONS for v in _VOW]


def word(n: int) -> str:
    n %= len(_SYL) ** 2
    return " " + _SYL[n // len(_SYL)] + _SYL[n % len(_SYL)]


def block_text(namespace: str, block: int, words: int) -> str:
    """`words` words that depend on (namespace, block) only."""
    h = hashlib.blake2b(f"{namespace}:{block}".encode(), digest_size=8).digest()
    x = int.from_bytes(h, "little")
    out = []
    for _ in range(words):
        x = (x * 6364136223846793005 + 1442695040888963407) & (2 ** 64 - 1)
        out.append(word(x >> 33))
    return "".join(out)


def rl_slice(bench: Path, work: Path) -> dict:
    """The harness's slice-rl with every token id written as a word (of 10,000: distinct ids can
    share a word, but prompts that share a token prefix share the text prefix, which is what the
    routers and the replicas' caches see)."""
    path = work / "slice-rl.json"
    subprocess.run([str(bench), "--export-slice", str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    doc = json.loads(path.read_text())
    sessions = []
    for s in doc["sessions"]:
        turns = [{"prompt": "".join(word(i * 7919) for i in t["prompt"]),
                  "max_tokens": t["max_tokens"], "think_us": t.get("think_us", 0)}
                 for t in s["turns"]]
        sessions.append({"id": f"rl-{s['id']}", "turns": turns})
    return {"name": "rl", "source": f"bench --export-slice ({doc['scenario']}: "
            f"{json.dumps(doc['params'], separators=(',', ':'))})",
            "concurrency": doc["concurrency"], "sessions": sessions}


# Coding-agent requests over 2,000 trace blocks (128K trace tokens) are skipped, as the harness's
# reader skips them (cutting them would replay the same first blocks with a made-up hit rate).
MAX_CODING_BLOCKS = 2000


def coding_slice(sessions_n: int, turns: int, words: int, out_cap: int, think_cap_s: float) -> dict:
    with lzma.open(REPO / "traces" / "weka_cc_sample36.jsonl.xz", "rt") as f:
        trace = [json.loads(line) for line in f]
    def main_requests(s: dict) -> list[dict]:
        return [r for r in s["requests"]
                if r.get("type") != "subagent" and len(r["hash_ids"]) <= MAX_CODING_BLOCKS]

    picked = [s for s in trace if len(main_requests(s)) >= turns][:sessions_n]
    sessions = []
    for s in picked:
        shared = (s.get("system_tokens", 0) + s.get("tool_tokens", 0)) // s["block_size"]
        out = []
        for r in main_requests(s)[:turns]:
            text = "".join(block_text("weka-main" if i < shared else f"weka:{s['id']}", b, words)
                           for i, b in enumerate(r["hash_ids"]))
            out.append({"prompt": text, "max_tokens": max(1, min(out_cap, r["out"])),
                        "think_us": int(min(think_cap_s, r.get("think_time", 0)) * 1e6)})
        sessions.append({"id": f"cc-{s['id']}", "turns": out})
    return {"name": "coding", "source": f"traces/weka_cc_sample36: {len(picked)} sessions (the "
            f"first {sessions_n} at most) with {turns}+ main requests under {MAX_CODING_BLOCKS} "
            f"blocks, their first {turns} such; "
            f"{words} words a 64-token block; output "
            f"capped at {out_cap}, think time at {think_cap_s:g} s",
            "concurrency": len(sessions), "sessions": sessions}


def mooncake_slice(n: int, words: int, concurrency: int, out_cap: int, first: int = -1) -> dict:
    """`n` consecutive requests of the Mooncake trace from request `first` (-1: the last `n`). The
    trace's prefix reuse builds up over its span: among its first 384 requests 5.6% of the blocks
    are an earlier request's prefix, among its last 384 67.6% (the whole trace: 64%), so the default
    window is the trace's end."""
    with lzma.open(REPO / "traces" / "mooncake_synthetic_trace.jsonl.xz", "rt") as f:
        lines = f.readlines()
    start = max(0, len(lines) - n) if first < 0 else min(first, len(lines))
    reqs = [json.loads(line) for line in lines[start:start + n]]
    sessions = [{"id": f"mc-{i}", "turns": [{
        "prompt": "".join(block_text("mooncake", b, words) for b in r["hash_ids"]),
        "max_tokens": max(1, min(out_cap, r["output_length"])), "think_us": 0}]}
        for i, r in enumerate(reqs)]
    return {"name": "mooncake", "source": f"traces/mooncake_synthetic_trace: requests {start} to "
            f"{start + len(reqs) - 1} of {len(lines)} (its end, where prefix reuse has built up), "
            f"{words} words a 512-token block, output capped at {out_cap}, closed loop",
            "concurrency": concurrency, "sessions": sessions}


# Every request names its session in `x-session-id` (vllm-router's consistent_hash, kvsteer's
# session_hash) and in `x-smg-routing-key` (sglang-router's manual policy); the other policies
# ignore both. The closed-loop client is bench_envoy.replay, the same as the Envoy slice's.
SESSION_HEADERS = ("x-smg-routing-key",)


def router_argv(kind: str, policy: str, urls: list[str], port, metrics_port) -> list[str]:
    """The router's command line: its defaults except where to listen and whom to route to (and a
    free Prometheus port: both default to 29000)."""
    if kind == "sglang":
        head = [str(PEERS / "bin" / "python"), "-m", "sglang_router.launch_router"]
        level = "warn"
    else:
        head = [str(PEERS / "bin" / "vllm-router")]
        level = "warning"
    return [*head, "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-port", str(metrics_port), "--log-level", level]


def wait_router(st: Stack, kind: str, port: int, proc, timeout_s: float = 60) -> None:
    """Until the router answers and sees every replica healthy (sglang-router registers workers in
    the background after it starts listening; vllm-router listens once they are healthy)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not proc.alive():
            raise StackError(f"{proc.what} exited ({proc.popen.returncode}):\n{proc.tail()}")
        try:
            path = "/readiness" if kind == "sglang" else "/health"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                body = r.read().decode(errors="replace")
                if r.status == 200:
                    if kind != "sglang":
                        return
                    doc = json.loads(body)
                    if doc.get("healthy_workers") == REPLICAS:
                        return
                last = body[:200]
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = str(e)
        time.sleep(0.1)
    raise StackError(f"{proc.what} not ready in {timeout_s} s ({last}):\n{proc.tail()}")


def versions() -> dict:
    out = {}
    try:
        v = subprocess.run([str(PEERS / "bin" / "python"), "-c",
                            "import importlib.metadata as m; "
                            "print(m.version('sglang-router'), m.version('vllm-router'))"],
                           capture_output=True, text=True, check=True).stdout.split()
        out["sglang-router"], out["vllm-router"] = v
    except (OSError, subprocess.CalledProcessError, ValueError):
        out["sglang-router"] = out["vllm-router"] = "unknown"
    try:
        line = subprocess.run([str(envoy_path()), "--version"], capture_output=True, text=True,
                              check=True).stdout
        out["envoy"] = " ".join(line.split("version:", 1)[-1].split())[:120]
    except (OSError, subprocess.CalledProcessError):
        out["envoy"] = "unknown"
    return out


def run_one(label: str, kind: str, policy: str, slice_doc: dict, args, tag: str,
            replica_extra: tuple[str, ...] = (), on_done=None) -> dict:
    """One run on fresh replicas and a fresh router. `replica_extra`: more `kvsteer-sim serve`
    flags; `on_done(stack, rows)`, called before the stack closes, returns a dict merged into the
    summary (e2e/bench_stalls.py reads the filter's stats and keeps the rows with it)."""
    total = sum(len(s["turns"]) for s in slice_doc["sessions"])
    t_cfg = time.perf_counter()
    with Stack() as st:
        st.start_replicas(REPLICAS, extra=["--time-scale", str(args.time_scale),
                                           "--tokenizer", TOKENIZER["vocabulary"], *replica_extra])
        if kind == "kvsteer":
            st.start_envoy("envoy", plugin_overrides={
                "routing": {"policy": policy},
                "tokenizer": TOKENIZER,
                "feed_period_ms": max(1, round(FEED_PERIOD_MS / args.time_scale)),
                "tick_ms": max(1, round(TICK_MS / args.time_scale))})
            port = st.listen_port
            command = (f"envoy -c <envoy/envoy.yaml for these replicas> --concurrency 2, plugin "
                       f"configuration routing.policy={policy}, tokenizer {json.dumps(TOKENIZER)}, "
                       f"feed_period_ms and tick_ms the harness's 200 and 100 divided by the time "
                       f"scale (as scripts/bench-envoy-slice)")
        else:
            port, metrics_port = free_ports(2)
            argv = router_argv(kind, policy, [f"http://{r.endpoint}" for r in st.replicas],
                               port, metrics_port)
            proc = st.spawn(f"router-{kind}-{policy}", argv)
            wait_router(st, kind, port, proc)
            # As written in the report: the program's name, the ports as placeholders.
            shown = router_argv(kind, policy, ["http://127.0.0.1:<replica port>"] * REPLICAS,
                                "<port>", "<port>")
            command = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(shown))
        started = time.perf_counter() - t_cfg
        sampler = Sampler([r.endpoint for r in st.replicas], args.sample_s)
        sampler.start()

        def progress(done: int) -> None:
            print(f"\r{tag:<44} {done}/{total} requests {time.perf_counter() - t_cfg:5.1f}s",
                  end="", file=sys.stderr, flush=True)

        rows = replay(port, slice_doc, args.time_scale, progress,
                      session_headers=SESSION_HEADERS)
        sampler.stop.set()
        sampler.join()
        print(file=sys.stderr)
        failures = st.vm_failures() if kind == "kvsteer" else []
        if failures:
            raise StackError(f"{tag}: wasm VM failures:\n" + "\n".join(failures[:5]))
        more = on_done(st, rows) if on_done else {}
    s = summarize(rows, args.time_scale, sampler.cv())
    s["errors"] = sorted({f"{r['status']}: {r['error']}" for r in rows if not r["ok"]})[:5]
    s["startup_s"] = started
    s["wall_s"] = time.perf_counter() - t_cfg
    s["command"] = command
    s["prompt_tokens"] = sum(r["prompt_tokens"] for r in rows if r["ok"])
    s.update(more)
    return s


# ---- report ---------------------------------------------------------------------------------------

def fmt(v, f: str) -> str:
    return "-" if v is None or v != v else format(v, f)


def verdicts(results: dict) -> list[str]:
    """Per slice and peer: is kvsteer's default at least as good on session p99 and TTFT p99
    (medians), with every run's figure beside them (runs i of both configurations were run back to
    back), so a reader sees how much of a gap is noise."""
    lines = []
    runs = results.get("runs", {})
    for sl, cfgs in results["slices"].items():
        k = cfgs.get("kvsteer kv_load")
        if not k:
            continue
        for label, s in cfgs.items():
            if label == "kvsteer kv_load":
                continue
            parts = []
            for name, key, f in (("session p99", ("rollout_s", "p99"), ".1f"),
                                 ("TTFT p99", ("ttft_ms", "p99"), ".0f")):
                a, b = k[key[0]][key[1]], s[key[0]][key[1]]
                if a != a or b != b:
                    parts.append(f"{name}: no data")
                    continue
                ratio = a / b if b else float("inf")
                word_ = "at least as good" if a <= b else "behind"
                per = [" / ".join(fmt(r[key[0]][key[1]], f) for r in runs.get(sl, {}).get(lb, []))
                       for lb in ("kvsteer kv_load", label)]
                unit = "s" if key[0] == "rollout_s" else "ms"
                parts.append(f"{name} {fmt(a, f)} vs {fmt(b, f)} {unit}, {ratio:.2f}x, {word_} "
                             f"(runs: {per[0]} vs {per[1]})")
            lines.append(f"- {sl}, against {label}: " + "; ".join(parts))
    return lines


def report(results: dict) -> str:
    v = results["versions"]
    md = ["# Peer routers against kvsteer, through the same client\n"]
    md.append(
        f"`scripts/bench-peers` (e2e/bench_peers.py): sglang-router {v['sglang-router']} and "
        f"vllm-router {v['vllm-router']} (PyPI, installed by `scripts/peers-install` into `.peers/`) "
        f"as real processes, and Envoy ({v['envoy']}) with `kvsteer_filter.wasm` (policy `kv_load`, "
        f"the default, with the o200k_base tokenizer configured), each in front of "
        f"{REPLICAS} fresh `kvsteer-sim serve --tokenizer o200k_base` replicas at "
        f"`--time-scale {results['time_scale']:g}`; the same Python client (closed loop, streamed "
        f"completions with text prompts, `ignore_eos`); runs interleaved, {results['repeat']} "
        f"repeat(s), figures are medians over repeats; `failed` sums every repeat. Times are the "
        f"client's wall times x {results['time_scale']:g} (engine time; the router's and client's "
        f"own overhead is magnified as much). Commit `{results['commit']}`, wall "
        f"{results['wall_s']:.0f} s on this 2-core machine.\n")
    md.append(f"Reproduce: `scripts/bench-peers --repeat {results['repeat']} --out docs/reports/results` "
              f"(or `scripts/bench`, part 4). Every request carries its session in `x-session-id` "
              f"(vllm-router's `consistent_hash` hashes it) and in `x-smg-routing-key` "
              f"(sglang-router's `manual` pins it to a replica); the other policies ignore both. "
              f"What the routers asked the replicas besides completions, seen in their traffic: "
              f"vllm-router `cache_aware` renders every text prompt (`POST "
              f"/v1/completions/render`) to route on token ids; sglang-router reads `/server_info` "
              f"and `/model_info` when it registers a replica, and its `power_of_two` polls "
              f"`/get_load` every 30 s of wall time (fixed in 0.3.2); vllm-router's `power_of_two` "
              f"polls `/get_load` for an older shape than SGLang's and, as against vLLM, which has "
              f"none, balances on its own in-flight counts. vllm-router's `kv_aware` (ZMQ KV events) "
              f"and `sticky_least_loaded` were not run.\n")
    md.append("Session p99: first request sent to last answer received of a session (an RL "
              "rollout, a coding-agent session; for Mooncake, one request). Hit rate: the replicas' "
              "`cached_tokens` over prompt tokens. Router command lines (all other flags at the "
              "routers' defaults):\n")
    seen = set()
    for cfgs in results["slices"].values():
        for label, s in cfgs.items():
            c = s.get("command_example")
            if c and label not in seen:
                seen.add(label)
                md.append(f"- {label}: `{c}`")
    md.append("")
    for sl, cfgs in results["slices"].items():
        meta = results["slice_meta"][sl]
        md.append(f"## {sl}\n")
        md.append(f"{meta['source']}. {meta['sessions']} sessions, {meta['requests']} requests, "
                  f"{meta['concurrency']} in flight; about {meta['prompt_tokens_per_request']:.0f} "
                  f"prompt tokens a request.\n")
        md.append("| router, policy | TTFT p50 / p99 ms | TPOT p99 ms | session p50 / p99 s | "
                  "output tok/s | hit rate % | decode CV | failed |")
        md.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, s in cfgs.items():
            md.append(f"| {label} | {fmt(s['ttft_ms']['p50'], '.0f')} / "
                      f"{fmt(s['ttft_ms']['p99'], '.0f')} | {fmt(s['tpot_ms']['p99'], '.1f')} | "
                      f"{fmt(s['rollout_s']['p50'], '.1f')} / {fmt(s['rollout_s']['p99'], '.1f')} | "
                      f"{fmt(s['output_tokens_per_s'], '.0f')} | {fmt(s['hit_rate'] * 100, '.1f')} | "
                      f"{fmt(s['decode_cv'], '.3f')} | {s['failed']} |")
        md.append("")
        errs = {label: s["errors"] for label, s in cfgs.items() if s.get("errors")}
        for label, e in errs.items():
            md.append(f"- {label} errors (first of each kind): " + "; ".join(f"`{x}`" for x in e))
        if errs:
            md.append("")
    md.append("## kvsteer's default against each peer\n")
    md.append("Session p99 and TTFT p99, kvsteer `kv_load` against the peer (ratio below 1: "
              "kvsteer lower, better):\n")
    md.extend(verdicts(results))
    md.append("")
    md.append("![session p99 and TTFT p99 per router](peers.svg)\n")
    return "\n".join(md) + "\n"


def svg(results: dict) -> str:
    """Two metrics per slice (session p99, TTFT p99), horizontal bars per router, each panel
    scaled to its own maximum."""
    slices = list(results["slices"])
    labels = [c[0] for c in CONFIGS if any(c[0] in results["slices"][s] for s in slices)]
    metrics = [("session p99 s", ("rollout_s", "p99"), ".1f"), ("TTFT p99 ms", ("ttft_ms", "p99"), ".0f")]
    colors = {"kvsteer": "#1b7837", "sglang": "#2166ac", "vllm": "#b2182b"}
    row_h, label_w, panel_w, gap = 16, 150, 240, 30
    panel_h = len(labels) * row_h + 40
    width = label_w + len(metrics) * (panel_w + gap) + 20
    height = len(slices) * panel_h + 56
    v = results["versions"]
    envoy = next((p for p in v["envoy"].split("/") if p.count(".") == 2), v["envoy"])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="18" font-size="13">Peer routers vs kvsteer kv_load: median of '
           f'{results["repeat"]} run(s), engine time (lower is better)</text>',
           f'<text x="10" y="34">sglang-router {v["sglang-router"]}, vllm-router '
           f'{v["vllm-router"]}, Envoy {envoy} + kvsteer_filter.wasm; '
           f'scripts/bench-peers --repeat {results["repeat"]}, commit {results["commit"]}</text>']
    for si, sl in enumerate(slices):
        y0 = 56 + si * panel_h
        out.append(f'<text x="10" y="{y0 + 12}" font-weight="bold">{sl}</text>')
        for mi, (mname, key, f) in enumerate(metrics):
            x0 = label_w + mi * (panel_w + gap)
            vals = [results["slices"][sl].get(lb, {}).get(key[0], {}).get(key[1]) for lb in labels]
            top = max((v for v in vals if v is not None and v == v), default=1.0) or 1.0
            out.append(f'<text x="{x0}" y="{y0 + 12}">{mname}</text>')
            for li, (lb, v) in enumerate(zip(labels, vals)):
                y = y0 + 20 + li * row_h
                if mi == 0:
                    out.append(f'<text x="10" y="{y + 11}">{lb}</text>')
                if v is None or v != v:
                    continue
                w = max(1.0, (panel_w - 50) * v / top)
                c = colors[lb.split()[0]]
                out.append(f'<rect x="{x0}" y="{y + 2}" width="{w:.1f}" height="{row_h - 4}" '
                           f'fill="{c}"/>')
                out.append(f'<text x="{x0 + w + 3:.1f}" y="{y + 11}">{format(v, f)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def add_slice_args(ap: argparse.ArgumentParser) -> None:
    """The slices' sizes (e2e/bench_stalls.py takes them too)."""
    ap.add_argument("--coding-sessions", type=int, default=24)
    ap.add_argument("--coding-turns", type=int, default=8)
    ap.add_argument("--coding-words", type=int, default=4, help="words a 64-token trace block")
    ap.add_argument("--coding-out-cap", type=int, default=256)
    ap.add_argument("--coding-think-cap-s", type=float, default=2.0)
    ap.add_argument("--mooncake-requests", type=int, default=384)
    ap.add_argument("--mooncake-first", type=int, default=-1,
                    help="first request of the window (-1: the trace's last --mooncake-requests)")
    ap.add_argument("--mooncake-words", type=int, default=32, help="words a 512-token trace block")
    ap.add_argument("--mooncake-concurrency", type=int, default=24)
    ap.add_argument("--mooncake-out-cap", type=int, default=256)


def slice_builders(args, work: Path) -> dict:
    """Slice name -> a function building it from `add_slice_args`' options (`work`: scratch)."""
    return {
        "rl": lambda: rl_slice(target_dir() / "release" / "bench", work),
        "coding": lambda: coding_slice(args.coding_sessions, args.coding_turns, args.coding_words,
                                       args.coding_out_cap, args.coding_think_cap_s),
        "mooncake": lambda: mooncake_slice(args.mooncake_requests, args.mooncake_words,
                                           args.mooncake_concurrency, args.mooncake_out_cap,
                                           args.mooncake_first),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-scale", type=float, default=5.0)
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "out" / "bench-peers"))
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS),
                    help="comma-separated labels (default: all)")
    ap.add_argument("--slices", default=",".join(SLICES))
    add_slice_args(ap)
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite peers.md and peers.svg from the last run's peers.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = json.loads((out / "peers.json").read_text())
        (out / "peers.md").write_text(report(results))
        (out / "peers.svg").write_text(svg(results))
        print(report(results))
        return 0
    work = REPO / "out" / "bench-peers-work"
    work.mkdir(parents=True, exist_ok=True)
    builders = slice_builders(args, work)
    wanted_slices = [s for s in args.slices.split(",") if s]
    for s in wanted_slices:
        if s not in builders:
            ap.error(f"unknown slice {s!r} (known: {', '.join(SLICES)})")
    wanted = [c for c in CONFIGS if c[0] in args.configs.split(",")]
    if not wanted:
        ap.error("no configuration selected")
    slices = {s: builders[s]() for s in wanted_slices}
    results = {"commit": commit(), "time_scale": args.time_scale, "repeat": max(1, args.repeat),
               "versions": versions(), "args": vars(args), "slices": {}, "slice_meta": {},
               "runs": {}}
    print(f"== bench-peers: {len(wanted)} routers x {len(slices)} slices x {results['repeat']} "
          f"repeat(s); versions {results['versions']}", file=sys.stderr)
    started = time.perf_counter()
    n_runs = len(wanted) * len(slices) * results["repeat"]
    done = 0
    for rep in range(results["repeat"]):
        for sl, doc in slices.items():
            for label, kind, policy in wanted:
                done += 1
                tag = f"[{done}/{n_runs}] {sl} {label} #{rep + 1}"
                s = run_one(label, kind, policy, doc, args, tag)
                results["runs"].setdefault(sl, {}).setdefault(label, []).append(s)
                print(f"   ttft p99 {fmt(s['ttft_ms']['p99'], '.0f')} ms, session p99 "
                      f"{fmt(s['rollout_s']['p99'], '.1f')} s, failed {s['failed']}, "
                      f"wall {s['wall_s']:.1f} s (start {s['startup_s']:.1f} s); "
                      f"elapsed {time.perf_counter() - started:.0f} s", file=sys.stderr)
    for sl, by_label in results["runs"].items():
        doc = slices[sl]
        reqs = sum(len(s["turns"]) for s in doc["sessions"])
        first = next(iter(by_label.values()))
        results["slice_meta"][sl] = {
            "source": doc["source"], "sessions": len(doc["sessions"]), "requests": reqs,
            "concurrency": doc["concurrency"],
            "prompt_tokens_per_request": statistics.median(
                r["prompt_tokens"] / max(1, r["requests"]) for r in first)}
        results["slices"][sl] = {}
        for label, runs in by_label.items():
            keep = [{k: v for k, v in r.items() if k not in ("errors", "command")} for r in runs]
            m = median_summary(keep)
            m["failed"] = sum(r["failed"] for r in runs)
            m["errors"] = sorted({e for r in runs for e in r["errors"]})[:5]
            m["command_example"] = runs[0]["command"]
            results["slices"][sl][label] = m
    results["wall_s"] = time.perf_counter() - started
    (out / "peers.json").write_text(json.dumps(results, indent=1))
    (out / "peers.md").write_text(report(results))
    (out / "peers.svg").write_text(svg(results))
    print(report(results))
    bad = {f"{sl} {lb}": s["failed"] for sl, c in results["slices"].items() for lb, s in c.items()
           if s["failed"]}
    if bad:
        print(f"failed requests: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

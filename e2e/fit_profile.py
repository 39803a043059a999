"""Fits a `kvsteer-sim` step-time profile to a real vLLM CPU engine (docs/reports/fidelity.md).

One vLLM 0.32 CPU engine serving the tiny random-weight Llama of docs/guide/real-vllm.md (block size 32,
`--enforce-eager`, prefix caching, one core: `VLLM_CPU_OMP_THREADS_BIND`), with a `kvsteer-feed`
adapter beside it as in the fidelity run (publishing KV events costs the engine time too). Measured
from the client, straight to the engine:

- prefill: time to first token of a lone request of L uncached tokens, max_tokens 1, and of n new
  tokens after a cached context of C tokens (the prefix sent first and cached);
- decode: B streams at once after a shared cached context of K tokens, 48 tokens each; the
  engine's own decode time (`vllm:request_decode_time_seconds`, first to last token) over 47 tokens
  is one engine step with B decoding sequences (the client's gaps between SSE events are kept for
  reference: a starved client thread reads them in bunches);
- the KV block count, `vllm:cache_config_info{num_gpu_blocks}` on /metrics, and the scheduler's
  token budget and sequence cap from the engine's log.

With `--neighbor-streams N`, a second engine pinned to the same core serves N endless streams
(256-token prompts, 128 tokens out, from a process of its own) all along: the profile of an engine whose core-mate is busy, as
in the fidelity run's two engines per core.

The step model is the simulator's additive one (sim/src/profile.rs, `additive: true`):
    step = overhead + per_seq * seqs + compute * tokens + kv_read * decode_context + attn * pairs
and a request's time to first token adds a fixed `request_overhead_us` (the API server's parsing,
scheduling hand-off and the first event's trip back). Decode gaps give overhead, per_seq + compute
and kv_read; prefill times give compute, attn and the request overhead. Least squares, by hand.

Prints the measurements and the fitted coefficients, and writes the profile as JSON for
`kvsteer-sim serve --profile FILE` (`--out`). Run by scripts/fit-profile.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client import Client, tokens  # noqa: E402
from stack import free_ports  # noqa: E402
from test_real_vllm import BLOCK, Engine, RealStack, prom, wait_until
from test_real_vllm import http as http_get  # noqa: E402

ENGINE_START_S = 300
DECODE_TOKENS = 48


def decode_metrics(e: Engine) -> dict:
    text = e.engine_metrics()
    return {"decode_s": prom(text, "vllm:request_decode_time_seconds_sum"),
            "count": prom(text, "vllm:request_decode_time_seconds_count"),
            "tokens": prom(text, "vllm:request_generation_tokens_sum")}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def solve(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares: the normal equations, by Gaussian elimination with partial pivoting."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda k: abs(a[k][c]))
        a[c], a[p], b[c], b[p] = a[p], a[c], b[p], b[c]
        for k in range(c + 1, n):
            f = a[k][c] / a[c][c]
            for j in range(c, n):
                a[k][j] -= f * a[c][j]
            b[k] -= f * b[c]
    x = [0.0] * n
    for c in reversed(range(n)):
        x[c] = (b[c] - sum(a[c][j] * x[j] for j in range(c + 1, n))) / a[c][c]
    return x


def stream_times(port: int, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time (perf_counter) of every SSE event of one streamed completion, and the send time
    first."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    times = [t0]
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data:"):
            if line.strip() == b"data: [DONE]":
                break
            times.append(time.perf_counter())
    conn.close()
    return times


def ttft(port: int, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the answer of a one-token completion, and the engine's cached tokens."""
    c = Client("127.0.0.1", port, timeout_s=120)
    try:
        r = c.complete(prompt, max_tokens=1, ignore_eos=True, extra={"model": "tiny", "temperature": 0})
    finally:
        c.close()
    assert r.ok, r
    return r.total_s, r.cached_tokens


def measure(e: Engine, reps: int, quick: bool) -> dict:
    port = e.port
    seed = [10_000]

    def fresh(n: int) -> list[int]:
        seed[0] += 1
        return tokens(n, seed[0])

    # Warm-up: the first requests of a fresh engine pay one-off costs.
    for n in (64, 512, 2048):
        ttft(port, fresh(n))
    prefill = []
    lengths = [32, 256, 1024, 2048] if quick else [32, 128, 256, 512, 1024, 1536, 2048, 3072, 4096]
    for n in lengths:
        xs = [ttft(port, fresh(n))[0] for _ in range(reps)]
        prefill.append({"context": 0, "new": n, "s": statistics.median(xs), "all": xs})
        log(f"prefill {n:5d} uncached: {statistics.median(xs) * 1e3:7.1f} ms")
    contexts = [1024] if quick else [1024, 2048, 3072]
    for ctx in contexts:
        prefix = fresh(ctx)
        ttft(port, prefix + fresh(32))
        for n in ([256] if quick else [32, 256, 1024]):
            xs, hits = [], []
            for _ in range(reps):
                s, cached = ttft(port, prefix + fresh(n))
                xs.append(s)
                hits.append(cached)
            prefill.append({"context": min(hits), "new": ctx + n - min(hits),
                            "s": statistics.median(xs), "all": xs})
            log(f"prefill {n:5d} after {min(hits):5d} cached: {statistics.median(xs) * 1e3:7.1f} ms")
    decode = []
    for ctx in ([64, 1024] if quick else [64, 1024, 2048]):
        prefix = fresh(ctx)
        ttft(port, prefix + fresh(16))
        for b in ([1, 8] if quick else [1, 2, 4, 8, 16, 32, 64]):
            rounds, gaps, client = [], [], []
            for _ in range(max(3, reps // 2)):
                out: list[list[float]] = [[] for _ in range(b)]

                def one(i: int) -> None:
                    out[i] = stream_times(port, prefix + fresh(16), DECODE_TOKENS)

                before = decode_metrics(e)
                threads = [threading.Thread(target=one, args=(i,)) for i in range(b)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                after = wait_until("the engine records the streams' decode times", lambda: (
                    lambda m: m if m["count"] - before["count"] >= b else None)(decode_metrics(e)),
                    10)
                # The engine's own decode time (first to last token, engine-core timestamps), per
                # step: not the client's reading, which comes in bunches.
                rounds.append((after["decode_s"] - before["decode_s"])
                              / (after["count"] - before["count"]) / (DECODE_TOKENS - 1))
                gaps += [ts[k + 1] - ts[k] for ts in out for k in range(9, len(ts) - 1)]
                # What the client saw: first to last event, per token, over the streams.
                client.append(statistics.fmean((ts[-1] - ts[1]) / (len(ts) - 2) for ts in out))
            # Tokens a decoding sequence reads: its prompt and half its output, on average.
            row = {"batch": b, "context": ctx + 16 + DECODE_TOKENS // 2,
                   "mean_s": statistics.median(rounds), "rounds_s": rounds,
                   "client_gap_mean_s": statistics.fmean(gaps) if gaps else None,
                   "client_per_token_s": statistics.median(client), "client_rounds_s": client}
            decode.append(row)
            log(f"decode batch {b:3d} context {ctx:5d}: step {row['mean_s'] * 1e3:6.2f} ms "
                f"(rounds {', '.join(f'{x * 1e3:.2f}' for x in rounds)}; client "
                f"{row['client_per_token_s'] * 1e3:.2f})")
    return {"prefill": prefill, "decode": decode}


def neighbor_load(port: int, n: int) -> None:
    """`--neighbor-load PORT N`: `n` threads of endless streams against an engine (a process of
    its own, so that its threads do not hold the measuring client's interpreter lock)."""
    def loop(i: int) -> None:
        k = 0
        while True:
            k += 1
            try:
                stream_times(port, tokens(256, 500_000 + 10_000 * i + k), 128)
            except (OSError, AssertionError):
                time.sleep(0.5)

    for i in range(n):
        threading.Thread(target=loop, args=(i,), daemon=True).start()
    while True:
        time.sleep(3600)


def fit(m: dict, budget: int) -> dict:
    # Decode: step = overhead + (per_seq + compute) * B + kv_read * B * context. Mean gaps: an
    # engine step is one token per stream, and the mean over a stream is what throughput sees.
    d_rows = [[1.0, r["batch"], r["batch"] * r["context"]] for r in m["decode"]]
    d_ys = [r["mean_s"] * 1e6 for r in m["decode"]]
    overhead, per_tok_seq, kv_read = solve(d_rows, d_ys)
    # Prefill: ttft = request_overhead + steps * (overhead + per_seq) + compute * new + attn * pairs,
    # the prompt cut into chunks of the token budget. The decode fit fixes overhead + per_seq only
    # through their sum with compute, so fit request_overhead' = request_overhead + overhead + per_seq
    # for the first step, and charge later chunks the decode fit's overhead.
    p_rows, p_ys = [], []
    for r in m["prefill"]:
        done, new, pairs, steps = r["context"], r["new"], 0, 0
        left = new
        while left > 0:
            n = min(left, budget)
            pairs += n * done + n * (n + 1) // 2
            done += n
            left -= n
            steps += 1
        p_rows.append([1.0, new, pairs])
        p_ys.append(r["s"] * 1e6 - (steps - 1) * (overhead + per_tok_seq))
    first, compute, attn = solve(p_rows, p_ys)
    per_seq = max(0.0, per_tok_seq - compute)
    request = first - overhead - per_seq
    # Residuals, as a check of the model's shape.
    pred_p = [sum(c * x for c, x in zip((first, compute, attn), row)) for row in p_rows]
    pred_d = [sum(c * x for c, x in zip((overhead, per_tok_seq, kv_read), row)) for row in d_rows]
    return {
        "step_overhead_us": overhead, "per_seq_us": per_seq, "compute_us_per_token": compute,
        "kv_read_us_per_token": kv_read, "attn_us_per_pair": attn, "request_overhead_us": request,
        "residuals": {
            "prefill_rel": [round((p - y) / y, 3) for p, y in zip(pred_p, p_ys)],
            "decode_rel": [round((p - y) / y, 3) for p, y in zip(pred_d, d_ys)],
        },
    }


def engine_limits(e: Engine) -> dict:
    """num_gpu_blocks from /metrics; the scheduler's budget and cap from the engine's log."""
    text = e.engine_metrics()
    blocks = 0
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            mm = re.search(r'num_gpu_blocks="(\d+)"', line)
            if mm:
                blocks = int(mm.group(1))
    assert e.engine is not None
    logtext = e.engine.log.read_text(errors="replace")
    budget = re.findall(r"max_num_batched_tokens=(\d+)", logtext)
    seqs = re.findall(r"max_num_seqs=(\d+)", logtext)
    return {"num_gpu_blocks": blocks,
            "max_num_batched_tokens": int(budget[-1]) if budget else 2048,
            "max_num_seqs": int(seqs[-1]) if seqs else 128,
            "budget_from_log": bool(budget), "seqs_from_log": bool(seqs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/fidelity/profile.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a few points only (a smoke check)")
    ap.add_argument("--core", type=int, default=0, help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--neighbor-streams", type=int, default=0,
                    help="streams a second engine on the same core serves meanwhile (0: none)")
    ap.add_argument("--neighbor-load", nargs=2, type=int, metavar=("PORT", "N"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.neighbor_load:
        neighbor_load(*args.neighbor_load)
        return 0
    t_start = time.monotonic()
    s = RealStack(gpu_blocks=None, max_model_len=args.max_model_len)
    try:
        ports = free_ports(8)
        e = Engine("fit", args.core, *ports[:4])
        s.engines.append(e)
        s.start_adapter(e)
        nb = None
        if args.neighbor_streams:
            nb = Engine("neighbor", args.core, *ports[4:])
            s.engines.append(nb)
            s.start_adapter(nb)
        log(f"engine ready in {s.start_engines(ENGINE_START_S):.1f} s")
        wait_until("the adapter learns the block count",
                   lambda: prom(e.adapter_metrics(), "kvsteer_feed_max_blocks") > 0, 20)
        limits = engine_limits(e)
        log(f"engine: {limits}")
        t1 = time.monotonic()
        if nb is not None:
            load = s.spawn("neighbor-load", [sys.executable, __file__, "--neighbor-load",
                                             str(nb.port), str(args.neighbor_streams)])
            time.sleep(3)
            n0 = prom(nb.engine_metrics(), "vllm:request_success_total")
            m = measure(e, args.reps, args.quick)
            done = prom(nb.engine_metrics(), "vllm:request_success_total") - n0
            load.stop()
            log(f"the neighbor served {done:.0f} streams meanwhile")
        else:
            m = measure(e, args.reps, args.quick)
        log(f"measured in {time.monotonic() - t1:.0f} s")
        version = json.loads(http_get(f"http://{e.endpoint}/version"))["version"]
    finally:
        s.close()
    f = fit(m, limits["max_num_batched_tokens"])
    profile = {
        "name": f"vllm-{version}-cpu-tiny-llama"
                + (f"-neighbor-{args.neighbor_streams}" if args.neighbor_streams else ""),
        "additive": True,
        "step_overhead_us": round(f["step_overhead_us"], 2),
        "per_seq_us": round(f["per_seq_us"], 2),
        "weights_us": 0.0,
        "kv_read_us_per_token": round(f["kv_read_us_per_token"], 5),
        "compute_us_per_token": round(f["compute_us_per_token"], 4),
        "attn_us_per_pair": round(f["attn_us_per_pair"], 7),
        "host_load_us_per_token": 0.0,
        "request_overhead_us": round(max(0.0, f["request_overhead_us"]), 1),
        "max_model_len": args.max_model_len,
        "kv_blocks_16": limits["num_gpu_blocks"] * BLOCK // 16,
    }
    doc = {"profile": profile, "engine": limits, "vllm": version, "core": args.core,
           "neighbor_streams": args.neighbor_streams,
           "measurements": m, "residuals": f["residuals"],
           "raw_request_overhead_us": f["request_overhead_us"],
           "wall_s": time.monotonic() - t_start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / (out.stem + ".measurements.json")).write_text(json.dumps(doc, indent=1))
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print(json.dumps(profile, indent=1))
    print(f"residuals (model - measured) / measured: {json.dumps(f['residuals'])}")
    print(f"sim flags: --profile {out} --kv-blocks {limits['num_gpu_blocks']} --block-size {BLOCK} "
          f"--max-batch-tokens {limits['max_num_batched_tokens']} "
          f"--max-running {limits['max_num_seqs']} --max-model-len {args.max_model_len}")
    print(f"fit-profile: {time.monotonic() - t_start:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

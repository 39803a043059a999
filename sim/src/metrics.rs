//! `/metrics` in Prometheus text format with vLLM's metric names, so dashboards and scrapers written
//! for vLLM read the simulator unchanged. Latency histograms are in *engine* seconds (virtual time:
//! what the simulated GPU took), not wall seconds of a time-scaled run.

use crate::engine::{Engine, Histogram};
use std::fmt::Write;

fn gauge(out: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
    );
}

fn counter(out: &mut String, name: &str, help: &str, labels: &str, v: u64) {
    let _ = writeln!(
        out,
        "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {v}"
    );
}

fn histogram(out: &mut String, name: &str, help: &str, labels: &str, h: &Histogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let mut cum = 0u64;
    for (i, b) in h.bounds.iter().enumerate() {
        cum += h.counts[i];
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
}

/// Renders the engine's state and counters.
pub fn render(engine: &Engine, model: &str) -> String {
    // Kept whole: a flat list of metric families, in the order the exposition prints them.
    let l = format!("model_name=\"{model}\"");
    let s = engine.stats();
    let load = engine.load();
    let cfg = engine.config();
    let mut out = String::with_capacity(8192);
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Requests in the running batch.",
        &l,
        load.running as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled.",
        &l,
        load.waiting as f64,
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "Fraction of KV blocks referenced by running requests (1 = full).",
        &l,
        engine.kv_usage(),
    );
    gauge(
        &mut out,
        "vllm:gpu_cache_usage_perc",
        "Older name of vllm:kv_cache_usage_perc.",
        &l,
        engine.kv_usage(),
    );
    counter(
        &mut out,
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        &l,
        s.prefix_cache_queries,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_hits",
        "Prompt tokens found in the prefix cache (host tier included).",
        &l,
        s.prefix_cache_hits,
    );
    // Not a vLLM metric: what P/D decode legs read over the modelled link (docs/design/pd.md).
    counter(
        &mut out,
        "kvsteer_sim:remote_prefill_tokens",
        "Prompt tokens of P/D decode legs read over the KV link instead of computed.",
        &l,
        s.remote_prefill_tokens,
    );
    // Not a vLLM metric: the random stalls of `--stall-every-s` that held up a step.
    counter(
        &mut out,
        "kvsteer_sim:stalls",
        "Random engine stalls (--stall-every-s) that held up a step.",
        &l,
        s.stalls,
    );
    counter(
        &mut out,
        "kvsteer_sim:stalled_ms",
        "Engine milliseconds (virtual time) random stalls held up steps for.",
        &l,
        s.stalled_us / 1000,
    );
    counter(
        &mut out,
        "vllm:num_preemptions",
        "Preemptions (recompute) of running requests.",
        &l,
        s.preemptions,
    );
    counter(
        &mut out,
        "vllm:prompt_tokens",
        "Prompt tokens admitted.",
        &l,
        s.prompt_tokens,
    );
    counter(
        &mut out,
        "vllm:generation_tokens",
        "Tokens generated.",
        &l,
        s.generation_tokens,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:request_success_total Finished requests by reason.\n# TYPE vllm:request_success_total counter"
    );
    for (reason, v) in [
        ("length", s.finished_length),
        ("stop", s.finished_stop),
        ("abort", s.finished_abort),
    ] {
        let _ = writeln!(
            out,
            "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {v}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the KV cache configuration.\n# TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",num_gpu_blocks=\"{}\",num_cpu_blocks=\"{}\",enable_prefix_caching=\"True\"}} 1",
        cfg.block_size, cfg.kv_blocks, cfg.host_blocks
    );
    histogram(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Time to first token (engine time).",
        &l,
        &s.ttft,
    );
    histogram(
        &mut out,
        "vllm:inter_token_latency_seconds",
        "Time between output tokens (engine time).",
        &l,
        &s.itl,
    );
    gauge(
        &mut out,
        "kvsteer_sim:decode_blocks",
        "KV blocks held by decoding requests.",
        &l,
        load.decode_blocks as f64,
    );
    if let Some(a) = engine.adapter_report() {
        // vLLM's form: the lists comma-separated in labels, the value the time it was set (here
        // the engine's clock, seconds), so a reader takes the latest sample as the state now.
        let labels = format!(
            "max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"",
            a.slots,
            a.running.join(","),
            a.waiting.join(",")
        );
        gauge(
            &mut out,
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            &labels,
            engine.now_us() as f64 / 1e6,
        );
        counter(
            &mut out,
            "kvsteer_sim:lora_loads",
            "LoRA adapter loads (the simulator's own).",
            &l,
            engine.adapter_loads(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineConfig, EngineRequest};

    #[test]
    fn histograms_are_cumulative_and_count_every_request() {
        let mut e = Engine::new(EngineConfig::default());
        for id in 0..3u64 {
            let prompt = (0..(100 + id as u32 * 3000)).collect();
            let r = EngineRequest {
                id,
                prompt,
                max_tokens: 4,
                ignore_eos: true,
                min_tokens: 0,
            };
            e.submit(0, r).unwrap();
        }
        let mut out = Vec::new();
        while let Some(t) = e.next_event_time() {
            e.advance(t, &mut out);
        }
        let text = render(&e, "m");
        let buckets: Vec<u64> = text
            .lines()
            .filter(|l| l.starts_with("vllm:time_to_first_token_seconds_bucket"))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(buckets.len(), crate::engine::TTFT_BUCKETS.len() + 1);
        assert!(buckets.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*buckets.last().unwrap(), 3);
        assert!(text.contains("vllm:inter_token_latency_seconds_count{model_name=\"m\"} 9"));
        assert!(text.contains("vllm:generation_tokens_total{model_name=\"m\"} 12"));
        assert!(text.contains("finished_reason=\"length\"} 3"));
    }

    #[test]
    fn lora_state_is_exported_as_vllm_does() {
        let mut e = Engine::new(EngineConfig {
            lora: crate::lora::LoraConfig {
                slots: 2,
                load_us: 1000,
            },
            ..EngineConfig::default()
        });
        assert!(
            !render(&e, "m")
                .contains("lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\"")
        );
        let r = EngineRequest {
            id: 1,
            prompt: (0..64).collect(),
            max_tokens: 50,
            ignore_eos: true,
            min_tokens: 0,
        };
        e.submit_with_adapter(0, r, Some("a")).unwrap();
        let mut out = Vec::new();
        e.advance(1, &mut out);
        let text = render(&e, "m");
        assert!(
            text.contains("vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"}"),
            "{text}"
        );
        assert!(text.contains("kvsteer_sim:lora_loads_total{model_name=\"m\"} 1"));
        assert!(!render(&Engine::new(EngineConfig::default()), "m").contains("lora"));
    }
}

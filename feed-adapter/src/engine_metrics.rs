//! Reading the engine's Prometheus `/metrics` text into an [`EngineLoad`]. Pure.
//!
//! vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting` (summed over engines/models),
//! `vllm:kv_cache_usage_perc` (older releases: `vllm:gpu_cache_usage_perc`; averaged),
//! `vllm:cache_config_info{block_size, num_gpu_blocks}`, and the process's `process_start_time_seconds`.
//! SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`, and
//! `sglang:cache_config_info{page_size, ...}` where present. Unknown lines are ignored; a malformed line
//! is skipped and counted.
//!
//! LoRA: vLLM's `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`, a
//! gauge set to the current time whenever the scheduler logs its stats, one sample per label set
//! ever seen (`prometheus_client` keeps the old ones): the sample with the latest time is the
//! engine's state now. The adapter lists are comma-separated names.

use crate::state::EngineLoad;
use kvsteer_core::feed::AdapterReport;

/// One sample line: name, labels, value.
#[derive(Debug, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

/// Parses one exposition line; `None` for comments, blank lines and malformed lines.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut s = r;
        loop {
            s = s.trim_start_matches([' ', ',']);
            if let Some(after) = s.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = s.find('=')?;
            let key = s[..eq].trim();
            let v = s[eq + 1..].trim_start().strip_prefix('"')?;
            let mut value = String::new();
            let mut chars = v.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    '"' => {
                        end = Some(i);
                        break;
                    }
                    c => value.push(c),
                }
            }
            let end = end?;
            labels.push((key, value));
            s = &v[end + 1..];
        }
    }
    let value_str = rest.split_whitespace().next()?;
    let value = match value_str {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

fn label<'s>(s: &'s Sample<'_>, k: &str) -> Option<&'s str> {
    s.labels
        .iter()
        .find(|(n, _)| *n == k)
        .map(|(_, v)| v.as_str())
}

/// Reads an exposition into a load report. Returns the report and how many lines were malformed.
pub fn parse(text: &str) -> (EngineLoad, usize) {
    parse_engine(text, None)
}

/// [`parse`] for one engine of a data-parallel deployment: samples labelled with another `engine`
/// are skipped (vLLM labels every engine's metrics `engine="<index>"`, the DP rank of the API
/// server's engines: `PrometheusStatLogger` in `vllm/v1/metrics/loggers.py`); samples without the
/// label (process metrics) are read as usual.
pub fn parse_engine(text: &str, engine: Option<&str>) -> (EngineLoad, usize) {
    let mut load = EngineLoad::default();
    let mut bad = 0usize;
    let (mut usage_sum, mut usage_n) = (0.0f64, 0u32);
    let mut lora_at = f64::NEG_INFINITY;
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let Some(s) = parse_line(t) else {
            bad += 1;
            continue;
        };
        if let Some(e) = engine
            && label(&s, "engine").is_some_and(|v| v != e)
        {
            continue;
        }
        let v = s.value;
        let count = if v.is_finite() && v > 0.0 {
            v.round() as u64
        } else {
            0
        };
        match s.name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => load.running += count,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => load.waiting += count,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage"
                if v.is_finite() =>
            {
                usage_sum += v;
                usage_n += 1;
            }
            "vllm:cache_config_info" | "sglang:cache_config_info" => {
                if let Some(bs) = label(&s, "block_size")
                    .or_else(|| label(&s, "page_size"))
                    .and_then(|b| b.parse().ok())
                {
                    load.block_size = Some(bs);
                }
                if let Some(n) = label(&s, "num_gpu_blocks").and_then(|b| b.parse().ok()) {
                    load.num_gpu_blocks = Some(n);
                }
            }
            "process_start_time_seconds" if v.is_finite() => load.start_time = Some(v),
            "vllm:lora_requests_info" if v >= lora_at && !v.is_nan() => {
                lora_at = v;
                load.adapters = Some(lora_report(&s));
            }
            _ => {}
        }
    }
    if usage_n > 0 {
        load.kv_usage = Some(usage_sum / usage_n as f64);
    }
    (load, bad)
}

/// One `vllm:lora_requests_info` sample as the feed reports it, cut to what the feed carries
/// ([`AdapterReport::bounded`]): a malformed `max_lora` reads as 0 (not known).
fn lora_report(s: &Sample<'_>) -> AdapterReport {
    let names = |k: &str| -> Vec<String> {
        label(s, k)
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .take(kvsteer_core::feed::MAX_ADAPTER_NAMES * 2)
            .map(String::from)
            .collect()
    };
    AdapterReport {
        slots: label(s, "max_lora")
            .and_then(|m| m.trim().parse().ok())
            .unwrap_or(0),
        running: names("running_lora_adapters"),
        waiting: names("waiting_lora_adapters"),
    }
    .bounded()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_engine_of_a_dp_deployment_is_read_alone() {
        let text = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 5\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2\n\
                    process_start_time_seconds 100\n";
        assert_eq!(parse(text).0.running, 8, "all engines summed");
        let (one, bad) = parse_engine(text, Some("1"));
        assert_eq!((one.running, one.waiting, bad), (5, 2, 0));
        assert_eq!(parse_engine(text, Some("0")).0.running, 3);
    }

    /// Lines as vLLM 0.32 (CPU) exposes them.
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.125
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0
process_start_time_seconds 1.7e+09
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 12.0
garbage line {
"#;

    #[test]
    fn vllm_exposition() {
        let (l, bad) = parse(VLLM);
        assert_eq!(bad, 1);
        assert_eq!(l.running, 3);
        assert_eq!(l.waiting, 2);
        assert_eq!(l.kv_usage, Some(0.125));
        assert_eq!(l.block_size, Some(32));
        assert_eq!(l.num_gpu_blocks, Some(2048));
        assert_eq!(l.start_time, Some(1.7e9));
    }

    #[test]
    fn lines_with_escapes_and_no_labels() {
        let s = parse_line(r#"a{x="q\"uote\\",y="z"} 4 1700000000"#).unwrap();
        assert_eq!(s.name, "a");
        assert_eq!(
            s.labels,
            vec![("x", "q\"uote\\".to_string()), ("y", "z".into())]
        );
        assert_eq!(s.value, 4.0);
        assert_eq!(parse_line("b 2.5").unwrap().value, 2.5);
        assert!(parse_line("# comment").is_none());
        assert!(parse_line("c{x=\"unterminated} 1").is_none());
        assert!(parse_line("d notanumber").is_none());
    }

    /// As vLLM exposes LoRA state (`vllm/v1/metrics/loggers.py`): one sample per label set seen,
    /// each valued at the time it was last set; the latest is the state now.
    const VLLM_LORA: &str = r#"# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7000000001e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="code-lora"} 1.7000000125e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.7000000063e+09
vllm:num_requests_running{engine="0",model_name="base"} 3.0
"#;

    #[test]
    fn lora_state_is_the_latest_sample() {
        let (l, bad) = parse(VLLM_LORA);
        assert_eq!(bad, 0);
        assert_eq!(
            l.adapters,
            Some(AdapterReport {
                slots: 4,
                running: vec!["sql-lora".into(), "chat-lora".into()],
                waiting: vec!["code-lora".into()],
            })
        );
        assert_eq!(l.running, 3);
        // No metric: not known.
        assert_eq!(parse(VLLM).0.adapters, None);
    }

    #[test]
    fn hostile_lora_labels_are_bounded() {
        let many: Vec<String> = (0..500).map(|i| format!("a{i}")).collect();
        let text = format!(
            "vllm:lora_requests_info{{max_lora=\"x\",running_lora_adapters=\"{}\",waiting_lora_adapters=\",,{},\"}} NaN\n\
             vllm:lora_requests_info{{max_lora=\"x\",running_lora_adapters=\"{}\",waiting_lora_adapters=\",,{},\"}} 5\n",
            many.join(","),
            "y".repeat(400),
            many.join(","),
            "y".repeat(400),
        );
        let a = parse(&text).0.adapters.unwrap();
        assert_eq!(a.slots, 0);
        assert_eq!(a.running.len(), kvsteer_core::feed::MAX_ADAPTER_NAMES);
        assert!(a.waiting.is_empty(), "a 400-byte name is dropped");
    }

    #[test]
    fn sglang_names() {
        let (l, _) = parse(
            "sglang:num_running_reqs{model_name=\"m\"} 4\nsglang:num_queue_reqs{model_name=\"m\"} 1\nsglang:token_usage{model_name=\"m\"} 0.5\n",
        );
        assert_eq!((l.running, l.waiting, l.kv_usage), (4, 1, Some(0.5)));
    }
}

//! Reader for the Azure LLM inference conversation trace (CSV: `TIMESTAMP,ContextTokens,
//! GeneratedTokens`): arrival pattern and length mix with **no reuse**, the control where no policy can
//! gain from the cache. Each row is a single-turn session (`az-<row>`) whose prompt is entirely
//! request-unique tokens. Arrivals count from the earliest timestamp, divided by `speed`.

use crate::error::{WorkloadError, read_file};
use crate::session::{BlockPrompt, Session, Workload};
use crate::token_blocks::block_key;
use std::path::PathBuf;

/// File name of the vendored trace in `traces/` (see `traces/README.md`).
pub const FILE: &str = "azure_llm_inference_conv_2023.csv.xz";

/// Default location of the trace, relative to the repository root.
pub const DEFAULT_PATH: &str = "traces/azure_llm_inference_conv_2023.csv.xz";
pub use crate::session::NOTE_SKIPPED;

#[derive(Clone, Debug, PartialEq)]
pub struct AzureParams {
    pub path: PathBuf,
    pub speed: f64,
    /// Read only the first N rows.
    pub max_rows: Option<usize>,
    /// Block size reported to the consumer (nothing is shared, so it only affects block accounting).
    pub block_size: u32,
    pub max_prompt_tokens: u32,
    /// Each gap between consecutive arrivals drawn within this share of the recorded one
    /// ([`crate::arrivals::jitter_gaps`]); 0 (the default) replays the recorded times.
    pub arrival_jitter: f64,
    /// The draw of `arrival_jitter`.
    pub jitter_seed: u64,
}

impl Default for AzureParams {
    fn default() -> Self {
        AzureParams {
            path: DEFAULT_PATH.into(),
            speed: 1.0,
            max_rows: None,
            block_size: 16,
            max_prompt_tokens: 1 << 20,
            arrival_jitter: 0.0,
            jitter_seed: 0,
        }
    }
}

/// Microseconds since 1970 of `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC assumed; only differences matter).
pub fn parse_timestamp(s: &str) -> Option<u64> {
    let (date, time) = s.trim().split_once(' ')?;
    let mut d = date.split('-');
    let y: i64 = d.next()?.parse().ok()?;
    let m: i64 = d.next()?.parse().ok()?;
    let day: i64 = d.next()?.parse().ok()?;
    if d.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let (hms, frac) = match time.split_once('.') {
        Some((a, b)) => (a, b),
        None => (time, ""),
    };
    let mut t = hms.split(':');
    let h: i64 = t.next()?.parse().ok()?;
    let mi: i64 = t.next()?.parse().ok()?;
    let sec: i64 = t.next()?.parse().ok()?;
    if t.next().is_some() || h > 23 || mi > 59 || sec > 60 || h < 0 || mi < 0 || sec < 0 {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mut us: i64 = 0;
    for (i, b) in frac.bytes().take(6).enumerate() {
        us += i64::from(b - b'0') * 10i64.pow(5 - i as u32);
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let total = ((days * 86_400 + h * 3600 + mi * 60 + sec) * 1_000_000).checked_add(us)?;
    u64::try_from(total).ok()
}

pub fn read(p: &AzureParams) -> Result<Workload, WorkloadError> {
    parse(&read_file(&p.path)?, p)
}

pub fn parse(text: &str, p: &AzureParams) -> Result<Workload, WorkloadError> {
    if !(p.speed > 0.0 && p.speed.is_finite()) || p.block_size == 0 {
        return Err(WorkloadError::Param(
            "speed must be > 0 and block_size >= 1".into(),
        ));
    }
    crate::arrivals::check_jitter(p.arrival_jitter)?;
    let mut rows = Vec::new();
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, h)) if h.trim().starts_with("TIMESTAMP") => {}
        _ => {
            return Err(WorkloadError::Parse {
                line: 1,
                message: "expected the header TIMESTAMP,ContextTokens,GeneratedTokens".into(),
            });
        }
    }
    let mut skipped = 0u64;
    for (ln, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        if p.max_rows
            .is_some_and(|m| rows.len() + skipped as usize >= m)
        {
            break;
        }
        let (ts, ctx, gen_) = parse_row(ln, line)?;
        if ctx > u64::from(p.max_prompt_tokens) {
            skipped += 1;
            continue;
        }
        rows.push((ln, ts, ctx as u32, gen_));
    }
    let t0 = rows.iter().map(|r| r.1).min().unwrap_or(0);
    let mut sessions: Vec<Session> = rows
        .into_iter()
        .map(|(ln, ts, ctx, out)| {
            let prompt = BlockPrompt {
                keys: vec![],
                block_size: p.block_size,
                len: ctx,
                pad_key: block_key("azure-pad", ln as u64),
            };
            let arrival_us = ((ts - t0) as f64 / p.speed) as u64;
            Session::single_request(format!("az-{ln}"), prompt, out, arrival_us)
        })
        .collect();
    let mut params = vec![
        ("path".into(), p.path.display().to_string()),
        ("speed".into(), p.speed.to_string()),
        ("max_rows".into(), format!("{:?}", p.max_rows)),
    ];
    crate::arrivals::redraw(
        &mut sessions,
        &mut params,
        p.arrival_jitter,
        p.jitter_seed,
        "azure-arrival",
    );
    Ok(Workload::open_trace(
        "azure",
        params,
        p.block_size,
        sessions,
        skipped,
    ))
}

/// One row (`TIMESTAMP,ContextTokens,GeneratedTokens`, line `ln` counted from 0): its timestamp,
/// context and generated tokens.
fn parse_row(ln: usize, line: &str) -> Result<(u64, u64, u64), WorkloadError> {
    let err = |message: String| WorkloadError::Parse {
        line: ln + 1,
        message,
    };
    let mut f = line.split(',');
    let (Some(ts), Some(ctx), Some(gen_), None) = (f.next(), f.next(), f.next(), f.next()) else {
        return Err(err("expected 3 fields".into()));
    };
    let ts = parse_timestamp(ts).ok_or_else(|| err(format!("bad timestamp {ts:?}")))?;
    let ctx: u64 = ctx
        .trim()
        .parse()
        .map_err(|_| err(format!("bad ContextTokens {ctx:?}")))?;
    let gen_: u64 = gen_
        .trim()
        .parse()
        .map_err(|_| err(format!("bad GeneratedTokens {gen_:?}")))?;
    Ok((ts, ctx, gen_))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::Prompt;

    #[test]
    fn timestamps_parse_to_microseconds() {
        let a = parse_timestamp("2023-11-16 18:15:46.6805900").unwrap();
        let b = parse_timestamp("2023-11-16 18:15:50.9951690").unwrap();
        assert_eq!(b - a, 4_314_579);
        let c = parse_timestamp("2023-11-17 00:00:00").unwrap();
        let d = parse_timestamp("2023-11-16 23:59:59.5").unwrap();
        assert_eq!(c - d, 500_000);
        assert_eq!(parse_timestamp("1970-01-01 00:00:01"), Some(1_000_000));
        assert!(parse_timestamp("2023-13-01 00:00:00").is_none());
        assert!(parse_timestamp("garbage").is_none());
    }

    #[test]
    fn rows_are_unique_and_errors_typed() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,40,4\n2023-11-16 18:15:48.0,40,0\n";
        let w = parse(
            text,
            &AzureParams {
                speed: 2.0,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(w.sessions[1].turns[0].arrival_us, Some(1_000_000));
        assert_eq!(w.sessions[1].turns[0].output_tokens, 1);
        let (Prompt::Blocks(a), Prompt::Blocks(b)) = (
            &w.sessions[0].turns[0].prompt,
            &w.sessions[1].turns[0].prompt,
        ) else {
            panic!("block prompts expected")
        };
        assert_ne!(a.tokens()[..16], b.tokens()[..16]);
        let p = AzureParams::default();
        assert!(matches!(
            parse("x\n", &p),
            Err(WorkloadError::Parse { line: 1, .. })
        ));
        let bad = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,-4,4\n";
        assert!(matches!(
            parse(bad, &p),
            Err(WorkloadError::Parse { line: 2, .. })
        ));
    }

    #[test]
    fn arrival_jitter_moves_the_times_within_the_band() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,40,4\n\
                    2023-11-16 18:15:48.0,40,2\n2023-11-16 18:15:49.0,40,2\n";
        let p = AzureParams {
            arrival_jitter: 0.2,
            jitter_seed: 5,
            ..Default::default()
        };
        let w = parse(text, &p).unwrap();
        let t: Vec<u64> = w
            .sessions
            .iter()
            .map(|s| s.turns[0].arrival_us.unwrap())
            .collect();
        assert_eq!(t[0], 0);
        assert!((1_600_000..=2_400_000).contains(&t[1]), "{t:?}");
        assert!((800_000..=1_200_000).contains(&(t[2] - t[1])), "{t:?}");
        assert_ne!(t, vec![0, 2_000_000, 3_000_000]);
        let bad = AzureParams {
            arrival_jitter: -0.5,
            ..Default::default()
        };
        assert!(matches!(parse(text, &bad), Err(WorkloadError::Param(_))));
    }
}

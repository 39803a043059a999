//! Readers on the real trace files vendored in the repository (`traces/`, xz-compressed), located
//! relative to this crate.

use kvsteer_workload::azure::{self, AzureParams};
use kvsteer_workload::mooncake::{self, MooncakeParams};
use kvsteer_workload::weka::{self, WekaParams};
use kvsteer_workload::{Driver, Mode, Prompt, Workload};
use std::collections::HashSet;
use std::path::PathBuf;

fn trace(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../traces")
        .join(format!("{name}.xz"))
}

/// The vendored files are the upstream bytes: their SHA-256 after decompression is the one
/// `traces/README.md` gives, so a damaged or replaced trace fails here instead of quietly moving
/// every benchmark figure.
#[test]
fn vendored_traces_match_their_published_checksums() {
    use sha2::{Digest, Sha256};
    let readme = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces/README.md"),
    )
    .unwrap();
    for name in [
        "weka_cc_sample36.jsonl",
        "weka_cc_validation_v1.jsonl",
        "weka_cc_validation_v2.jsonl",
        "weka_cc_validation_v3.jsonl",
        "mooncake_synthetic_trace.jsonl",
        "azure_llm_inference_conv_2023.csv",
    ] {
        let compressed = std::fs::read(trace(name)).unwrap();
        let mut text = Vec::new();
        lzma_rs::xz_decompress(&mut compressed.as_slice(), &mut text).unwrap();
        let digest: String = Sha256::digest(&text)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| `{name}` |")))
            .unwrap_or_else(|| panic!("traces/README.md has no checksum row for {name}"));
        assert!(
            row.contains(&format!("`{digest}`")),
            "{name}: decompressed SHA-256 {digest} is not the one in traces/README.md: {row}"
        );
    }
}

fn keys(w: &Workload, s: usize, t: usize) -> &[u64] {
    match &w.sessions[s].turns[t].prompt {
        Prompt::Blocks(b) => &b.keys,
        other => panic!("block prompt expected, got {other:?}"),
    }
}

/// The default reading, parsed once for all tests (debug builds parse 18 MB slowly).
fn weka_default() -> &'static Workload {
    static W: std::sync::OnceLock<Workload> = std::sync::OnceLock::new();
    W.get_or_init(|| {
        weka::read(&WekaParams {
            path: trace("weka_cc_sample36.jsonl"),
            ..Default::default()
        })
        .unwrap()
    })
}

#[test]
fn weka_counts_and_skips() {
    let w = weka_default();
    let skipped = w.note(weka::NOTE_SKIPPED);
    // README: 2,050 main requests + 61 sub-agent requests; 500 of them are above 131,072 tokens.
    assert_eq!(w.total_requests() as u64 + skipped, 2050 + 61);
    assert_eq!(skipped, 500);
    assert_eq!(w.note(weka::NOTE_SUBAGENT_REQUESTS), 61);
    assert_eq!(
        w.sessions.len() as u64 + w.note(weka::NOTE_DROPPED_SESSIONS),
        36
    );
    assert_eq!(w.block_size, 64);
    assert!(
        w.sessions
            .iter()
            .flat_map(|s| &s.turns)
            .all(|t| t.fixed_prompt_len().unwrap() <= 131_072)
    );
    let truncated = weka::read(&WekaParams {
        path: trace("weka_cc_sample36.jsonl"),
        over_long: weka::OverLong::Truncate,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(truncated.total_requests(), 2111);
    assert_eq!(truncated.note(weka::NOTE_TRUNCATED), 500);
}

/// Each coding-agent file (the training sample and the three validation samples) opens and holds 36
/// sessions, the ids `traces/weka_cc_validation_sessions.txt` lists for it, and no session is in two
/// files. The request counts are the files' own (main + sub-agent requests, of which those above the
/// 128K cap are skipped), so a replaced file fails here as well as on its checksum.
#[test]
fn coding_agent_samples_hold_36_sessions_each_and_share_none() {
    let list = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../traces")
            .join(weka::SESSIONS_FILE),
    )
    .unwrap();
    let listed = |file: &str| -> Vec<String> {
        let line = list
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{file}: ")))
            .unwrap_or_else(|| panic!("{} lists no sessions for {file}", weka::SESSIONS_FILE));
        line.split_whitespace().map(String::from).collect()
    };
    // (file, requests in the file, of them above the cap, sessions left with a request)
    let files = [
        (weka::FILE, 2050 + 61, 500, 28),
        (weka::VALIDATION_FILES[0], 1675, 530, 27),
        (weka::VALIDATION_FILES[1], 1945, 342, 28),
        (weka::VALIDATION_FILES[2], 2630 + 44, 490, 32),
    ];
    let mut seen = HashSet::new();
    for (file, requests, skipped, kept) in files {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../traces")
            .join(file);
        let all = weka::read(&WekaParams {
            path: path.clone(),
            over_long: weka::OverLong::Truncate,
            ..Default::default()
        })
        .unwrap();
        let ids: Vec<String> = all.sessions.iter().map(|s| s.id.clone()).collect();
        assert_eq!(ids.len(), 36, "{file}");
        assert_eq!(ids, listed(file), "{file}");
        assert!(ids.iter().all(|id| seen.insert(id.clone())), "{file}");
        assert_eq!(all.total_requests(), requests, "{file}");
        let w = weka::read(&WekaParams {
            path,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(w.note(weka::NOTE_SKIPPED), skipped as u64, "{file}");
        assert_eq!(w.total_requests() + skipped, requests, "{file}");
        assert_eq!(w.sessions.len(), kept, "{file}");
        assert_eq!(
            w.sessions.len() as u64 + w.note(weka::NOTE_DROPPED_SESSIONS),
            36
        );
    }
}

#[test]
fn weka_namespaces_local_ids_but_shares_the_tool_system_prefix() {
    let w = weka_default();
    let a = keys(w, 0, 0);
    let b = keys(w, 1, 0);
    // Both sessions' first block is local id 1, inside the shared tool+system prefix: same tokens.
    assert_eq!(a[0], b[0]);
    assert_eq!(a[..100], b[..100]);
    // Far past both prefixes (about 260 blocks), local ids are namespaced: no collision.
    let beyond = 300.min(a.len()).min(b.len());
    assert!(beyond > 260);
    let sa: HashSet<u64> = a[beyond - 20..beyond].iter().copied().collect();
    assert!(b[beyond - 20..beyond].iter().all(|k| !sa.contains(k)));
    // Within a session, the next turn reuses the previous turn's blocks.
    // (Session 1 has no sub-agent; session 0's turn 1 is its first sub-agent request, which shares only
    // the parent's namespace.)
    let b1 = keys(w, 1, 1);
    assert_eq!(b1[..b.len()], b[..]);
    let sub = keys(w, 0, 1);
    assert_ne!(sub[0], a[0]);
    // With no global prefix, even block 0 differs between sessions.
    let private = weka::read(&WekaParams {
        path: trace("weka_cc_sample36.jsonl"),
        shared_prefix_fraction: 0.0,
        ..Default::default()
    })
    .unwrap();
    assert_ne!(keys(&private, 0, 0)[0], keys(&private, 1, 0)[0]);
    assert_eq!(private.note(weka::NOTE_GLOBAL_BLOCKS), 0);
}

#[test]
fn weka_prompts_expand_to_their_length_and_share_tokens() {
    let w = weka_default();
    let mut d = Driver::new(w.clone(), Mode::Closed { concurrency: 2 });
    let mut out = vec![];
    d.poll(0, &mut out);
    assert_eq!(out.len(), 2);
    assert_eq!(
        out[0].prompt.len(),
        w.sessions[0].turns[0].fixed_prompt_len().unwrap()
    );
    assert_eq!(out[0].prompt[..64 * 100], out[1].prompt[..64 * 100]);
    assert_eq!(out[0].session_id, w.sessions[0].id);
}

#[test]
fn mooncake_real_trace() {
    let path = trace("mooncake_synthetic_trace.jsonl");
    let w = mooncake::read(&MooncakeParams {
        path: path.clone(),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(w.sessions.len(), 3993);
    assert_eq!(w.block_size, 512);
    let last = w
        .sessions
        .iter()
        .map(|s| s.turns[0].arrival_us.unwrap())
        .max()
        .unwrap();
    assert_eq!(last, 1_022_025_000);
    // README: an infinite prefix cache would hit 64% of blocks. Recompute it from the keys, treating a
    // block as a hit when the same chain of keys (the same prefix) was seen before.
    let (mut seen, mut hit, mut total) = (HashSet::new(), 0u64, 0u64);
    for s in &w.sessions {
        let Prompt::Blocks(b) = &s.turns[0].prompt else {
            panic!()
        };
        let mut chain = 0u64;
        for k in &b.keys {
            chain = chain.rotate_left(17) ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            total += 1;
            hit += u64::from(!seen.insert(chain));
        }
    }
    let rate = hit as f64 / total as f64;
    assert!(
        (0.63..0.65).contains(&rate),
        "infinite-cache hit rate {rate}"
    );
    let fast = mooncake::read(&MooncakeParams {
        path,
        speed: 2.0,
        max_requests: Some(100),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(fast.sessions.len(), 100);
    let a = w.sessions[99].turns[0].arrival_us.unwrap();
    assert_eq!(fast.sessions[99].turns[0].arrival_us.unwrap(), a / 2);
}

#[test]
fn azure_real_trace() {
    let w = azure::read(&AzureParams {
        path: trace("azure_llm_inference_conv_2023.csv"),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(w.sessions.len(), 19_366);
    let arr: Vec<u64> = w
        .sessions
        .iter()
        .map(|s| s.turns[0].arrival_us.unwrap())
        .collect();
    assert_eq!(arr[0], 0);
    assert!(
        arr.windows(2).all(|p| p[0] <= p[1]),
        "file is in time order"
    );
    // 18:15:46.68 to 19:14:08.40: about 58 minutes.
    let span_s = *arr.last().unwrap() as f64 / 1e6;
    assert!((3490.0..3510.0).contains(&span_s), "{span_s}");
    // No reuse: the first 16 tokens of the first 2,000 requests are all distinct.
    let mut firsts = HashSet::new();
    for s in &w.sessions[..2000] {
        let Prompt::Blocks(b) = &s.turns[0].prompt else {
            panic!()
        };
        assert!(b.keys.is_empty());
        let t = b.tokens();
        assert!(firsts.insert(t[..t.len().min(16)].to_vec()));
    }
    let limited = azure::read(&AzureParams {
        path: trace("azure_llm_inference_conv_2023.csv"),
        max_rows: Some(50),
        speed: 10.0,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(limited.sessions.len(), 50);
    assert_eq!(
        limited.sessions[49].turns[0].arrival_us.unwrap(),
        arr[49] / 10
    );
}

#[test]
fn weka_trunks_make_most_requests_start_in_the_global_prefix() {
    use kvsteer_workload::token_blocks::block_key;
    let w = weka_default();
    let g0 = block_key("global:weka-main", 0);
    for (i, s) in w.sessions.iter().enumerate() {
        let starts = (0..s.turns.len())
            .filter(|&t| keys(w, i, t).first() == Some(&g0))
            .count();
        assert!(
            2 * starts >= s.turns.len(),
            "session {} : {starts}/{}",
            s.id,
            s.turns.len()
        );
    }
    // trace_0010's sub-agents (Explore) share their own global prefix.
    let s0 = &w.sessions[0];
    assert_eq!(s0.id, "trace_0010");
    assert_eq!(keys(w, 0, 1)[0], block_key("global:weka-sub:Explore", 0));
}

#[test]
fn weka_copies_are_new_users_sharing_only_the_global_prefix() {
    let w = weka::read(&WekaParams {
        path: trace("weka_cc_sample36.jsonl"),
        copies: 2,
        ..Default::default()
    })
    .unwrap();
    let base = weka_default();
    assert_eq!(w.sessions.len(), 2 * base.sessions.len());
    assert_eq!(w.total_requests(), 2 * base.total_requests());
    let n = base.sessions.len();
    assert_eq!(w.sessions[n].id, format!("{}#1", w.sessions[0].id));
    let (a, b) = (keys(&w, 0, 0), keys(&w, n, 0));
    assert_eq!(a[..100], b[..100], "global prefix shared");
    assert_eq!(a.len(), b.len());
    assert_ne!(
        a[a.len() - 1],
        b[b.len() - 1],
        "private part namespaced per copy"
    );
    assert_eq!(
        w.note(weka::NOTE_SKIPPED),
        500,
        "notes describe the trace, not the copies"
    );
}

//! `tokenizer.huggingface.fetch`: where a worker VM fetches its Hugging Face bundle at run time,
//! instead of the files' text inline in the plugin configuration (docs/design/tokenizer.md,
//! "Fetching the bundle"). The filter does the fetching (an HTTP callout per VM, retried with
//! backoff); this is the section and its checks, and [`check_bundle`], the checks of an answer
//! before its files are parsed.

use serde::Deserialize;
use sha2::{Digest, Sha256};

fn d_path() -> String {
    kvsteer_core::bundle::BUNDLE_PATH.into()
}
fn d_max_bytes() -> usize {
    32 << 20
}
fn d_timeout_ms() -> u64 {
    10_000
}
fn d_retry_min_ms() -> u64 {
    1_000
}
fn d_retry_max_ms() -> u64 {
    60_000
}

/// Where and how the bundle is fetched.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BundleFetch {
    /// The upstream of the callout: an Envoy cluster (a replica's `kvsteer-feed`, or any server of
    /// the bundle), or with nginx the `host:port` ngx_wasm_module dispatches to.
    pub cluster: String,
    /// The path of the bundle (`kvsteer-feed` serves it at `/kvsteer/tokenizer`).
    #[serde(default = "d_path")]
    pub path: String,
    /// `:authority` of the callout (default: `cluster`).
    #[serde(default)]
    pub authority: Option<String>,
    /// SHA-256 of the whole answer body, 64 hex digits: anything else is refused.
    pub sha256: String,
    /// The model name the bundle must declare (`kvsteer-feed --model-name`); none: not checked.
    #[serde(default)]
    pub model: Option<String>,
    /// Answers longer than this are refused before they are copied into the VM.
    #[serde(default = "d_max_bytes")]
    pub max_bytes: usize,
    /// One fetch, end to end (the proxy's callout timeout).
    #[serde(default = "d_timeout_ms")]
    pub timeout_ms: u64,
    /// The wait after a first failed or refused fetch; it doubles after each, up to `retry_max_ms`.
    #[serde(default = "d_retry_min_ms")]
    pub retry_min_ms: u64,
    /// The longest wait between two fetches.
    #[serde(default = "d_retry_max_ms")]
    pub retry_max_ms: u64,
}

impl BundleFetch {
    /// The section's own checks; the error starts with the field (relative to `fetch`).
    pub fn check(&self) -> Result<(), String> {
        if self.cluster.is_empty() {
            return Err("cluster: required (the upstream serving the bundle)".into());
        }
        if !self.path.starts_with('/') {
            return Err(format!("path: must start with '/', got {:?}", self.path));
        }
        if self.sha256.len() != 64 || !self.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "sha256: must be 64 hex digits (the SHA-256 of the bundle as served), got {:?}",
                self.sha256
            ));
        }
        if self.max_bytes == 0 || self.max_bytes > 1 << 30 {
            return Err(format!(
                "max_bytes: must be 1..=1073741824, got {}",
                self.max_bytes
            ));
        }
        if !(1..=600_000).contains(&self.timeout_ms) {
            return Err(format!(
                "timeout_ms: must be 1..=600000, got {}",
                self.timeout_ms
            ));
        }
        if self.retry_min_ms == 0 || self.retry_min_ms > self.retry_max_ms {
            return Err(format!(
                "retry_min_ms: must be 1..=retry_max_ms ({}), got {}",
                self.retry_max_ms, self.retry_min_ms
            ));
        }
        if self.retry_max_ms > 3_600_000 {
            return Err(format!(
                "retry_max_ms: must be at most 3600000, got {}",
                self.retry_max_ms
            ));
        }
        Ok(())
    }
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An answer's checks before its files are parsed: the digest the configuration names, the
/// bundle's framing, and the model name when one is configured. The error is the reason a refusal
/// is logged with.
pub fn check_bundle<'a>(
    fetch: &BundleFetch,
    body: &'a [u8],
) -> Result<kvsteer_core::bundle::Bundle<'a>, String> {
    let got = sha256_hex(body);
    if !got.eq_ignore_ascii_case(&fetch.sha256) {
        return Err(format!(
            "digest mismatch: the answer's sha256 is {got}, the configuration names {}",
            fetch.sha256.to_ascii_lowercase()
        ));
    }
    let bundle = kvsteer_core::bundle::decode(body)?;
    if let Some(want) = &fetch.model
        && bundle.model != Some(want.as_str())
    {
        return Err(format!(
            "model mismatch: the bundle is for {:?}, the configuration names {want:?}",
            bundle.model.unwrap_or("no model")
        ));
    }
    Ok(bundle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fetch(sha: &str) -> BundleFetch {
        serde_json::from_value(serde_json::json!({"cluster": "c", "sha256": sha})).unwrap()
    }

    #[test]
    fn defaults_and_checks() {
        let f = fetch(&"a".repeat(64));
        assert_eq!(f.path, "/kvsteer/tokenizer");
        assert_eq!(f.max_bytes, 32 << 20);
        assert!(f.check().is_ok());
        assert!(fetch("abc").check().unwrap_err().starts_with("sha256"));
        let mut bad = f.clone();
        bad.retry_min_ms = bad.retry_max_ms + 1;
        assert!(bad.check().unwrap_err().starts_with("retry_min_ms"));
    }

    #[test]
    fn an_answer_is_checked_by_digest_then_frame_then_model() {
        let body = kvsteer_core::bundle::encode(Some("m"), b"{}", None);
        let mut f = fetch(&sha256_hex(&body).to_uppercase());
        assert!(check_bundle(&f, &body).is_ok());
        f.model = Some("other".into());
        assert!(
            check_bundle(&f, &body)
                .unwrap_err()
                .starts_with("model mismatch")
        );
        assert!(
            check_bundle(&f, b"junk")
                .unwrap_err()
                .starts_with("digest mismatch")
        );
        let junk = b"junk";
        let f = fetch(&sha256_hex(junk));
        assert!(
            check_bundle(&f, junk)
                .unwrap_err()
                .contains("not a kvsteer")
        );
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}

//! A Hugging Face bundle fetched at run time (`tokenizer.huggingface.fetch`, docs/design/tokenizer.md,
//! "Fetching the bundle"): each worker VM fetches its own copy over one HTTP callout, checks it (size
//! before copying it, then the configured SHA-256, the framing, the model name) and loads it; until
//! then text prompts keep the approximate identity, as without a tokenizer. A failed fetch or a
//! refused bundle is retried after a wait that doubles from `retry_min_ms` to `retry_max_ms`
//! (jittered 80-120%), for as long as the VM lives; the filter routes throughout.
//!
//! Like the feed pollers' state ([`super::pollers`]), this is free of host calls: the root context
//! dispatches the callout [`WorkerState::plan_bundle_fetch`] asks for and hands the answer over. The
//! fetch's state is [`BundleFetchState`]'s; the tokenizer it loads is [`Prompts`]'.

use super::WorkerState;
use super::prompts::Prompts;
use crate::config::TokenizerSection;
use kvsteer_tokenizer::TextTokenizer;
use kvsteer_tokenizer::fetch::{BundleFetch, check_bundle};

/// Where the fetch stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The next fetch is due at this time (ms).
    Due(u64),
    /// A callout is out: its token and when it was sent.
    InFlight { token: u32, since: u64 },
    /// Loaded: nothing more to fetch.
    Loaded,
}

/// One VM's fetch of its bundle.
#[derive(Clone, Debug)]
pub struct BundleFetchState {
    fetch: BundleFetch,
    phase: Phase,
    /// The wait after the next failure.
    backoff_ms: u64,
    /// Fetches sent (dispatched or not).
    pub attempts: u64,
    /// Answers refused: oversized, wrong digest, bad framing, another model, files that do not load.
    pub refused: u64,
    /// Fetches that got no bundle: not dispatched, no answer, a timeout, a status other than 200.
    pub failures: u64,
}

/// A fetch to dispatch now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleRequest {
    pub upstream: String,
    pub authority: String,
    pub path: String,
    pub timeout_ms: u64,
}

/// What an answer (or a fetch that could not be sent) came to, for the log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BundleOutcome {
    /// Loaded: the answer's size, the model it declares, the SHA-256 checked.
    Loaded {
        bytes: usize,
        model: Option<String>,
        sha256: String,
    },
    /// A bundle arrived and was refused, and why; retried after `retry_in_ms`.
    Refused { why: String, retry_in_ms: u64 },
    /// No bundle arrived, and why; retried after `retry_in_ms`.
    Failed { why: String, retry_in_ms: u64 },
    /// Not this fetch's answer (a late one for an abandoned callout).
    Unknown,
}

impl BundleFetchState {
    pub fn new(fetch: BundleFetch) -> BundleFetchState {
        BundleFetchState {
            backoff_ms: fetch.retry_min_ms,
            fetch,
            phase: Phase::Due(0),
            attempts: 0,
            refused: 0,
            failures: 0,
        }
    }

    /// Schedules the next fetch after a failure, jittered from `now`'s low bits so that workers that
    /// failed together do not retry together; returns the wait.
    fn retry(&mut self, now: u64) -> u64 {
        let jitter = 80 + (now.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) % 41;
        let wait = self.backoff_ms * jitter / 100;
        self.backoff_ms = (self.backoff_ms * 2).min(self.fetch.retry_max_ms);
        self.phase = Phase::Due(now + wait.max(1));
        wait
    }
}

impl BundleFetchState {
    /// The fetch to dispatch now, if one is due: the first tick, then after each wait. A callout the
    /// proxy never answers is given up after twice its timeout.
    fn plan(&mut self, now: u64) -> Option<BundleRequest> {
        match self.phase {
            Phase::Due(at) if now >= at => {}
            Phase::InFlight { since, .. } if now >= since + 2 * self.fetch.timeout_ms => {
                self.failures += 1;
                self.retry(now);
                return None;
            }
            _ => return None,
        }
        let f = &self.fetch;
        Some(BundleRequest {
            upstream: f.cluster.clone(),
            authority: f.authority.clone().unwrap_or_else(|| f.cluster.clone()),
            path: f.path.clone(),
            timeout_ms: f.timeout_ms,
        })
    }

    fn started(&mut self, token: u32, now: u64) {
        self.attempts += 1;
        self.phase = Phase::InFlight { token, since: now };
    }

    /// The proxy refused to send the fetch.
    fn not_started(&mut self, why: &str, now: u64) -> BundleOutcome {
        self.attempts += 1;
        self.failures += 1;
        let retry_in_ms = self.retry(now);
        BundleOutcome::Failed {
            why: format!("the proxy did not send the callout ({why})"),
            retry_in_ms,
        }
    }

    fn is_fetch(&self, token: u32) -> bool {
        matches!(self.phase, Phase::InFlight { token: t, .. } if t == token)
    }
}

impl Prompts {
    /// [`WorkerState::on_bundle_answer`], `section` the configuration's `tokenizer`.
    fn on_bundle_answer(
        &mut self,
        section: Option<&TokenizerSection>,
        status: Option<u16>,
        size: usize,
        body: Option<&[u8]>,
        now: u64,
    ) -> BundleOutcome {
        let Some(b) = self.bundle.as_mut() else {
            return BundleOutcome::Unknown;
        };
        let max = b.fetch.max_bytes;
        let failed = match (status, body) {
            (None, _) => Some("no answer (connection failed, reset or timed out)".to_string()),
            (Some(200), _) if size > max => None,
            (Some(200), None) => Some("an empty answer, or one the proxy did not hand over".into()),
            (Some(200), Some(_)) => None,
            (Some(s), _) => Some(format!("HTTP status {s}")),
        };
        if let Some(why) = failed {
            b.failures += 1;
            let retry_in_ms = b.retry(now);
            return BundleOutcome::Failed { why, retry_in_ms };
        }
        let loaded = match body {
            Some(body) if size <= max => self.load_bundle(section, body),
            _ => Err(format!("{size} bytes, over fetch.max_bytes ({max})")),
        };
        let Some(b) = self.bundle.as_mut() else {
            return BundleOutcome::Unknown;
        };
        match loaded {
            Ok((model, sha256)) => {
                b.phase = Phase::Loaded;
                BundleOutcome::Loaded {
                    bytes: size,
                    model,
                    sha256,
                }
            }
            Err(why) => {
                b.refused += 1;
                let retry_in_ms = b.retry(now);
                BundleOutcome::Refused { why, retry_in_ms }
            }
        }
    }

    /// Checks and loads a bundle into this VM's tokenizer; the model it declares and its digest.
    fn load_bundle(
        &mut self,
        section: Option<&TokenizerSection>,
        body: &[u8],
    ) -> Result<(Option<String>, String), String> {
        let (Some(b), Some(cfg)) = (self.bundle.as_ref(), section) else {
            return Err("no tokenizer configured".into());
        };
        let bundle = check_bundle(&b.fetch, body)?;
        let t = TextTokenizer::with_huggingface(
            cfg,
            bundle.tokenizer_json,
            bundle.tokenizer_config_json,
        )
        .map_err(|e| format!("the files do not load: {e}"))?;
        let done = (
            bundle.model.map(str::to_string),
            b.fetch.sha256.to_ascii_lowercase(),
        );
        self.install(t);
        Ok(done)
    }
}

impl WorkerState {
    /// The fetch to dispatch now, if one is due: the first tick, then after each wait. A callout the
    /// proxy never answers is given up after twice its timeout.
    pub fn plan_bundle_fetch(&mut self, now: u64) -> Option<BundleRequest> {
        self.prompts.bundle.as_mut()?.plan(now)
    }

    pub fn bundle_fetch_started(&mut self, token: u32, now: u64) {
        if let Some(b) = self.prompts.bundle.as_mut() {
            b.started(token, now);
        }
    }

    /// The proxy refused to send the fetch.
    pub fn bundle_fetch_not_started(&mut self, why: &str, now: u64) -> BundleOutcome {
        match self.prompts.bundle.as_mut() {
            Some(b) => b.not_started(why, now),
            None => BundleOutcome::Unknown,
        }
    }

    /// Whether `token` is this VM's bundle fetch.
    pub fn is_bundle_fetch(&self, token: u32) -> bool {
        self.prompts
            .bundle
            .as_ref()
            .is_some_and(|b| b.is_fetch(token))
    }

    /// The largest answer taken into the VM (`fetch.max_bytes`).
    pub fn bundle_max_bytes(&self) -> usize {
        self.prompts
            .bundle
            .as_ref()
            .map_or(0, |b| b.fetch.max_bytes)
    }

    /// The answer to the fetch: `status` None when none came (reset, timeout); `body` None when it
    /// was over `max_bytes` (`size` then says how large) or the proxy would not hand it over.
    pub fn on_bundle_answer(
        &mut self,
        status: Option<u16>,
        size: usize,
        body: Option<&[u8]>,
        now: u64,
    ) -> BundleOutcome {
        let section = self.cfg.tokenizer.as_ref();
        self.prompts
            .on_bundle_answer(section, status, size, body, now)
    }

    /// Whether text prompts are tokenized now: a tokenizer configured and, when its bundle is
    /// fetched, loaded. False without a `tokenizer` section.
    pub fn tokenizer_ready(&self) -> bool {
        self.prompts.ready()
    }

    /// The bundle fetch's counters (attempts, refused, failed), when the bundle is fetched.
    pub fn bundle_fetch_counts(&self) -> Option<(u64, u64, u64)> {
        self.prompts
            .bundle
            .as_ref()
            .map(|b| (b.attempts, b.refused, b.failures))
    }
}

#[cfg(test)]
mod tests;

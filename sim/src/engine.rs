//! The engine model: vLLM-style continuous batching over a paged KV cache, in virtual time.
//!
//! The scheduler follows vLLM V1's unified model: every sequence has `tokens` (prompt plus output so
//! far) and `computed` (tokens whose KV exists); each step gives each scheduled sequence
//! `tokens - computed` new tokens to compute, capped by a per-step token budget (chunked prefill), so
//! prefill, decode and recompute after preemption are the same thing. Running sequences are served
//! first in arrival order; when blocks run out the most recently admitted running sequence is
//! preempted (its blocks freed, its progress recomputed later); waiting requests are admitted in FCFS
//! order while the budget, the running cap and the free blocks allow, after a prefix-cache lookup.
//! When a sequence's tokens are all computed at the end of a step it samples one token.
//!
//! Time is integer microseconds given by the caller: [`Engine::next_event_time`] says when the
//! current step ends and [`Engine::advance`] completes every step that ends by a time. Nothing depends
//! on wall time or on hash-map iteration order, so a run is reproducible for a seed.

use crate::kv::KvCache;
use crate::lora::{LoraConfig, LoraSlots};
use crate::output::{OutputLen, mix64, output_token};
use crate::profile::Profile;
use crate::stall::{StallConfig, Stalls};
use hashbrown::HashMap;
use kvsteer_core::block::BlockHasher;
use kvsteer_core::feed::log::FeedLog;
use std::collections::VecDeque;

mod report;
mod stats;
mod step;
mod submit;

pub use stats::{EngineStats, Histogram, ITL_BUCKETS, TTFT_BUCKETS};
pub use submit::{EngineRequest, SubmitError};

/// Engine configuration. [`EngineConfig::default`] is Llama-3.1-8B on one H100 with vLLM's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (vLLM's default 16).
    pub block_size: usize,
    /// GPU KV blocks.
    pub kv_blocks: u32,
    /// Host-memory KV blocks (0: no host tier).
    pub host_blocks: u32,
    /// Token budget per step (vLLM `max_num_batched_tokens`).
    pub max_batch_tokens: u32,
    /// Cap on running sequences (vLLM `max_num_seqs`).
    pub max_running: u32,
    /// Context limit: prompt plus `max_tokens`.
    pub max_model_len: u32,
    pub profile: Profile,
    /// Output length of requests that do not set `ignore_eos`.
    pub output_len: OutputLen,
    pub seed: u64,
    /// Epoch of the first start (0: derived from the seed, so virtual runs are reproducible).
    pub epoch: u64,
    /// Hashes the feed log retains before a lagging router needs a snapshot.
    pub feed_log_hashes: usize,
    /// LoRA adapter slots and load time ([`crate::lora`]); off by default.
    pub lora: LoraConfig,
    /// Random stalls, moments the engine runs no step ([`crate::stall`]); off by default.
    pub stall: StallConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let profile = Profile::default();
        Self {
            block_size: 16,
            kv_blocks: profile.kv_blocks_16,
            host_blocks: 0,
            max_batch_tokens: 8192,
            max_running: 256,
            max_model_len: profile.max_model_len,
            profile,
            output_len: OutputLen::default(),
            seed: 0,
            epoch: 0,
            feed_log_hashes: 1 << 20,
            lora: LoraConfig::default(),
            stall: StallConfig::default(),
        }
    }
}

impl EngineConfig {
    /// Replica `i` of a fleet built from this template: the same engine with its own seed, so the
    /// replicas are identical in configuration but do not sample the same output ids. The wasmtime
    /// harness and the browser playground both build their fleets with this rule, so the same seed
    /// gives the same fleet in both.
    pub fn for_replica(&self, i: usize) -> EngineConfig {
        EngineConfig {
            seed: self.seed.wrapping_add(i as u64 * 7919 + 1),
            ..self.clone()
        }
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Reached `max_tokens`.
    Length,
    /// Reached its natural (EOS) length.
    Stop,
    /// Aborted by the client or by a restart.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// What the engine reports as steps complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    FirstToken {
        id: u64,
        t_us: u64,
        cached_tokens: u32,
        token: u32,
    },
    Token {
        id: u64,
        t_us: u64,
        token: u32,
    },
    Finished {
        id: u64,
        t_us: u64,
        prompt_tokens: u32,
        cached_tokens: u32,
        completion_tokens: u32,
        reason: FinishReason,
    },
}

impl EngineEvent {
    pub fn id(&self) -> u64 {
        match self {
            EngineEvent::FirstToken { id, .. }
            | EngineEvent::Token { id, .. }
            | EngineEvent::Finished { id, .. } => *id,
        }
    }
}

#[derive(Clone, Debug)]
struct Seq {
    id: u64,
    tokens: Vec<u32>,
    prompt_len: u32,
    /// Sequence hashes of every full block of `tokens`.
    hashes: Vec<u64>,
    /// Blocks of `blocks` registered in the prefix cache.
    registered: usize,
    blocks: Vec<u32>,
    computed: usize,
    generated: u32,
    target: u32,
    max_tokens: u32,
    /// Prefix-cache hit at first scheduling (`None` until then).
    cached_tokens: Option<u32>,
    arrival_us: u64,
    last_token_us: u64,
    /// A decode-role request whose prompt KV is being read from a prefill engine
    /// ([`Engine::submit_remote`]): not admissible before this time; cleared at admission, so a
    /// preempted one recomputes locally (vLLM reads a request's remote KV once).
    remote_ready_us: Option<u64>,
    /// The LoRA adapter the request runs with ([`LoraSlots::intern`]); `None`: the base model.
    adapter: Option<u32>,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.generated > 0 && self.tokens.len() - self.computed == 1
    }
}

#[derive(Clone, Debug)]
struct Step {
    end_us: u64,
    /// (slot, request id, tokens computed)
    work: Vec<(u32, u64, u32)>,
}

/// One request in flight on an engine, as a what-if planner sees it ([`Engine::sequences`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqView {
    pub id: u64,
    pub prompt_tokens: u32,
    /// Prompt plus the output generated so far.
    pub context_tokens: u32,
    /// Tokens whose KV exists (0 for a waiting request, or one preempted for recompute).
    pub computed_tokens: u32,
    pub generated: u32,
    /// Output tokens it will still generate: the true figure, since the engine draws each request's
    /// length at submission (a router only ever sees `max_tokens`, a cap).
    pub remaining: u32,
    /// Admitted (running), not waiting.
    pub running: bool,
}

/// A simulated engine replica.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    hasher: BlockHasher,
    kv: KvCache,
    log: FeedLog,
    slots: Vec<Option<Seq>>,
    free_slots: Vec<u32>,
    by_id: HashMap<u64, u32>,
    running: Vec<u32>,
    waiting: VecDeque<u32>,
    step: Option<Step>,
    now_us: u64,
    pending: Vec<EngineEvent>,
    slowdown: f64,
    restarts: u64,
    stats: EngineStats,
    scratch: Vec<(u32, u64, u32)>,
    /// Set by [`Engine::submit_remote`] around its `submit`: the new sequence's KV read end.
    pending_remote: Option<u64>,
    /// LoRA adapter slots; set by [`Engine::submit_with_adapter`] around its `submit`: the new
    /// sequence's adapter.
    lora: LoraSlots,
    pending_adapter: Option<u32>,
    /// When the engine stalls ([`crate::stall`]); never when `cfg.stall` is off.
    stalls: Stalls,
}

impl Engine {
    /// A fresh engine. An unusable block size falls back to 16 (the configuration is the caller's;
    /// the server validates its flags before getting here).
    pub fn new(mut cfg: EngineConfig) -> Engine {
        let hasher = BlockHasher::new(cfg.block_size).unwrap_or_else(|_| {
            cfg.block_size = 16;
            BlockHasher::new(16).expect("16 is a valid block size")
        });
        cfg.max_batch_tokens = cfg.max_batch_tokens.max(1);
        cfg.max_running = cfg.max_running.max(1);
        let epoch = if cfg.epoch != 0 {
            cfg.epoch
        } else {
            mix64(cfg.seed ^ 0x0065_706f_6368) | 1
        };
        Engine {
            lora: LoraSlots::new(cfg.lora),
            stalls: Stalls::new(cfg.stall, cfg.seed),
            kv: KvCache::new(cfg.kv_blocks, cfg.host_blocks),
            log: FeedLog::new(epoch, cfg.feed_log_hashes),
            hasher,
            cfg,
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_id: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            step: None,
            now_us: 0,
            pending: Vec::new(),
            slowdown: 1.0,
            restarts: 0,
            stats: EngineStats::default(),
            scratch: Vec::new(),
            pending_remote: None,
            pending_adapter: None,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn epoch(&self) -> u64 {
        self.log.epoch()
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The random stalls that held up a step, `[from, end)` in engine microseconds, oldest first
    /// ([`Stalls::held`]).
    pub fn held_stalls(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.stalls.held()
    }

    /// The engine's clock: the last time it was given.
    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    /// Multiplies every later step's duration (a "slow GPU" fault), clamped to `0.01..=1000`; a
    /// non-finite factor resets it to 1.
    pub fn set_slowdown(&mut self, factor: f64) {
        self.slowdown = if factor.is_finite() {
            factor.clamp(0.01, 1000.0)
        } else {
            1.0
        };
    }

    pub fn slowdown(&self) -> f64 {
        self.slowdown
    }

    /// Requests running or waiting.
    pub fn in_flight(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// The token id this engine generates at `position` of request `id`.
    pub fn output_token(&self, id: u64, position: u32) -> u32 {
        output_token(self.cfg.seed, id, position)
    }

    /// A copy of this engine to run forward without touching it (a what-if): the same requests,
    /// cache, clock, step in progress and seed, so it produces exactly the events this engine would
    /// if nothing else were submitted. Its feed log is a fresh one that keeps almost nothing (a
    /// what-if is never polled, and copying a log of a million hashes per question would dominate),
    /// and events already produced but not yet taken stay with this engine.
    pub fn fork(&self) -> Engine {
        Engine {
            cfg: self.cfg.clone(),
            hasher: self.hasher.clone(),
            kv: self.kv.clone(),
            log: FeedLog::new(self.log.epoch(), 1),
            slots: self.slots.clone(),
            free_slots: self.free_slots.clone(),
            by_id: self.by_id.clone(),
            running: self.running.clone(),
            waiting: self.waiting.clone(),
            step: self.step.clone(),
            now_us: self.now_us,
            pending: Vec::new(),
            slowdown: self.slowdown,
            restarts: self.restarts,
            stats: self.stats.clone(),
            scratch: Vec::new(),
            pending_remote: None,
            lora: self.lora.clone(),
            pending_adapter: None,
            stalls: self.stalls.clone(),
        }
    }

    /// Every request in flight, running ones first (in admission order), then the waiting queue in
    /// the order it will be admitted.
    pub fn sequences(&self) -> Vec<SeqView> {
        self.running
            .iter()
            .map(|&s| (s, true))
            .chain(self.waiting.iter().map(|&s| (s, false)))
            .filter_map(|(slot, running)| {
                let q = self.slots[slot as usize].as_ref()?;
                Some(SeqView {
                    id: q.id,
                    prompt_tokens: q.prompt_len,
                    context_tokens: q.tokens.len() as u32,
                    computed_tokens: q.computed as u32,
                    generated: q.generated,
                    remaining: q.target.saturating_sub(q.generated),
                    running,
                })
            })
            .collect()
    }

    /// The sequence hashes of `prompt`'s full blocks, in this engine's block size.
    pub fn prompt_hashes(&self, prompt: &[u32]) -> Vec<u64> {
        self.hasher
            .sequence_hashes(prompt)
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    /// Prompt tokens of a `prompt_len`-token prompt with these [`Engine::prompt_hashes`] that this
    /// engine would find cached (GPU, then host tier) if it admitted it now, as admission counts
    /// them (never the whole prompt: its last token is always computed).
    pub fn cached_prefix_tokens(&self, hashes: &[u64], prompt_len: usize) -> usize {
        if prompt_len == 0 {
            return 0;
        }
        let bs = self.cfg.block_size;
        let hit = self.kv.lookup(hashes, (prompt_len - 1) / bs);
        (hit.gpu_blocks + hit.host_blocks) * bs
    }

    /// Aborts a request; true when it was in flight. Its `Finished { reason: Abort }` comes out of the
    /// next [`Engine::advance`].
    pub fn abort(&mut self, now_us: u64, id: u64) -> bool {
        let Some(&slot) = self.by_id.get(&id) else {
            return false;
        };
        self.now_us = self.now_us.max(now_us);
        if let Some(i) = self.running.iter().position(|&s| s == slot) {
            self.running.remove(i);
        } else if let Some(i) = self.waiting.iter().position(|&s| s == slot) {
            self.waiting.remove(i);
        }
        self.finish(slot, self.now_us, FinishReason::Abort, None);
        true
    }

    /// A restart: every request in flight is aborted, the cache is cleared, and the feed starts a new
    /// epoch (a router's next poll gets a snapshot).
    pub fn restart(&mut self, now_us: u64) {
        self.now_us = self.now_us.max(now_us);
        let slots: Vec<u32> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for slot in slots {
            if let Some(seq) = self.slots[slot as usize].as_mut() {
                // Blocks vanish with the cache; no release needed.
                seq.blocks.clear();
            }
            self.finish(slot, self.now_us, FinishReason::Abort, None);
        }
        self.step = None;
        self.kv.clear();
        self.lora.clear();
        self.restarts += 1;
        let epoch = mix64(self.log.epoch() ^ self.restarts) | 1;
        self.log.reset(epoch);
    }

    /// When the step in progress ends; `None` when the engine is idle.
    pub fn next_event_time(&self) -> Option<u64> {
        match &self.step {
            Some(s) => Some(s.end_us),
            None => self.next_remote_ready(),
        }
    }

    /// The earliest end of a KV read a waiting request is still waiting for (an idle engine wakes
    /// up then).
    fn next_remote_ready(&self) -> Option<u64> {
        self.waiting
            .iter()
            .filter_map(|&s| self.slots[s as usize].as_ref()?.remote_ready_us)
            .min()
    }

    /// Runs every step that ends at or before `to_us`, appending what happened to `out`.
    pub fn advance(&mut self, to_us: u64, out: &mut Vec<EngineEvent>) {
        out.append(&mut self.pending);
        loop {
            match self.step.as_ref().map(|s| s.end_us) {
                Some(end) if end <= to_us => {
                    self.now_us = self.now_us.max(end);
                    self.complete_step(out);
                    self.plan(end);
                }
                Some(_) => break,
                // Idle: a KV read that ends by `to_us` starts a step then.
                None => match self.next_remote_ready() {
                    Some(t) if t <= to_us => {
                        let t = t.max(self.now_us);
                        self.now_us = t;
                        self.plan(t);
                        if self.step.is_none() {
                            break;
                        }
                    }
                    _ => break,
                },
            }
        }
        self.now_us = self.now_us.max(to_us);
        self.log.publish();
    }

    fn seq(&self, slot: u32) -> &Seq {
        self.slots[slot as usize]
            .as_ref()
            .expect("scheduled slots hold a sequence")
    }

    fn seq_mut(&mut self, slot: u32) -> &mut Seq {
        self.slots[slot as usize]
            .as_mut()
            .expect("scheduled slots hold a sequence")
    }

    /// Frees a sequence's slot and blocks, reporting it finished.
    fn finish(
        &mut self,
        slot: u32,
        t_us: u64,
        reason: FinishReason,
        out: Option<&mut Vec<EngineEvent>>,
    ) {
        let Some(seq) = self.slots[slot as usize].take() else {
            return;
        };
        self.kv.release(&seq.blocks);
        self.by_id.remove(&seq.id);
        self.free_slots.push(slot);
        match reason {
            FinishReason::Length => self.stats.finished_length += 1,
            FinishReason::Stop => self.stats.finished_stop += 1,
            FinishReason::Abort => self.stats.finished_abort += 1,
        }
        let ev = EngineEvent::Finished {
            id: seq.id,
            t_us,
            prompt_tokens: seq.prompt_len,
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            completion_tokens: seq.generated,
            reason,
        };
        match out {
            Some(out) => out.push(ev),
            None => self.pending.push(ev),
        }
    }

    /// Preempts (recompute) the most recently admitted running sequence.
    fn preempt_last(&mut self) -> Option<u32> {
        let slot = self.running.pop()?;
        let seq = self.slots[slot as usize]
            .as_mut()
            .expect("running slots hold a sequence");
        let blocks = std::mem::take(&mut seq.blocks);
        seq.computed = 0;
        seq.registered = 0;
        self.kv.release(&blocks);
        self.waiting.push_front(slot);
        self.stats.preemptions += 1;
        Some(slot)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }
}

//! What the engine reports about itself: its load as the feed and SGLang's `/get_load` count it, its
//! LoRA adapters, the answer to a feed poll, and the cache questions tests and `/metrics` ask. Reads
//! only, but for the feed log's publishing; nothing here moves the engine's clock or its queues.

use super::Engine;
use kvsteer_core::block::SeqHash;
use kvsteer_core::feed::{AdapterReport, FeedBatch, FeedQuery, ReplicaLoad};

impl Engine {
    /// Adapter loads since the engine started.
    pub fn adapter_loads(&self) -> u64 {
        self.lora.loads
    }

    /// Adapters resident on the GPU now, least recently used first.
    pub fn resident_adapters(&self) -> Vec<&str> {
        self.lora.resident()
    }

    /// What the feed reports about adapters (the adapters of running and of waiting requests, and
    /// the slots); `None` with LoRA off.
    pub fn adapter_report(&self) -> Option<AdapterReport> {
        let adapter = |s: &u32| self.slots[*s as usize].as_ref().and_then(|q| q.adapter);
        self.lora.report(
            self.running.iter().filter_map(adapter),
            self.waiting.iter().filter_map(adapter),
        )
    }

    /// Load as the replica reports it in the feed (field meanings: docs/reference/feed.md). Prefill
    /// tokens are the prompt tokens the engine will really compute: what running sequences have
    /// left, plus each waiting request's prompt minus the prefix it would find cached (GPU or host
    /// tier) if scheduled now. Counting a waiting prompt whole would charge the replica that holds
    /// a session's cache for tokens it will never compute, exactly when queues form.
    pub fn load(&self) -> ReplicaLoad {
        let mut prefill = 0u64;
        for &s in &self.running {
            if let Some(seq) = &self.slots[s as usize]
                && !seq.decoding()
            {
                prefill += (seq.tokens.len() - seq.computed) as u64;
            }
        }
        let bs = self.cfg.block_size as u64;
        for &s in &self.waiting {
            if let Some(seq) = &self.slots[s as usize] {
                if seq.remote_ready_us.is_some() {
                    // Its prompt arrives over the link: only the last token is computed here.
                    prefill += 1;
                    continue;
                }
                let hit = self.kv.lookup(&seq.hashes, seq.hashes.len());
                let cached = (hit.gpu_blocks + hit.host_blocks) as u64 * bs;
                prefill += (seq.tokens.len() as u64).saturating_sub(cached);
            }
        }
        ReplicaLoad {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            prefill_tokens: prefill,
            decode_blocks: self.decode_blocks(),
            kv_used_blocks: self.kv.used_blocks() as u64,
            kv_total_blocks: self.kv.total_blocks() as u64,
            block_size: self.cfg.block_size as u32,
        }
    }

    /// Tokens the replica holds or has queued, as SGLang's `/get_load` counts them (`num_tokens`):
    /// the KV blocks referenced by running sequences, in tokens, plus each waiting request's prompt
    /// minus the prefix it would find cached if scheduled now.
    pub fn load_tokens(&self) -> u64 {
        let bs = self.cfg.block_size as u64;
        let mut waiting = 0u64;
        for &s in &self.waiting {
            if let Some(seq) = &self.slots[s as usize] {
                let hit = self.kv.lookup(&seq.hashes, seq.hashes.len());
                let cached = (hit.gpu_blocks + hit.host_blocks) as u64 * bs;
                waiting += (seq.tokens.len() as u64).saturating_sub(cached);
            }
        }
        self.kv.referenced_blocks() as u64 * bs + waiting
    }

    /// KV blocks held by decoding sequences (the decode-block CV, docs/design/design.md section 7).
    pub fn decode_blocks(&self) -> u64 {
        self.running
            .iter()
            .filter_map(|&s| self.slots[s as usize].as_ref())
            .filter(|seq| seq.decoding())
            .map(|seq| seq.blocks.len() as u64)
            .sum()
    }

    /// Fraction of GPU blocks referenced by running sequences (vLLM's `kv_cache_usage_perc`).
    pub fn kv_usage(&self) -> f64 {
        if self.kv.total_blocks() == 0 {
            0.0
        } else {
            self.kv.referenced_blocks() as f64 / self.kv.total_blocks() as f64
        }
    }

    /// Answers a feed poll.
    pub fn feed(&mut self, q: &FeedQuery) -> FeedBatch {
        self.log.publish();
        let load = self.load();
        let kv = &self.kv;
        self.log.answer(q, load, || kv.snapshot())
    }

    /// Answers a feed poll as the bytes a replica sends: the batch, stamped with `rank` when one
    /// was asked for, and the adapter section when `query` asks for it (`adapters=1`) and LoRA is on
    /// (docs/reference/feed.md, "Adapters").
    pub fn feed_answer(&mut self, q: &FeedQuery, query: &str, rank: Option<u16>) -> Vec<u8> {
        let batch = self.feed(q);
        let mut body = match rank {
            Some(r) => batch.encode_for_rank(r),
            None => batch.encode(),
        };
        if kvsteer_core::feed::query_adapters(query)
            && let Some(r) = self.adapter_report()
        {
            r.append_to(&mut body);
        }
        body
    }

    /// Whether a sequence hash is cached on the GPU (for tests and diagnostics).
    pub fn is_cached(&self, h: SeqHash) -> bool {
        self.kv.is_cached(h.0)
    }
}

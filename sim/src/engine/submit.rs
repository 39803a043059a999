//! A request's way in: what the engine takes (a plain request, one whose prompt KV a prefill engine
//! computed, one with a LoRA adapter), what it refuses at the door, and the queueing of what it takes.
//! Everything after the waiting queue (admission, steps) is `step.rs`'.

use super::{Engine, Seq};

/// One request as the engine sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// Generate exactly `max_tokens` (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Generate at least this many tokens (vLLM's `min_tokens`).
    pub min_tokens: u32,
}

/// Why a request was refused at submission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubmitError {
    EmptyPrompt,
    ZeroMaxTokens,
    DuplicateId(u64),
    /// Prompt plus `max_tokens` exceeds the context limit.
    TooLong {
        tokens: u64,
        max_model_len: u32,
    },
    /// The request could never fit in the KV cache even alone.
    ExceedsKvCapacity {
        blocks: u64,
        kv_blocks: u32,
    },
}

impl core::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            SubmitError::EmptyPrompt => write!(f, "the prompt is empty"),
            SubmitError::ZeroMaxTokens => write!(f, "max_tokens must be at least 1"),
            SubmitError::DuplicateId(id) => write!(f, "request id {id} is already in flight"),
            SubmitError::TooLong {
                tokens,
                max_model_len,
            } => write!(
                f,
                "this model's maximum context length is {max_model_len} tokens, but the request \
                 needs {tokens} tokens (prompt plus max_tokens)"
            ),
            SubmitError::ExceedsKvCapacity { blocks, kv_blocks } => write!(
                f,
                "the request needs {blocks} KV blocks but the cache holds {kv_blocks}"
            ),
        }
    }
}

impl Engine {
    /// Queues a request arriving at `now_us`.
    pub fn submit(&mut self, now_us: u64, req: EngineRequest) -> Result<(), SubmitError> {
        let hashes = self.prompt_hashes(&req.prompt);
        self.submit_hashed(now_us, req, hashes)
    }

    /// [`Engine::submit`] with the prompt's [`Engine::prompt_hashes`] already computed.
    fn submit_hashed(
        &mut self,
        now_us: u64,
        req: EngineRequest,
        hashes: Vec<u64>,
    ) -> Result<(), SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        if self.by_id.contains_key(&req.id) {
            return Err(SubmitError::DuplicateId(req.id));
        }
        let tokens = req.prompt.len() as u64 + req.max_tokens as u64;
        if tokens > self.cfg.max_model_len as u64 {
            return Err(SubmitError::TooLong {
                tokens,
                max_model_len: self.cfg.max_model_len,
            });
        }
        let blocks = tokens.div_ceil(self.cfg.block_size as u64);
        if blocks > self.cfg.kv_blocks as u64 {
            return Err(SubmitError::ExceedsKvCapacity {
                blocks,
                kv_blocks: self.cfg.kv_blocks,
            });
        }
        let now_us = now_us.max(self.now_us);
        self.now_us = now_us;
        let target = self.cfg.output_len.target(
            self.cfg.seed,
            req.id,
            req.max_tokens,
            req.ignore_eos,
            req.min_tokens,
        );
        let prompt_len = req.prompt.len() as u32;
        let mut tokens = req.prompt;
        tokens.reserve(target as usize);
        let seq = Seq {
            id: req.id,
            tokens,
            prompt_len,
            hashes,
            registered: 0,
            blocks: Vec::new(),
            computed: 0,
            generated: 0,
            target,
            max_tokens: req.max_tokens,
            cached_tokens: None,
            arrival_us: now_us,
            last_token_us: now_us,
            remote_ready_us: self.pending_remote,
            adapter: self.pending_adapter,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(seq);
                s
            }
            None => {
                self.slots.push(Some(seq));
                (self.slots.len() - 1) as u32
            }
        };
        self.by_id.insert(req.id, slot);
        self.waiting.push_back(slot);
        self.stats.prompt_tokens += prompt_len as u64;
        if self.step.is_none() {
            self.plan(now_us);
        }
        self.log.publish();
        Ok(())
    }

    /// Queues a decode-role request whose prompt KV was computed by a prefill engine (vLLM's
    /// `kv_transfer_params` with `do_remote_prefill`, docs/design/pd.md): the part of the prompt
    /// not in this engine's own prefix cache now is read over `link` before the request can be
    /// scheduled (the read runs beside the engine's steps, as NIXL's does, so it costs no step
    /// time); once admitted, every prompt token but the last counts as computed and the last is
    /// computed to sample the first token, as vLLM does after a remote load. Returns the tokens
    /// read over the link. Simplification: the decode engine's blocks are allocated at admission,
    /// after the read, not before it as vLLM does.
    pub fn submit_remote(
        &mut self,
        now_us: u64,
        req: EngineRequest,
        link: &crate::kv_link::KvLink,
    ) -> Result<u64, SubmitError> {
        let now_us = now_us.max(self.now_us);
        let hashes = self.prompt_hashes(&req.prompt);
        let local = self.cached_prefix_tokens(&hashes, req.prompt.len()) as u64;
        let transferred = (req.prompt.len() as u64).saturating_sub(local);
        // Mark before `submit` plans, so a free engine does not start computing the prompt.
        let ready = now_us.saturating_add(link.transfer_us(transferred));
        self.pending_remote = Some(ready);
        let r = self.submit_hashed(now_us, req, hashes);
        self.pending_remote = None;
        r?;
        self.stats.remote_prefill_requests += 1;
        self.stats.remote_prefill_tokens += transferred;
        Ok(transferred)
    }

    /// [`Engine::submit`] for a request whose OpenAI `model` names a LoRA adapter: it runs with that
    /// adapter, loaded when it is admitted if not resident ([`crate::lora`]), and its prompt's blocks
    /// are hashed in the adapter's namespace ([`kvsteer_core::block::namespace_seed`]). With LoRA off
    /// (no slots) or no adapter, exactly [`Engine::submit`].
    pub fn submit_with_adapter(
        &mut self,
        now_us: u64,
        req: EngineRequest,
        adapter: Option<&str>,
    ) -> Result<(), SubmitError> {
        self.pending_adapter = adapter.and_then(|a| self.lora.intern(a));
        // vLLM hashes an adapter's blocks with the adapter: its requests share cache with each
        // other, never with the base model's or another adapter's.
        let hashes = match self.pending_adapter {
            Some(_) => self
                .hasher
                .namespaced(adapter, None)
                .sequence_hashes(&req.prompt)
                .into_iter()
                .map(|h| h.0)
                .collect(),
            None => self.prompt_hashes(&req.prompt),
        };
        let r = self.submit_hashed(now_us, req, hashes);
        self.pending_adapter = None;
        r
    }
}

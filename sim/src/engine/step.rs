//! One engine step: what the scheduler gives each sequence within the token budget (admission,
//! chunked prefill, preemption when blocks run out), what the step costs in the profile's time, and
//! the tokens it samples when it ends. The half of [`Engine`] that moves time; the rest takes
//! requests and answers questions about its state.

use super::{Engine, EngineEvent, FinishReason, Seq, Step};
use crate::output::output_token;
use crate::profile::{StepWork, attn_pairs};
use kvsteer_core::block::SeqHash;

impl Engine {
    /// Schedules the next step starting at `start_us` (or goes idle when there is no work).
    pub(super) fn plan(&mut self, start_us: u64) {
        let mut work = std::mem::take(&mut self.scratch);
        work.clear();
        // A random stall (`crate::stall`) holds up the engine where it would schedule a step: an
        // empty step runs to the stall's end, and the scheduler looks again then, with whatever
        // arrived meanwhile. Checked here, at the one place steps start, so no step runs inside a
        // stall; an idle engine's stalls hold up nothing.
        if !(self.running.is_empty() && self.waiting.is_empty())
            && let Some((end, first)) = self.stalls.hold(start_us)
        {
            if first {
                self.stats.stalls += 1;
                self.stats.stalled_us += end - start_us;
            }
            self.step = Some(Step { end_us: end, work });
            return;
        }
        let mut budget = self.cfg.max_batch_tokens as usize;
        let mut w = StepWork::default();

        // Running sequences first, in admission order.
        let preempted = self.schedule_running(&mut work, &mut budget, &mut w);
        // Then waiting requests, FCFS, unless this step had to preempt.
        let load_us = if preempted {
            0
        } else {
            self.admit_waiting(start_us, &mut work, &mut budget, &mut w)
        };

        if work.is_empty() {
            self.scratch = work;
            self.step = None;
            return;
        }
        let dur = (self.cfg.profile.step_us(&w) * self.slowdown)
            .round()
            .max(1.0) as u64
            + load_us;
        self.step = Some(Step {
            end_us: start_us.saturating_add(dur),
            work,
        });
    }

    /// Gives the running sequences, in admission order, their next tokens within `budget`,
    /// preempting the most recently admitted when blocks run out; true when it had to preempt.
    fn schedule_running(
        &mut self,
        work: &mut Vec<(u32, u64, u32)>,
        budget: &mut usize,
        w: &mut StepWork,
    ) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let slot = self.running[i];
            let (computed, total, held) = {
                let s = self.seq(slot);
                (s.computed, s.tokens.len(), s.blocks.len())
            };
            let n = (total - computed).min(*budget);
            let need = self.blocks_for(computed + n).saturating_sub(held);
            let mut scheduled = true;
            loop {
                let mut blocks = std::mem::take(&mut self.seq_mut(slot).blocks);
                let ok = self.kv.allocate(need, &mut blocks, &mut self.log);
                self.seq_mut(slot).blocks = blocks;
                if ok {
                    break;
                }
                preempted = true;
                match self.preempt_last() {
                    Some(v) if v == slot => {
                        scheduled = false;
                        break;
                    }
                    Some(_) => {}
                    None => {
                        scheduled = false;
                        break;
                    }
                }
            }
            if !scheduled {
                break;
            }
            let s = self.seq(slot);
            self.account(w, s, n);
            work.push((slot, s.id, n as u32));
            *budget -= n;
            i += 1;
        }
        preempted
    }

    /// Admits waiting requests, FCFS, while the budget, the running cap and the free blocks allow
    /// (after a prefix-cache lookup); returns the time loading their adapters adds to the step.
    fn admit_waiting(
        &mut self,
        start_us: u64,
        work: &mut Vec<(u32, u64, u32)>,
        budget: &mut usize,
        w: &mut StepWork,
    ) -> u64 {
        // The batch's distinct adapters, and the time loading new ones adds to the step.
        let mut adapters: Vec<u32> = Vec::new();
        if self.lora.enabled() {
            adapters.extend(self.running.iter().filter_map(|&s| self.seq(s).adapter));
            adapters.sort_unstable();
            adapters.dedup();
        }
        let mut load_us = 0u64;
        while *budget > 0
            && self.running.len() < self.cfg.max_running as usize
            && let Some(pos) = self.waiting.iter().position(|&s| {
                // A request whose KV read has not ended is passed over, as vLLM's scheduler skips
                // those waiting for remote KV, and so is one whose adapter would be one more than
                // the slots; the rest keep FCFS order.
                self.slots[s as usize].as_ref().is_none_or(|q| {
                    q.remote_ready_us.is_none_or(|t| t <= start_us)
                        && self.lora.admissible(q.adapter, &adapters)
                })
            })
        {
            let slot = self.waiting[pos];
            let bs = self.cfg.block_size;
            let s = self.seq(slot);
            let total = s.tokens.len();
            let remote = s.remote_ready_us.is_some();
            // Never hit the whole sequence: the last token is always computed to sample from it.
            let max_hit = (total - 1) / bs;
            let hit = self.kv.lookup(&s.hashes, max_hit);
            let hit_blocks = hit.gpu_blocks + hit.host_blocks;
            let cached = hit_blocks * bs;
            // After a remote read every prompt token but the last is there.
            let start = if remote { total - 1 } else { cached };
            let n = (total - start).min(*budget);
            let need = self.blocks_for(start + n) - hit.gpu_blocks;
            let taken_free = self.kv.free_among_hits(&s.hashes, hit.gpu_blocks);
            if self.kv.free_blocks() < need + taken_free {
                break;
            }
            self.waiting.remove(pos);
            let mut blocks = std::mem::take(&mut self.seq_mut(slot).blocks);
            let hashes = std::mem::take(&mut self.seq_mut(slot).hashes);
            self.kv.take_hits(&hashes, hit, &mut blocks);
            let ok = self.kv.allocate(need, &mut blocks, &mut self.log);
            debug_assert!(ok, "free blocks were checked");
            let s = self.seq_mut(slot);
            s.hashes = hashes;
            s.blocks = blocks;
            s.computed = start;
            s.registered = hit.gpu_blocks;
            s.remote_ready_us = None;
            if s.cached_tokens.is_none() {
                s.cached_tokens = Some(cached as u32);
            }
            if let Some(a) = s.adapter {
                load_us += self.lora.acquire(a, &adapters);
                if !adapters.contains(&a) {
                    adapters.push(a);
                }
            }
            w.host_load_tokens += (hit.host_blocks * bs) as u64;
            self.stats.prefix_cache_queries += total as u64;
            self.stats.prefix_cache_hits += cached as u64;
            self.running.push(slot);
            let s = self.seq(slot);
            self.account(w, s, n);
            work.push((slot, s.id, n as u32));
            *budget -= n;
        }
        load_us
    }

    pub(super) fn account(&self, w: &mut StepWork, s: &Seq, n: usize) {
        w.seqs += 1;
        if s.decoding() {
            w.decode_seqs += 1;
            w.decode_kv_tokens += s.computed as u64;
        } else {
            w.prefill_tokens += n as u64;
            w.prefill_attn_pairs += attn_pairs(s.computed as u64, n as u64);
        }
    }

    pub(super) fn complete_step(&mut self, out: &mut Vec<EngineEvent>) {
        let Some(step) = self.step.take() else {
            return;
        };
        let t = step.end_us;
        // A stall's empty step is no step.
        self.stats.steps += u64::from(!step.work.is_empty());
        let bs = self.cfg.block_size;
        let seed = self.cfg.seed;
        let mut finished = false;
        for &(slot, id, n) in &step.work {
            let Some(seq) = self.slots[slot as usize].as_mut() else {
                continue;
            };
            if seq.id != id {
                continue;
            }
            seq.computed += n as usize;
            let full = (seq.computed / bs).min(seq.hashes.len());
            while seq.registered < full {
                let i = seq.registered;
                self.kv
                    .register(seq.blocks[i], seq.hashes[i], &mut self.log);
                seq.registered += 1;
            }
            if seq.computed < seq.tokens.len() {
                continue;
            }
            let token = output_token(seed, seq.id, seq.generated);
            seq.tokens.push(token);
            seq.generated += 1;
            if seq.tokens.len().is_multiple_of(bs) {
                let parent = seq.hashes.last().map(|&h| SeqHash(h));
                let mut h = Vec::with_capacity(1);
                self.hasher
                    .extend_sequence(parent, &seq.tokens[seq.tokens.len() - bs..], &mut h);
                seq.hashes.push(h[0].0);
            }
            self.stats.generation_tokens += 1;
            if seq.generated == 1 {
                self.stats.ttft.observe((t - seq.arrival_us) as f64 / 1e6);
                out.push(EngineEvent::FirstToken {
                    id,
                    t_us: t,
                    cached_tokens: seq.cached_tokens.unwrap_or(0),
                    token,
                });
            } else {
                self.stats.itl.observe((t - seq.last_token_us) as f64 / 1e6);
                out.push(EngineEvent::Token { id, t_us: t, token });
            }
            seq.last_token_us = t;
            if seq.generated >= seq.target {
                let reason = if seq.generated >= seq.max_tokens {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                };
                self.finish(slot, t, reason, Some(out));
                finished = true;
            }
        }
        if finished {
            let slots = &self.slots;
            self.running.retain(|&s| slots[s as usize].is_some());
        }
        self.scratch = step.work;
    }
}

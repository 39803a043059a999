//! Prefill/decode disaggregation in the simulator (docs/design/pd.md): the link a decode engine
//! reads a prefill engine's KV over. The engine side is [`crate::Engine::submit_remote`]; a
//! prefill-role engine needs nothing new (it serves the prefill leg as a 1-token request).

/// The KV transfer link between a prefill and a decode engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvLink {
    /// KV bytes per token of the model (all layers, K and V).
    pub kv_bytes_per_token: f64,
    /// Effective link bandwidth, bytes per second.
    pub bytes_per_s: f64,
    /// Fixed cost per transfer (handshake, notification), microseconds.
    pub setup_us: f64,
}

impl Default for KvLink {
    /// Llama-3.1-8B BF16 (128 KiB a token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes,
    /// the model's published config, as `kv_read_us_per_token` in docs/design/simulator.md) over
    /// one 400 Gb/s RDMA NIC at 80% efficiency: 40 GB/s (an **assumption**: a common NIXL/UCX
    /// setup, not a measurement made here); 0.5 ms per transfer for the NIXL notification and
    /// scheduling (an **estimate**).
    fn default() -> Self {
        KvLink {
            kv_bytes_per_token: 131_072.0,
            bytes_per_s: 40e9,
            setup_us: 500.0,
        }
    }
}

impl KvLink {
    /// Microseconds a transfer of `tokens` prompt tokens takes (0 for none: a decode engine holding
    /// the whole prefix reads nothing). A zero or NaN bandwidth is a very long time, never a panic.
    pub fn transfer_us(&self, tokens: u64) -> u64 {
        if tokens == 0 {
            return 0;
        }
        let us = self.setup_us + tokens as f64 * self.kv_bytes_per_token / self.bytes_per_s * 1e6;
        if us.is_finite() {
            us.round().max(0.0) as u64
        } else {
            u64::MAX / 4
        }
    }

    /// Microseconds per token, without the setup.
    pub fn us_per_token(&self) -> f64 {
        self.kv_bytes_per_token / self.bytes_per_s * 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Engine, EngineConfig, EngineEvent, EngineRequest};

    fn req(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
        EngineRequest {
            id,
            prompt,
            max_tokens,
            ignore_eos: true,
            min_tokens: 0,
        }
    }

    fn run(e: &mut Engine) -> Vec<EngineEvent> {
        let mut out = Vec::new();
        while let Some(t) = e.next_event_time() {
            e.advance(t, &mut out);
        }
        out
    }

    fn first_token_us(ev: &[EngineEvent], id: u64) -> u64 {
        ev.iter()
            .find_map(|e| match e {
                EngineEvent::FirstToken { id: i, t_us, .. } if *i == id => Some(*t_us),
                _ => None,
            })
            .expect("first token")
    }

    #[test]
    fn default_link_costs_about_3_us_a_token() {
        let l = KvLink::default();
        assert!((l.us_per_token() - 3.2768).abs() < 1e-6);
        assert_eq!(l.transfer_us(0), 0);
        assert_eq!(l.transfer_us(10_000), 500 + 32_768);
        let dead = KvLink {
            bytes_per_s: 0.0,
            ..l
        };
        assert!(dead.transfer_us(1) > 1_000_000_000_000);
    }

    #[test]
    fn a_remote_prefill_pays_the_transfer_not_the_prefill() {
        let prompt: Vec<u32> = (0..32_768).collect();
        let mut local = Engine::new(EngineConfig::default());
        local.submit(0, req(1, prompt.clone(), 4)).unwrap();
        let local_ttft = first_token_us(&run(&mut local), 1);

        let link = KvLink::default();
        let mut dec = Engine::new(EngineConfig::default());
        let moved = dec
            .submit_remote(0, req(1, prompt.clone(), 4), &link)
            .unwrap();
        assert_eq!(moved, 32_768);
        let ev = run(&mut dec);
        let remote_ttft = first_token_us(&ev, 1);
        let transfer = link.transfer_us(32_768);
        // Not before the read ends, then one short step (one token over a 32K context).
        assert!(remote_ttft > transfer, "{remote_ttft} vs {transfer}");
        assert!(
            remote_ttft < transfer + 20_000,
            "{remote_ttft} vs {transfer}"
        );
        assert!(
            remote_ttft * 5 < local_ttft,
            "{remote_ttft} vs {local_ttft}"
        );
        // It decodes all its tokens and the read blocks are now cached here.
        assert!(ev.iter().any(|e| matches!(
            e,
            EngineEvent::Finished {
                id: 1,
                completion_tokens: 4,
                ..
            }
        )));
        let hashes = dec.prompt_hashes(&prompt);
        assert_eq!(dec.cached_prefix_tokens(&hashes, prompt.len()), 32_752);
        assert_eq!(dec.stats().remote_prefill_requests, 1);
    }

    #[test]
    fn only_the_uncached_part_is_read_and_others_are_not_held_up() {
        let link = KvLink::default();
        let mut dec = Engine::new(EngineConfig::default());
        let prompt: Vec<u32> = (0..4096).collect();
        dec.submit(0, req(1, prompt.clone(), 1)).unwrap();
        run(&mut dec);
        let mut longer = prompt.clone();
        longer.extend(5000..5100);
        let t0 = dec.now_us();
        let moved = dec.submit_remote(t0, req(2, longer, 2), &link).unwrap();
        // 4,096 cached locally (the hit stops one token short of a whole prompt: 4,096 of 4,196).
        assert_eq!(moved, 100);
        // A local request queued behind a remote one still waiting for its KV is not held up.
        let big: Vec<u32> = (100_000..160_000).collect();
        let mut dec2 = Engine::new(EngineConfig::default());
        dec2.submit_remote(0, req(7, big, 2), &link).unwrap();
        dec2.submit(0, req(8, (0..64).collect(), 1)).unwrap();
        let ev = run(&mut dec2);
        assert!(first_token_us(&ev, 8) < first_token_us(&ev, 7));
        assert!(first_token_us(&ev, 7) >= link.transfer_us(60_000));
    }

    #[test]
    fn a_waiting_remote_request_is_one_token_of_prefill_load() {
        let mut dec = Engine::new(EngineConfig::default());
        dec.submit_remote(0, req(1, (0..8192).collect(), 2), &KvLink::default())
            .unwrap();
        assert_eq!(dec.load().prefill_tokens, 1);
        assert_eq!(dec.load().waiting, 1);
    }
}

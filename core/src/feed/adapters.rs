//! The feed's adapter section: which LoRA adapters a replica has loaded and how many adapter slots it
//! has (docs/reference/feed.md, "Adapters"). A replica appends it after the events, with flag bit 2
//! (`ADAPTERS`) set, only when the router's query asks for it (`adapters=1`): a router built before
//! the section refuses unknown flags, so a replica never sends it unasked. A batch without it means
//! "not known": the router then prices no adapter load on that replica.
//!
//! ```text
//! slots u32 | running u16 | waiting u16 | (running + waiting) x (len u8 | len bytes of UTF-8 name)
//! ```
//!
//! Everything in it is bounded before it is kept: at most [`MAX_ADAPTER_NAMES`] names per list and
//! names of 1 to 255 bytes (the length is a byte), so a hostile replica can make a router hold at most
//! 2 x 64 x 255 bytes for it, and the router keeps only an 8-byte hash of each name.

use super::FeedError;

/// Flag bit 2: an adapter section follows the events.
pub const FLAG_ADAPTERS: u8 = 4;
/// Most names in each of the running and waiting lists. vLLM's running adapters are at most its
/// `--max-loras` (8 in most deployments); the waiting list can name any adapter with a request
/// queued, so a producer with more keeps the first 64 ([`AdapterReport::bounded`]).
pub const MAX_ADAPTER_NAMES: usize = 64;
/// The query parameter a router sends to ask for the section.
pub const ADAPTERS_QUERY: &str = "adapters=1";

/// What a replica says about its LoRA adapters, in the terms of vLLM's `vllm:lora_requests_info`
/// metric: the adapters of its running requests, of its waiting ones, and its adapter slots
/// (`--max-loras`; 0 when not known).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdapterReport {
    pub slots: u32,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

impl AdapterReport {
    /// The report cut to what the wire carries: at most [`MAX_ADAPTER_NAMES`] names per list,
    /// names that are empty or over 255 bytes dropped (no adapter name is either; an engine that
    /// reports one anyway must not make the whole feed refused).
    pub fn bounded(mut self) -> AdapterReport {
        for list in [&mut self.running, &mut self.waiting] {
            list.retain(|n| !n.is_empty() && n.len() <= u8::MAX as usize);
            list.truncate(MAX_ADAPTER_NAMES);
        }
        self
    }

    /// Whether `name` is running or waiting there: loaded, or being loaded.
    pub fn holds(&self, name: &str) -> bool {
        self.running.iter().chain(&self.waiting).any(|n| n == name)
    }

    /// Appends the section to an encoded batch and sets its flag. Lists longer than the wire allows
    /// are cut as [`AdapterReport::bounded`] cuts them.
    pub fn append_to(&self, payload: &mut Vec<u8>) {
        if payload.len() < super::HEADER_LEN {
            return;
        }
        let r = self.clone().bounded();
        payload[5] |= FLAG_ADAPTERS;
        payload.extend_from_slice(&r.slots.to_le_bytes());
        payload.extend_from_slice(&(r.running.len() as u16).to_le_bytes());
        payload.extend_from_slice(&(r.waiting.len() as u16).to_le_bytes());
        for n in r.running.iter().chain(&r.waiting) {
            payload.push(n.len() as u8);
            payload.extend_from_slice(n.as_bytes());
        }
    }

    /// Reads a section that is the whole of `buf`, refusing anything malformed: counts over the
    /// bound, an empty name, a name that is not UTF-8, a name running past the end, bytes after it.
    pub fn decode(buf: &[u8]) -> Result<AdapterReport, FeedError> {
        let bad = FeedError::BadAdapters;
        let head = buf.get(..8).ok_or(bad("section shorter than 8 bytes"))?;
        let slots = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let running = u16::from_le_bytes([head[4], head[5]]) as usize;
        let waiting = u16::from_le_bytes([head[6], head[7]]) as usize;
        if running > MAX_ADAPTER_NAMES || waiting > MAX_ADAPTER_NAMES {
            return Err(bad("more than 64 names in a list"));
        }
        let mut pos = 8;
        let mut names = Vec::with_capacity(running + waiting);
        for _ in 0..running + waiting {
            let len = *buf.get(pos).ok_or(bad("a name runs past the end"))? as usize;
            if len == 0 {
                return Err(bad("an empty name"));
            }
            let bytes = buf
                .get(pos + 1..pos + 1 + len)
                .ok_or(bad("a name runs past the end"))?;
            let name = core::str::from_utf8(bytes).map_err(|_| bad("a name is not UTF-8"))?;
            names.push(name.to_string());
            pos += 1 + len;
        }
        if pos != buf.len() {
            return Err(FeedError::TrailingBytes {
                extra: buf.len() - pos,
            });
        }
        let waiting = names.split_off(running);
        Ok(AdapterReport {
            slots,
            running: names,
            waiting,
        })
    }
}

/// Whether a feed query string asks for the adapter section (`adapters=1`).
pub fn query_adapters(query: &str) -> bool {
    query.split('&').any(|p| p == ADAPTERS_QUERY)
}

#[cfg(test)]
mod tests {
    use super::super::{FeedBatch, FeedFrame};
    use super::*;

    fn report() -> AdapterReport {
        AdapterReport {
            slots: 4,
            running: vec!["sql-lora".into(), "chat-ü".into()],
            waiting: vec!["code-lora".into()],
        }
    }

    fn plain() -> Vec<u8> {
        FeedBatch::snapshot(7, vec![1, 2, 3]).encode()
    }

    #[test]
    fn a_section_round_trips_beside_the_events() {
        let mut bytes = plain();
        report().append_to(&mut bytes);
        let frame = FeedFrame::parse(bytes.clone()).unwrap();
        assert_eq!(frame.adapters(), Some(&report()));
        assert!(frame.adapters().unwrap().holds("code-lora"));
        assert!(!frame.adapters().unwrap().holds("other"));
        // The events read as without it.
        assert_eq!(
            FeedBatch::decode(&bytes).unwrap(),
            FeedBatch::snapshot(7, vec![1, 2, 3])
        );
    }

    #[test]
    fn a_batch_without_the_section_has_no_report() {
        let frame = FeedFrame::parse(plain()).unwrap();
        assert_eq!(frame.adapters(), None);
        assert!(query_adapters("epoch=0&adapters=1"));
        assert!(!query_adapters("epoch=0&adapters=0"));
        assert!(!query_adapters(""));
    }

    /// Every cut of a payload with a section is refused with an error, never a panic; so are
    /// oversized counts, empty and non-UTF-8 names, and bytes past the section.
    #[test]
    fn hostile_sections_are_refused() {
        let mut bytes = plain();
        report().append_to(&mut bytes);
        for cut in plain().len()..bytes.len() {
            assert!(FeedFrame::parse(bytes[..cut].to_vec()).is_err(), "{cut}");
        }
        let section_at = plain().len();
        let with = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut b = bytes.clone();
            edit(&mut b);
            FeedFrame::parse(b).map(|_| ()).unwrap_err()
        };
        let big = (MAX_ADAPTER_NAMES as u16 + 1).to_le_bytes();
        assert!(matches!(
            with(&|b| b[section_at + 4..section_at + 6].copy_from_slice(&big)),
            FeedError::BadAdapters(_)
        ));
        assert!(matches!(
            with(&|b| b[section_at + 8] = 0),
            FeedError::BadAdapters(_)
        ));
        assert!(matches!(
            with(&|b| b[section_at + 9] = 0xFF),
            FeedError::BadAdapters(_)
        ));
        assert!(matches!(
            with(&|b| b.push(0)),
            FeedError::BadAdapters(_) | FeedError::TrailingBytes { .. }
        ));
        // An unasked-for flag without a section is refused too.
        let mut flagged = plain();
        flagged[5] |= FLAG_ADAPTERS;
        assert!(FeedFrame::parse(flagged).is_err());
    }

    #[test]
    fn a_producer_cuts_what_the_wire_cannot_carry() {
        let long = AdapterReport {
            slots: 1,
            running: (0..200).map(|i| format!("a{i}")).collect(),
            waiting: vec![String::new(), "x".repeat(300), "ok".into()],
        };
        let mut bytes = plain();
        long.append_to(&mut bytes);
        let got = FeedFrame::parse(bytes)
            .unwrap()
            .adapters()
            .cloned()
            .unwrap();
        assert_eq!(got.running.len(), MAX_ADAPTER_NAMES);
        assert_eq!(got.waiting, vec!["ok".to_string()]);
    }
}

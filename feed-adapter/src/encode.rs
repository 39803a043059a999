//! Encoding engine payloads the way vLLM 0.32 publishes them: an array batch `[ts, events, dp_rank]`
//! whose events are msgpack maps tagged by `"type"`, fields in vLLM's declaration order. Used by the
//! tests, the integration test's in-process publisher and the bench; the adapter itself only decodes.

use rmp::encode as e;

/// An event to encode.
#[derive(Clone, Debug)]
pub enum Event<'a> {
    Stored {
        hashes: &'a [u64],
        parent: Option<u64>,
        token_ids: &'a [u32],
        block_size: u32,
        lora_name: Option<&'a str>,
        medium: &'a str,
    },
    Removed {
        hashes: &'a [u64],
        medium: &'a str,
    },
    Cleared,
}

fn s(out: &mut Vec<u8>, v: &str) {
    e::write_str(out, v).expect("writing to a Vec cannot fail");
}

fn u(out: &mut Vec<u8>, v: u64) {
    e::write_uint(out, v).expect("writing to a Vec cannot fail");
}

fn nil(out: &mut Vec<u8>) {
    e::write_nil(out).expect("writing to a Vec cannot fail");
}

/// Appends one event.
pub fn event(out: &mut Vec<u8>, ev: &Event<'_>) {
    match ev {
        Event::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            medium,
        } => {
            e::write_map_len(out, 11).expect("vec");
            s(out, "type");
            s(out, "BlockStored");
            s(out, "block_hashes");
            e::write_array_len(out, hashes.len() as u32).expect("vec");
            for &h in *hashes {
                u(out, h);
            }
            s(out, "parent_block_hash");
            match parent {
                Some(p) => u(out, *p),
                None => nil(out),
            }
            s(out, "token_ids");
            e::write_array_len(out, token_ids.len() as u32).expect("vec");
            for &t in *token_ids {
                u(out, t as u64);
            }
            s(out, "block_size");
            u(out, *block_size as u64);
            s(out, "lora_id");
            nil(out);
            s(out, "medium");
            s(out, medium);
            s(out, "lora_name");
            match lora_name {
                Some(l) => s(out, l),
                None => nil(out),
            }
            s(out, "extra_keys");
            e::write_array_len(out, hashes.len() as u32).expect("vec");
            for _ in 0..hashes.len() {
                match lora_name {
                    Some(l) => {
                        e::write_array_len(out, 1).expect("vec");
                        s(out, l);
                    }
                    None => nil(out),
                }
            }
            s(out, "group_idx");
            u(out, 0);
            s(out, "kv_cache_spec_kind");
            s(out, "full_attention");
        }
        Event::Removed { hashes, medium } => {
            e::write_map_len(out, 4).expect("vec");
            s(out, "type");
            s(out, "BlockRemoved");
            s(out, "block_hashes");
            e::write_array_len(out, hashes.len() as u32).expect("vec");
            for &h in *hashes {
                u(out, h);
            }
            s(out, "medium");
            s(out, medium);
            s(out, "group_idx");
            u(out, 0);
        }
        Event::Cleared => {
            e::write_map_len(out, 1).expect("vec");
            s(out, "type");
            s(out, "AllBlocksCleared");
        }
    }
}

/// One payload: `[ts, [events...], dp_rank]`.
pub fn batch(ts: f64, events: &[Event<'_>], dp_rank: u32) -> Vec<u8> {
    let mut out = Vec::new();
    e::write_array_len(&mut out, 3).expect("vec");
    e::write_f64(&mut out, ts).expect("vec");
    e::write_array_len(&mut out, events.len() as u32).expect("vec");
    for ev in events {
        event(&mut out, ev);
    }
    u(&mut out, dp_rank as u64);
    out
}

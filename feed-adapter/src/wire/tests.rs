use super::*;
use rmpv::Value;

fn hex(parts: &[&str]) -> Vec<u8> {
    let s: String = parts.concat().split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// vLLM 0.32's encoding of one batch, written out byte by byte (and checked against msgspec 0.23's
/// encoder for the same struct declarations): a positional batch whose events are tagged maps.
fn vllm_032_fixture() -> Vec<u8> {
    hex(&[
        "93",                                      // array(3): [ts, events, data_parallel_rank]
        "cb 3ff8000000000000",                     // f64 1.5
        "93",                                      // array(3): events
        "8b",                                      // map(11): BlockStored, every field present
        "a4 74797065",                             // "type"
        "ab 426c6f636b53746f726564",               // "BlockStored"
        "ac 626c6f636b5f686173686573",             // "block_hashes"
        "91 cf deadbeefcafef00d",                  // [u64 0xdeadbeefcafef00d]
        "b1 706172656e745f626c6f636b5f68617368",   // "parent_block_hash"
        "c0",                                      // nil
        "a9 746f6b656e5f696473",                   // "token_ids"
        "94 01 02 03 04",                          // [1, 2, 3, 4]
        "aa 626c6f636b5f73697a65",                 // "block_size"
        "04",                                      // 4
        "a7 6c6f72615f6964 c0",                    // "lora_id": nil
        "a6 6d656469756d a3 475055",               // "medium": "GPU"
        "a9 6c6f72615f6e616d65 c0",                // "lora_name": nil
        "aa 65787472615f6b657973 91 c0",           // "extra_keys": [nil]
        "a9 67726f75705f696478 00",                // "group_idx": 0
        "b2 6b765f63616368655f737065635f6b696e64", // "kv_cache_spec_kind"
        "ae 66756c6c5f617474656e74696f6e",         // "full_attention"
        "84",                                      // map(4): BlockRemoved
        "a4 74797065 ac 426c6f636b52656d6f766564", // "type": "BlockRemoved"
        "ac 626c6f636b5f686173686573 91 07",       // "block_hashes": [7]
        "a6 6d656469756d a3 475055",               // "medium": "GPU"
        "a9 67726f75705f696478 00",                // "group_idx": 0
        "81 a4 74797065 b0 416c6c426c6f636b73436c6561726564", // {"type": "AllBlocksCleared"}
        "00",                                      // data_parallel_rank 0
    ])
}

fn lim() -> Limits {
    Limits::default()
}

#[test]
fn vllm_032_hand_written_fixture() {
    let b = decode_batch(&vllm_032_fixture(), &lim()).unwrap();
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(
        b.events,
        vec![
            EngineEvent::Stored(Stored {
                hashes: vec![0xdeadbeefcafef00d],
                parent: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                lora_id: None,
                lora_name: None,
                medium: Some(Medium::Gpu),
                extra_keys: Some(vec![ExtraKeys::None]),
                group_idx: Some(0),
                cache_salt: None,
            }),
            EngineEvent::Removed {
                hashes: vec![7],
                medium: Some(Medium::Gpu),
                group_idx: Some(0),
            },
            EngineEvent::Cleared,
        ]
    );
}

#[test]
fn encoder_matches_the_fixture_shape() {
    use crate::encode::{Event, batch};
    let bytes = batch(
        1.5,
        &[
            Event::Stored {
                hashes: &[0xdeadbeefcafef00d],
                parent: None,
                token_ids: &[1, 2, 3, 4],
                block_size: 4,
                lora_name: None,
                medium: "GPU",
            },
            Event::Removed {
                hashes: &[7],
                medium: "GPU",
            },
            Event::Cleared,
        ],
        0,
    );
    assert_eq!(bytes, vllm_032_fixture());
}

/// SGLang's encoding (positional events, a 3-field batch with a nil rank, signed 64-bit hashes from
/// `hash_str_to_int64`, one block per event, `medium` last), recorded from msgspec 0.23 with SGLang's
/// struct declarations.
#[test]
fn sglang_recorded_format() {
    let bytes = hex(&[
        "93 cb 4000000000000000 93",
        "97 ab 426c6f636b53746f726564 91 fb c0 94 01020304 04 c0 a3 475055",
        "97 ab 426c6f636b53746f726564 91 fa fb 94 05060708 04 c0 a3 475055",
        "93 ac 426c6f636b52656d6f766564 91 fa a3 475055",
        "c0",
    ]);
    let b = decode_batch(&bytes, &lim()).unwrap();
    assert_eq!(b.dp_rank, None);
    let EngineEvent::Stored(s0) = &b.events[0] else {
        panic!("{:?}", b.events[0])
    };
    assert_eq!(s0.hashes, vec![(-5i64) as u64]);
    assert_eq!(s0.parent, None);
    assert_eq!(s0.medium, Some(Medium::Gpu));
    let EngineEvent::Stored(s1) = &b.events[1] else {
        panic!()
    };
    assert_eq!(s1.parent, Some((-5i64) as u64));
    assert_eq!(s1.token_ids, vec![5, 6, 7, 8]);
    assert_eq!(
        b.events[2],
        EngineEvent::Removed {
            hashes: vec![(-6i64) as u64],
            medium: Some(Medium::Gpu),
            group_idx: None
        }
    );
    // Older SGLang: a 2-field batch, no medium.
    let old = enc(Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Array(vec![
            "BlockRemoved".into(),
            Value::Array(vec![Value::from(-9i64)]),
        ])]),
    ]));
    let b = decode_batch(&old, &lim()).unwrap();
    assert_eq!(
        b.events,
        vec![EngineEvent::Removed {
            hashes: vec![(-9i64) as u64],
            medium: None,
            group_idx: None
        }]
    );
    // SGLang's metadata map (cache salt) in the seventh positional field.
    let salted = enc(Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Array(vec![
            "BlockStored".into(),
            Value::Array(vec![Value::from(123u64)]),
            Value::Nil,
            Value::Array(vec![Value::from(1u64), Value::from(2u64)]),
            Value::from(2u64),
            Value::Nil,
            "GPU".into(),
            Value::Map(vec![("cache_salt".into(), "tenant-a".into())]),
        ])]),
        Value::Nil,
    ]));
    let b = decode_batch(&salted, &lim()).unwrap();
    let EngineEvent::Stored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(s.lora_name, None);
}

fn enc(v: Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).unwrap();
    out
}

fn stored_positional(lora: Option<&str>, extra: Value) -> Value {
    Value::Array(vec![
        "BlockStored".into(),
        Value::Array(vec![Value::from(11u64), Value::from(12u64)]),
        Value::from(10u64),
        Value::Array((0..4u64).map(Value::from).collect()),
        Value::from(2u64),
        Value::from(3u64),
        "CPU".into(),
        lora.map(Value::from).unwrap_or(Value::Nil),
        extra,
        Value::from(0u64),
        "full_attention".into(),
        Value::Nil,
        "a field from the future".into(),
    ])
}

#[test]
fn legacy_positional_vllm_with_lora_and_extra_keys() {
    let extra = Value::Array(vec![
        Value::Array(vec!["adapter".into()]),
        Value::Array(vec!["adapter".into(), Value::Binary(vec![1, 2])]),
    ]);
    let bytes = enc(Value::Array(vec![
        Value::F64(3.0),
        Value::Array(vec![stored_positional(Some("adapter"), extra)]),
        Value::from(1u64),
    ]));
    let b = decode_batch(&bytes, &lim()).unwrap();
    let EngineEvent::Stored(s) = &b.events[0] else {
        panic!("{:?}", b.events)
    };
    assert_eq!(s.hashes, vec![11, 12]);
    assert_eq!(s.parent, Some(10));
    assert_eq!(s.block_size, 2);
    assert_eq!(s.lora_id, Some(3));
    assert_eq!(s.medium, Some(Medium::Host));
    assert_eq!(s.lora_name.as_deref(), Some("adapter"));
    assert_eq!(
        s.extra_keys,
        Some(vec![
            ExtraKeys::Strings(vec!["adapter".into()]),
            ExtraKeys::Opaque
        ])
    );
    assert_eq!(b.dp_rank, Some(1));
}

#[test]
fn map_batch_bytes_hashes_and_unknown_fields() {
    let bytes = enc(Value::Map(vec![
        ("ts".into(), Value::from(5u64)),
        ("something_new".into(), Value::Array(vec![Value::Nil])),
        (
            "events".into(),
            Value::Array(vec![
                Value::Map(vec![
                    (
                        "block_hashes".into(),
                        Value::Array(vec![Value::Binary(vec![9; 32])]),
                    ),
                    ("medium".into(), Value::Nil),
                    ("type".into(), "BlockRemoved".into()),
                ]),
                Value::Map(vec![
                    ("type".into(), "BlockUpdated".into()),
                    ("x".into(), Value::from(1u64)),
                ]),
                Value::Array(vec!["AllBlocksCleared".into()]),
            ]),
        ),
        ("data_parallel_rank".into(), Value::from(2u64)),
    ]));
    let b = decode_batch(&bytes, &lim()).unwrap();
    assert_eq!(b.ts, 5.0);
    assert_eq!(b.dp_rank, Some(2));
    assert_eq!(
        b.events,
        vec![
            EngineEvent::Removed {
                hashes: vec![bytes_key(&[9; 32])],
                medium: None,
                group_idx: None
            },
            EngineEvent::Unknown("BlockUpdated".into()),
            EngineEvent::Cleared,
        ]
    );
}

#[test]
fn malformed_events_are_reported_and_the_batch_still_walks() {
    let bytes = enc(Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![
            // token ids out of u32 range
            Value::Map(vec![
                ("type".into(), "BlockStored".into()),
                ("block_hashes".into(), Value::Array(vec![Value::from(1u64)])),
                (
                    "token_ids".into(),
                    Value::Array(vec![Value::from(1u64 << 40)]),
                ),
                ("block_size".into(), Value::from(1u64)),
            ]),
            // block_hashes missing
            Value::Map(vec![("type".into(), "BlockRemoved".into())]),
            // hashes that are strings of floats
            Value::Array(vec![
                "BlockRemoved".into(),
                Value::Array(vec![Value::F64(1.0)]),
            ]),
            Value::from(42u64),
            Value::Array(vec![Value::from(1u64), Value::from(2u64)]),
            Value::Map(vec![("kind".into(), "BlockStored".into())]),
            Value::Array(vec![]),
            Value::Map(vec![("type".into(), "AllBlocksCleared".into())]),
        ]),
        Value::Nil,
    ]));
    let b = decode_batch(&bytes, &lim()).unwrap();
    let kinds: Vec<&str> = b
        .events
        .iter()
        .map(|e| match e {
            EngineEvent::Malformed { kind, .. } => *kind,
            EngineEvent::Unknown(_) => "unknown",
            EngineEvent::Cleared => "cleared",
            _ => "other",
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            "BlockStored",
            "BlockRemoved",
            "BlockRemoved",
            "event",
            "event",
            "event",
            "unknown",
            "cleared"
        ]
    );
}

#[test]
fn every_truncation_and_corruption_is_an_error_not_a_panic() {
    let bytes = vllm_032_fixture();
    for cut in 0..bytes.len() {
        assert!(decode_batch(&bytes[..cut], &lim()).is_err(), "cut at {cut}");
    }
    let mut extra = bytes.clone();
    extra.push(0);
    assert_eq!(
        decode_batch(&extra, &lim()),
        Err(DecodeError::Malformed("bytes after the event batch"))
    );
    // Flip every byte to every "interesting" marker: must never panic.
    for i in 0..bytes.len() {
        for m in [0xc1u8, 0xdd, 0xdf, 0xc6, 0xcf, 0xd3, 0x9f, 0x8f, 0x00, 0xff] {
            let mut b = bytes.clone();
            b[i] = m;
            let _ = decode_batch(&b, &lim());
        }
    }
    // A pseudo-random stream of bytes.
    let mut x = 0x1234_5678_9abc_def0u64;
    for _ in 0..2000 {
        let n = (x % 200) as usize;
        let mut b = Vec::with_capacity(n);
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.push(x as u8);
        }
        let _ = decode_batch(&b, &lim());
    }
}

#[test]
fn hostile_lengths_and_limits() {
    // array32 claiming 4 billion events in a 10-byte payload
    let b = hex(&["93 00 dd ffffffff 00"]);
    assert_eq!(decode_batch(&b, &lim()), Err(TRUNC));
    // limits on events, hashes, tokens, bytes and depth
    let small = Limits {
        max_payload_bytes: 1 << 20,
        max_events: 2,
        max_hashes: 1,
        max_tokens: 3,
        max_depth: 4,
    };
    let many = enc(Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec!["AllBlocksCleared".into()]); 3]),
    ]));
    assert_eq!(
        decode_batch(&many, &small),
        Err(DecodeError::TooLarge("events in one batch"))
    );
    let fixture = vllm_032_fixture();
    let tokens = Limits {
        max_tokens: 3,
        ..lim()
    };
    assert_eq!(
        decode_batch(&fixture, &tokens),
        Err(DecodeError::TooLarge("token_ids"))
    );
    let bytes = Limits {
        max_payload_bytes: 10,
        ..lim()
    };
    assert_eq!(
        decode_batch(&fixture, &bytes),
        Err(DecodeError::TooLarge("payload bytes"))
    );
    let mut deep = Value::Nil;
    for _ in 0..10 {
        deep = Value::Array(vec![deep]);
    }
    let nested = enc(Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec!["Future".into(), deep])]),
    ]));
    assert_eq!(
        decode_batch(&nested, &small),
        Err(DecodeError::TooLarge("nesting depth"))
    );
    assert!(decode_batch(&nested, &lim()).is_ok());
}

#[test]
fn batches_that_are_not_batches() {
    for v in [
        Value::from(1u64),
        Value::Array(vec![Value::F64(0.0)]),
        Value::Array(vec!["x".into(), Value::Array(vec![])]),
        Value::Array(vec![Value::F64(0.0), Value::from(3u64)]),
        Value::Map(vec![("ts".into(), Value::F64(0.0))]),
    ] {
        assert!(
            matches!(
                decode_batch(&enc(v.clone()), &lim()),
                Err(DecodeError::Malformed(_))
            ),
            "{v}"
        );
    }
}

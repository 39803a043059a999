use super::token_ids::{digit_bits, token_id_window};
use super::*;

#[test]
fn token_ids_read_every_length_and_refuse_what_is_not_a_u32() {
    for v in [
        0u64, 7, 10, 99, 1234567, 9999999, 12345678, 123456789, 4294967295,
    ] {
        for tail in [",", "]", " ", ",1,2,3,4,5,6,7,8"] {
            let s = format!("{v}{tail}");
            assert_eq!(
                token_id(s.as_bytes(), 0),
                Some((v as u32, v.to_string().len())),
                "{s}"
            );
        }
    }
    for s in [
        "4294967296",
        "01",
        "00,",
        "-1",
        "",
        "a",
        ",1",
        "99999999999",
    ] {
        assert_eq!(token_id(s.as_bytes(), 0), None, "{s}");
    }
}

/// The shapes clients send are read here, not left to serde (the property tests compare results,
/// which would also agree if this reader left every body to serde).
#[test]
fn common_bodies_are_read_in_one_pass() {
    let ids: Vec<String> = (0..100).map(|i| (i * 7919 % 150_000).to_string()).collect();
    for (endpoint, body) in [
            (Endpoint::Completions, format!(r#"{{"model":"m","prompt":[{}],"max_tokens":7,"stream":true}}"#, ids.join(","))),
            (Endpoint::Completions, format!(r#"{{"prompt": [{}], "cache_salt": "s", "logit_bias": {{"5": -1.5e2}}}}"#, ids.join(", "))),
            (Endpoint::Completions, format!(r#"{{"prompt":[[{}],[1,2]]}}"#, ids.join(","))),
            (Endpoint::Completions, r#"{"prompt":"a \"quoted\" text\n","stop":["\n"],"temperature":0.7}"#.to_string()),
            (Endpoint::Completions, r#"{"prompt":["one","two é"]}"#.to_string()),
            (Endpoint::ChatCompletions, r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],"max_completion_tokens":5,"stream_options":{"include_usage":true}}"#.to_string()),
        ] {
            let r = read(endpoint, body.as_bytes(), None, 16, None, None, None);
            assert!(matches!(r, Some(Ok(_))), "{body}: {r:?}");
        }
}

#[test]
fn digit_bits_mark_exactly_the_digits() {
    for seed in 0..2000u64 {
        let w = seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left((seed % 64) as u32)
            ^ 0x3535_3030_3939_2f3a;
        let want = (0..8).fold(0u64, |m, k| {
            m | ((((w >> (8 * k)) as u8).is_ascii_digit() as u64) << k)
        });
        assert_eq!(digit_bits(w), want, "{w:016x}");
    }
}

#[test]
fn the_window_reads_what_one_id_at_a_time_reads() {
    let bodies = [
        "1,22,333,4444,55555,666666,7777777,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25]",
        "1, 22, 333, 4444, 55555, 666666, 7777777, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]",
        "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,012,22,23,24,25,26,27,28,29,30,31,32,33,34]",
        "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,1.5,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38]",
        "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,123456789,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36]",
        "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17 ,18,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38]",
        "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,,18,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38]",
    ];
    for body in bodies {
        let b = body.as_bytes();
        let h = BlockHasher::new(1).unwrap();
        let mut fast = h.builder();
        let end = token_id_window(b, 0, &mut fast);
        let mut slow = h.builder();
        let mut i = 0;
        while i < end {
            let (v, next) = token_id(b, i).unwrap();
            slow.push(v);
            i = next + 1;
            if b[i] == b' ' {
                i += 1;
            }
        }
        assert_eq!(i, end, "{body}");
        assert!(end > 0 && end < 64, "{body}: {end}");
        assert_eq!(fast.finish(), slow.finish(), "{body}");
    }
}

/// Whole arrays of ids of every length up to ten digits (the window reads up to seven, and its
/// separator check reads the space of ", " from the id's own word, which a seven-digit id has
/// no room for), in mixed order, joined by "," or ", ": every id is read, hashed as
/// `sequence_hashes` hashes them.
#[test]
fn arrays_of_every_id_length_read_whole() {
    let mut seed = 3u64;
    for sep in [",", ", "] {
        for _ in 0..50 {
            let ids: Vec<u32> = (0..300)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let digits = (seed >> 60) % 10 + 1;
                    ((seed >> 20) % 10u64.pow(digits as u32)).min(u32::MAX as u64) as u32
                })
                .collect();
            let list: Vec<String> = ids.iter().map(u32::to_string).collect();
            let body = format!("[{}]", list.join(sep));
            let h = BlockHasher::new(16).unwrap();
            let mut sc = Scanner {
                b: body.as_bytes(),
                i: 0,
                early: None,
            };
            let got = sc.token_ids(h.builder()).unwrap();
            assert_eq!(sc.i, body.len(), "{body}");
            assert_eq!(got.tokens(), ids.len() as u64);
            assert_eq!(got.finish(), h.sequence_hashes(&ids), "{body}");
        }
    }
}

#[test]
fn strings_unescape_as_serde_does() {
    for s in [
        r#""plain""#,
        r#""a\"b\\c\/d\b\f\n\r\t""#,
        r#""\u00e9\u65e5\ud83e\udd80x""#,
        r#""é日🦀 long enough to take the word loop""#,
    ] {
        let mut sc = Scanner {
            b: s.as_bytes(),
            i: 0,
            early: None,
        };
        let want: String = serde_json::from_str(s).unwrap();
        assert_eq!(sc.string().as_deref(), Some(want.as_str()), "{s}");
        assert_eq!(sc.i, s.len());
    }
    for s in [
        r#""\ud83e""#,
        r#""\udd80""#,
        r#""\x""#,
        r#""\u12g4""#,
        "\"a\u{1}b\"",
        "\"unterminated",
    ] {
        let mut sc = Scanner {
            b: s.as_bytes(),
            i: 0,
            early: None,
        };
        assert!(sc.string().is_none(), "{s}");
    }
}

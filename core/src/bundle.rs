//! A Hugging Face tokenizer bundle on the wire: a model's `tokenizer.json` and
//! `tokenizer_config.json` in one body, as `kvsteer-feed --model-dir` serves it at [`BUNDLE_PATH`]
//! and the filter fetches it (`tokenizer.huggingface.fetch`, docs/design/tokenizer.md). Both sides
//! use this code, so they cannot disagree on the format.
//!
//! ```text
//! kvsteer-tokenizer-bundle 1\n
//! model NAME\n                        (optional: the engine's model name)
//! tokenizer.json BYTES\n
//! tokenizer_config.json BYTES\n       (optional)
//! \n
//! <tokenizer.json's bytes><tokenizer_config.json's bytes>
//! ```
//!
//! The files follow the header verbatim (no escaping, no copy of a 9 MB JSON string into another),
//! and their lengths are declared up front, so a truncated or padded body is refused. The digest the
//! filter checks is the SHA-256 of the whole body as served.

/// Where `kvsteer-feed` serves the bundle, and the filter's default `path`.
pub const BUNDLE_PATH: &str = "/kvsteer/tokenizer";
/// The answer's content type.
pub const BUNDLE_CONTENT_TYPE: &str = "application/vnd.kvsteer.tokenizer-bundle";
const MAGIC: &str = "kvsteer-tokenizer-bundle 1";
/// A header longer than this is refused (a model name is a few dozen bytes).
const MAX_HEADER: usize = 4096;

/// A decoded bundle, borrowing the body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bundle<'a> {
    pub model: Option<&'a str>,
    pub tokenizer_json: &'a [u8],
    pub tokenizer_config_json: Option<&'a [u8]>,
}

/// The body for `files`; a model name with a line break in it is written without it.
pub fn encode(
    model: Option<&str>,
    tokenizer_json: &[u8],
    tokenizer_config_json: Option<&[u8]>,
) -> Vec<u8> {
    let mut head = format!("{MAGIC}\n");
    if let Some(m) = model {
        let m: String = m.chars().filter(|c| !c.is_control()).collect();
        head.push_str(&format!("model {m}\n"));
    }
    head.push_str(&format!("tokenizer.json {}\n", tokenizer_json.len()));
    if let Some(c) = tokenizer_config_json {
        head.push_str(&format!("tokenizer_config.json {}\n", c.len()));
    }
    head.push('\n');
    let rest = tokenizer_json.len() + tokenizer_config_json.map_or(0, <[u8]>::len);
    let mut out = Vec::with_capacity(head.len() + rest);
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(tokenizer_json);
    out.extend_from_slice(tokenizer_config_json.unwrap_or_default());
    out
}

/// Reads a body; the error says what is wrong with it, for the log line of a refusal.
pub fn decode(body: &[u8]) -> Result<Bundle<'_>, String> {
    let end = body
        .windows(2)
        .take(MAX_HEADER)
        .position(|w| w == b"\n\n")
        .ok_or("no header: not a kvsteer tokenizer bundle (or its header is over 4 KiB)")?;
    let head = core::str::from_utf8(&body[..end]).map_err(|_| "header is not UTF-8")?;
    let mut lines = head.split('\n');
    if lines.next() != Some(MAGIC) {
        return Err(format!(
            "not a kvsteer tokenizer bundle (first line is not {MAGIC:?})"
        ));
    }
    let (mut model, mut json_len, mut config_len) = (None, None, None);
    for line in lines {
        let (key, value) = line.split_once(' ').unwrap_or((line, ""));
        let len = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("{key}: bad length {value:?}"))
        };
        let slot_taken = match key {
            "model" => model.replace(value).is_some(),
            "tokenizer.json" => json_len.replace(len()?).is_some(),
            "tokenizer_config.json" => config_len.replace(len()?).is_some(),
            _ => return Err(format!("unknown header line {line:?}")),
        };
        if slot_taken {
            return Err(format!("header line {key} given twice"));
        }
    }
    let json_len = json_len.ok_or("no tokenizer.json in the bundle")?;
    let files = &body[end + 2..];
    let want = json_len
        .checked_add(config_len.unwrap_or(0))
        .ok_or("lengths overflow")?;
    if files.len() != want {
        return Err(format!(
            "the header declares {want} bytes of files, the body has {}",
            files.len()
        ));
    }
    let (json, config) = files.split_at(json_len);
    Ok(Bundle {
        model,
        tokenizer_json: json,
        tokenizer_config_json: config_len.map(|_| config),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_reads_back_as_written() {
        let b = encode(Some("llama\n3"), b"{\"a\":\n\n1}", Some(b"{}"));
        let d = decode(&b).unwrap();
        assert_eq!(d.model, Some("llama3"));
        assert_eq!(d.tokenizer_json, b"{\"a\":\n\n1}");
        assert_eq!(d.tokenizer_config_json, Some(&b"{}"[..]));
        let b = encode(None, b"{}", None);
        assert_eq!(
            decode(&b).unwrap(),
            Bundle {
                model: None,
                tokenizer_json: b"{}",
                tokenizer_config_json: None
            }
        );
    }

    #[test]
    fn bad_bodies_are_refused_with_a_reason() {
        let good = encode(Some("m"), b"{}", Some(b"{}"));
        // Every truncation and one extra byte.
        for n in 0..good.len() {
            assert!(decode(&good[..n]).is_err(), "{n}");
        }
        let mut long = good.clone();
        long.push(b' ');
        assert!(decode(&long).unwrap_err().contains("declares"));
        for bad in [
            &b"{\"not\": \"a bundle\"}"[..],
            b"kvsteer-tokenizer-bundle 2\ntokenizer.json 0\n\n",
            b"kvsteer-tokenizer-bundle 1\n\n",
            b"kvsteer-tokenizer-bundle 1\ntokenizer.json x\n\n",
            b"kvsteer-tokenizer-bundle 1\ntokenizer.json 0\ntokenizer.json 0\n\n",
            b"kvsteer-tokenizer-bundle 1\ntokenizer.json 18446744073709551615\ntokenizer_config.json 1\n\n",
            b"kvsteer-tokenizer-bundle 1\nvocab.txt 0\ntokenizer.json 0\n\n",
        ] {
            assert!(decode(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let huge_header = [b"x".repeat(10_000), b"\n\n".to_vec()].concat();
        assert!(decode(&huge_header).is_err());
    }
}

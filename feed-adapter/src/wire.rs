//! Decoding an engine's KV cache event payloads (the third ZMQ frame).
//!
//! vLLM and SGLang both publish a msgspec-encoded `EventBatch`: an array `[ts, events, dp_rank]`
//! (`dp_rank` omitted by older SGLang). Each event is a tagged struct. Two encodings are in the field and
//! both are accepted:
//! - *positional* (msgspec `array_like=True`, vLLM before its switch to maps and SGLang before its own):
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
//!   extra_keys, group_idx, kv_cache_spec_kind, ...]`, where SGLang's seventh field is a `metadata` map
//!   instead of `lora_name`, and older releases stop earlier;
//! - *named* (msgspec `tag=True` without `array_like`, vLLM 0.2x and later including 0.32):
//!   `{"type": "BlockStored", "block_hashes": [...], ...}`, fields in any order, defaults omitted.
//!
//! Block hashes may be unsigned (vLLM), signed 64-bit (SGLang's `hash_str_to_int64`) or bytes (vLLM's
//! `ExternalBlockHash = bytes | int`); bytes are folded to 64 bits with XXH3 ([`bytes_key`]). They are only
//! keys into the adapter's map, never kvsteer identities.
//!
//! The decoder is a streaming reader over the payload built on `rmp`'s marker table: no tree of values
//! per token, limits checked before anything is allocated, unknown fields and values skipped, and every
//! malformed input an error, never a panic.

use xxhash_rust::xxh3::xxh3_64_with_seed;

mod msgpack;

use msgpack::{Item, Reader};

/// Bounds on what one payload may hold; beyond them a payload is refused as too large.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Payload bytes.
    pub max_payload_bytes: usize,
    /// Events in one batch.
    pub max_events: usize,
    /// Block hashes in one event.
    pub max_hashes: usize,
    /// Token ids in one event.
    pub max_tokens: usize,
    /// Nesting depth of values that are skipped.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload_bytes: 64 << 20,
            max_events: 100_000,
            max_hashes: 1 << 20,
            max_tokens: 1 << 24,
            max_depth: 32,
        }
    }
}

/// Where the engine says a block lives (`medium`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Medium {
    /// No medium field, or `"GPU"`.
    Gpu,
    /// `"CPU"`, `"CPU_PINNED"`: host memory (vLLM's and SGLang's offloading).
    Host,
    /// `"DISK"`, `"SSD"`.
    Disk,
    /// Anything else (an external store such as LMCache): not a tier the router knows.
    Other(String),
}

impl Medium {
    fn parse(s: &str) -> Medium {
        match s.to_ascii_uppercase().as_str() {
            "GPU" | "CUDA" | "HBM" | "DEVICE" => Medium::Gpu,
            "CPU" | "CPU_PINNED" | "HOST" | "DRAM" => Medium::Host,
            "DISK" | "SSD" | "LOCAL_DISK" => Medium::Disk,
            _ => Medium::Other(s.to_string()),
        }
    }
}

/// One entry of `extra_keys` (per block): what vLLM mixed into the block's hash besides the tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKeys {
    /// `null` or `[]`: tokens only (and the LoRA name, which the event carries anyway).
    None,
    /// A tuple of strings (LoRA name, cache salt, multimodal identifiers in vLLM's order).
    Strings(Vec<String>),
    /// Anything else (prompt-embedding hashes as bytes, numbers, nested values).
    Opaque,
}

/// `BlockStored`: `hashes.len()` full blocks, chained after `parent`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Stored {
    pub hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: u64,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    pub medium: Option<Medium>,
    /// One entry per block when present.
    pub extra_keys: Option<Vec<ExtraKeys>>,
    pub group_idx: Option<i64>,
    /// SGLang's `metadata.cache_salt`, when present.
    pub cache_salt: Option<String>,
}

/// One engine event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    Stored(Stored),
    Removed {
        hashes: Vec<u64>,
        medium: Option<Medium>,
        group_idx: Option<i64>,
    },
    Cleared,
    /// A well-formed event of a type the adapter does not know (counted, skipped).
    Unknown(String),
    /// A known event type whose fields could not be read (counted; what it meant is lost).
    Malformed {
        kind: &'static str,
        why: &'static str,
    },
}

/// One decoded payload.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    pub dp_rank: Option<i64>,
}

/// Why a payload was refused as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Not msgpack, truncated, or not shaped like an event batch.
    Malformed(&'static str),
    /// Over one of the [`Limits`].
    TooLarge(&'static str),
}

impl core::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DecodeError::Malformed(why) => write!(f, "malformed payload: {why}"),
            DecodeError::TooLarge(what) => write!(f, "payload over the limit on {what}"),
        }
    }
}

impl DecodeError {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            DecodeError::Malformed(_) => "msgpack",
            DecodeError::TooLarge(_) => "too_large",
        }
    }
}

type R<T> = Result<T, DecodeError>;

const TRUNC: DecodeError = DecodeError::Malformed("truncated");

/// The 64-bit key of a block hash sent as bytes.
pub fn bytes_key(b: &[u8]) -> u64 {
    // Any fixed seed: the key only has to be stable within one engine's stream.
    xxh3_64_with_seed(b, 0x6b76_7374_6565_7231)
}

/// A field's value could not be used; the event is reported as [`EngineEvent::Malformed`].
struct FieldError(&'static str);

type F<T> = Result<T, FieldOr>;

/// Reads field `i` (named, in the map form) of an event.
type FieldFn<'f, 'a> = dyn FnMut(&mut Reader<'a>, Option<&'a [u8]>, usize) -> F<()> + 'f;

/// Inside an event, either the field was unusable (the event is malformed but the payload can still be
/// walked) or the payload itself is broken.
enum FieldOr {
    Field(FieldError),
    Payload(DecodeError),
}

impl From<DecodeError> for FieldOr {
    fn from(e: DecodeError) -> Self {
        FieldOr::Payload(e)
    }
}

fn field(why: &'static str) -> FieldOr {
    FieldOr::Field(FieldError(why))
}

impl<'a> Reader<'a> {
    /// Consumes a value that was not what a field needed, then reports the field.
    fn bad<T>(&mut self, it: Item<'a>, why: &'static str) -> F<T> {
        self.skip_rest(it, 1)?;
        Err(field(why))
    }

    fn hash_of(&mut self, it: Item<'a>) -> F<u64> {
        match it {
            Item::Uint(v) => Ok(v),
            Item::Int(v) => Ok(v as u64),
            Item::Bin(b) | Item::Str(b) => Ok(bytes_key(b)),
            other => self.bad(other, "block hash is not an integer or bytes"),
        }
    }

    fn hashes(&mut self) -> F<Vec<u64>> {
        match self.item()? {
            Item::Array(n) => {
                if n > self.limits.max_hashes {
                    return Err(FieldOr::Payload(DecodeError::TooLarge("block_hashes")));
                }
                let mut out = Vec::with_capacity(n);
                let mut err = None;
                for _ in 0..n {
                    let it = self.item()?;
                    match self.hash_of(it) {
                        Ok(h) => out.push(h),
                        Err(FieldOr::Field(e)) => err = Some(e),
                        Err(p) => return Err(p),
                    }
                }
                match err {
                    Some(e) => Err(FieldOr::Field(e)),
                    None => Ok(out),
                }
            }
            other => self.bad(other, "block_hashes is not an array"),
        }
    }

    fn opt_hash(&mut self) -> F<Option<u64>> {
        match self.item()? {
            Item::Nil => Ok(None),
            it => self.hash_of(it).map(Some),
        }
    }

    fn tokens(&mut self) -> F<Vec<u32>> {
        match self.item()? {
            Item::Array(n) => {
                if n > self.limits.max_tokens {
                    return Err(FieldOr::Payload(DecodeError::TooLarge("token_ids")));
                }
                let mut out = Vec::with_capacity(n);
                let mut bad = false;
                for _ in 0..n {
                    match self.item()? {
                        Item::Uint(v) if v <= u32::MAX as u64 => out.push(v as u32),
                        other => {
                            self.skip_rest(other, 1)?;
                            bad = true;
                        }
                    }
                }
                if bad {
                    Err(field("token id is not a u32"))
                } else {
                    Ok(out)
                }
            }
            Item::Nil => Ok(Vec::new()),
            other => self.bad(other, "token_ids is not an array"),
        }
    }

    fn uint(&mut self, why: &'static str) -> F<u64> {
        match self.item()? {
            Item::Uint(v) => Ok(v),
            other => self.bad(other, why),
        }
    }

    fn opt_int(&mut self, why: &'static str) -> F<Option<i64>> {
        match self.item()? {
            Item::Nil => Ok(None),
            Item::Uint(v) => Ok(Some(v.min(i64::MAX as u64) as i64)),
            Item::Int(v) => Ok(Some(v)),
            other => self.bad(other, why),
        }
    }

    fn opt_string(&mut self, why: &'static str) -> F<Option<String>> {
        match self.item()? {
            Item::Nil => Ok(None),
            Item::Str(s) => match core::str::from_utf8(s) {
                Ok(s) => Ok(Some(s.to_string())),
                Err(_) => Err(field("string is not UTF-8")),
            },
            other => self.bad(other, why),
        }
    }

    fn opt_medium(&mut self) -> F<Option<Medium>> {
        Ok(self
            .opt_string("medium is not a string")?
            .map(|s| Medium::parse(&s)))
    }

    fn extra_keys(&mut self) -> F<Option<Vec<ExtraKeys>>> {
        let n = match self.item()? {
            Item::Nil => return Ok(None),
            Item::Array(n) => n,
            other => return self.bad(other, "extra_keys is not an array"),
        };
        if n > self.limits.max_hashes {
            return Err(FieldOr::Payload(DecodeError::TooLarge("extra_keys")));
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(match self.item()? {
                Item::Nil => ExtraKeys::None,
                Item::Array(0) => ExtraKeys::None,
                Item::Array(k) => {
                    let mut strings = Vec::with_capacity(k.min(8));
                    let mut opaque = false;
                    for _ in 0..k {
                        match self.item()? {
                            Item::Str(s) => match core::str::from_utf8(s) {
                                Ok(s) => strings.push(s.to_string()),
                                Err(_) => opaque = true,
                            },
                            other => {
                                self.skip_rest(other, 2)?;
                                opaque = true;
                            }
                        }
                    }
                    if opaque {
                        ExtraKeys::Opaque
                    } else {
                        ExtraKeys::Strings(strings)
                    }
                }
                other => {
                    self.skip_rest(other, 1)?;
                    ExtraKeys::Opaque
                }
            });
        }
        Ok(Some(out))
    }

    /// SGLang's `metadata` map: only `cache_salt` is read.
    fn metadata(&mut self, st: &mut Stored) -> F<()> {
        match self.item()? {
            Item::Nil => Ok(()),
            Item::Map(n) => {
                for _ in 0..n {
                    let k = self.item()?;
                    if matches!(k, Item::Str(b"cache_salt")) {
                        st.cache_salt = self.opt_string("cache_salt is not a string")?;
                    } else {
                        self.skip_rest(k, 2)?;
                        self.skip()?;
                    }
                }
                Ok(())
            }
            // vLLM's seventh positional field is `lora_name`.
            Item::Str(s) => {
                st.lora_name = Some(
                    core::str::from_utf8(s)
                        .map_err(|_| field("lora_name is not UTF-8"))?
                        .to_string(),
                );
                Ok(())
            }
            other => self.bad(other, "lora_name/metadata has an unexpected type"),
        }
    }

    /// Reads a named field of `BlockStored` into `st`; unknown names are skipped.
    fn stored_field(&mut self, name: &[u8], st: &mut Stored, seen: &mut u8) -> F<()> {
        match name {
            b"block_hashes" => {
                st.hashes = self.hashes()?;
                *seen |= 1;
            }
            b"parent_block_hash" => st.parent = self.opt_hash()?,
            b"token_ids" => {
                st.token_ids = self.tokens()?;
                *seen |= 2;
            }
            b"block_size" => {
                st.block_size = self.uint("block_size is not an unsigned integer")?;
                *seen |= 4;
            }
            b"lora_id" => st.lora_id = self.opt_int("lora_id is not an integer")?,
            b"medium" => st.medium = self.opt_medium()?,
            b"lora_name" => st.lora_name = self.opt_string("lora_name is not a string")?,
            b"extra_keys" => st.extra_keys = self.extra_keys()?,
            b"group_idx" => st.group_idx = self.opt_int("group_idx is not an integer")?,
            b"metadata" => self.metadata(st)?,
            _ => self.skip()?,
        }
        Ok(())
    }

    /// Reads positional field `i` (after the tag) of `BlockStored`.
    fn stored_pos(&mut self, i: usize, st: &mut Stored, seen: &mut u8) -> F<()> {
        const NAMES: [&[u8]; 10] = [
            b"block_hashes",
            b"parent_block_hash",
            b"token_ids",
            b"block_size",
            b"lora_id",
            b"medium",
            b"metadata", // lora_name (vLLM) or metadata (SGLang), told apart by type
            b"extra_keys",
            b"group_idx",
            b"kv_cache_spec_kind",
        ];
        match NAMES.get(i) {
            Some(name) => self.stored_field(name, st, seen),
            None => Ok(self.skip()?),
        }
    }

    fn removed_field(
        &mut self,
        name: &[u8],
        hashes: &mut Option<Vec<u64>>,
        medium: &mut Option<Medium>,
        group: &mut Option<i64>,
    ) -> F<()> {
        match name {
            b"block_hashes" => *hashes = Some(self.hashes()?),
            b"medium" => *medium = self.opt_medium()?,
            b"group_idx" => *group = self.opt_int("group_idx is not an integer")?,
            _ => self.skip()?,
        }
        Ok(())
    }

    /// One event: a tagged array or a tagged map.
    fn event(&mut self) -> R<EngineEvent> {
        let head = self.item()?;
        let (named, n) = match head {
            Item::Array(0) => return Ok(EngineEvent::Unknown(String::new())),
            Item::Array(n) => (false, n),
            Item::Map(n) => (true, n),
            other => {
                self.skip_rest(other, 1)?;
                return Ok(EngineEvent::Malformed {
                    kind: "event",
                    why: "event is neither an array nor a map",
                });
            }
        };
        if !named {
            let tag = match self.item()? {
                Item::Str(s) => s,
                other => {
                    self.skip_rest(other, 1)?;
                    for _ in 1..n {
                        self.skip()?;
                    }
                    return Ok(EngineEvent::Malformed {
                        kind: "event",
                        why: "first element of an event is not its type name",
                    });
                }
            };
            return self.event_body(tag, n - 1, false);
        }
        // Named: find "type" first (msgspec writes it first, but any position is accepted), then walk
        // the fields again.
        let start = self.pos;
        let mut tag: Option<&'a [u8]> = None;
        for _ in 0..n {
            let k = self.item()?;
            if matches!(k, Item::Str(b"type")) {
                match self.item()? {
                    Item::Str(t) => tag = Some(t),
                    other => self.skip_rest(other, 1)?,
                }
            } else {
                self.skip_rest(k, 2)?;
                self.skip()?;
            }
        }
        let Some(tag) = tag else {
            return Ok(EngineEvent::Malformed {
                kind: "event",
                why: "map event without a string \"type\"",
            });
        };
        let end = self.pos;
        self.pos = start;
        let ev = self.event_body(tag, n, true)?;
        debug_assert_eq!(self.pos, end);
        self.pos = end;
        Ok(ev)
    }

    /// Walks `n` fields: positional (`map_form` false: field `i` is passed with no name) or key/value
    /// pairs (the `"type"` entry skipped). Returns the first field error; payload errors end the walk.
    fn walk(
        &mut self,
        n: usize,
        map_form: bool,
        on_field: &mut FieldFn<'_, 'a>,
    ) -> R<Option<&'static str>> {
        let mut err: Option<&'static str> = None;
        for i in 0..n {
            let res: F<()> = if map_form {
                match self.item()? {
                    Item::Str(b"type") => self.skip().map_err(FieldOr::from),
                    Item::Str(k) => on_field(self, Some(k), i),
                    other => {
                        self.skip_rest(other, 2)?;
                        self.skip().map_err(FieldOr::from)
                    }
                }
            } else {
                on_field(self, None, i)
            };
            match res {
                Ok(()) => {}
                Err(FieldOr::Field(FieldError(why))) => err = err.or(Some(why)),
                Err(FieldOr::Payload(e)) => return Err(e),
            }
        }
        Ok(err)
    }

    /// Reads the `n` fields of an event whose tag is `tag`.
    fn event_body(&mut self, tag: &'a [u8], n: usize, map_form: bool) -> R<EngineEvent> {
        match tag {
            b"BlockStored" => {
                let mut st = Stored::default();
                let mut seen = 0u8;
                let err = self.walk(n, map_form, &mut |r, name, i| match name {
                    Some(k) => r.stored_field(k, &mut st, &mut seen),
                    None => r.stored_pos(i, &mut st, &mut seen),
                })?;
                Ok(match err {
                    Some(why) => EngineEvent::Malformed {
                        kind: "BlockStored",
                        why,
                    },
                    None if seen & 5 != 5 => EngineEvent::Malformed {
                        kind: "BlockStored",
                        why: "block_hashes or block_size missing",
                    },
                    None => EngineEvent::Stored(st),
                })
            }
            b"BlockRemoved" => {
                let (mut hashes, mut medium, mut group) = (None, None, None);
                const POS: [&[u8]; 3] = [b"block_hashes", b"medium", b"group_idx"];
                let err = self.walk(n, map_form, &mut |r, name, i| {
                    let k: &[u8] = match name {
                        Some(k) => k,
                        None => POS.get(i).copied().unwrap_or(b""),
                    };
                    r.removed_field(k, &mut hashes, &mut medium, &mut group)
                })?;
                Ok(match (err, hashes) {
                    (Some(why), _) => EngineEvent::Malformed {
                        kind: "BlockRemoved",
                        why,
                    },
                    (None, None) => EngineEvent::Malformed {
                        kind: "BlockRemoved",
                        why: "block_hashes missing",
                    },
                    (None, Some(hashes)) => EngineEvent::Removed {
                        hashes,
                        medium,
                        group_idx: group,
                    },
                })
            }
            b"AllBlocksCleared" => {
                for _ in 0..n {
                    self.skip()?;
                    if map_form {
                        self.skip()?;
                    }
                }
                Ok(EngineEvent::Cleared)
            }
            other => {
                for _ in 0..n {
                    self.skip()?;
                    if map_form {
                        self.skip()?;
                    }
                }
                Ok(EngineEvent::Unknown(
                    String::from_utf8_lossy(other).into_owned(),
                ))
            }
        }
    }
}

/// Decodes one payload. A batch that cannot be walked is an error; an event inside it that cannot be
/// read is returned as [`EngineEvent::Malformed`] so the caller can count it and judge what was lost.
pub fn decode_batch(buf: &[u8], limits: &Limits) -> Result<EngineBatch, DecodeError> {
    if buf.len() > limits.max_payload_bytes {
        return Err(DecodeError::TooLarge("payload bytes"));
    }
    let mut r = Reader {
        buf,
        pos: 0,
        limits,
    };
    let mut ts = 0.0;
    let mut events = None;
    let mut dp_rank = None;
    match r.item()? {
        Item::Array(n) => {
            if n < 2 {
                return Err(DecodeError::Malformed(
                    "event batch has fewer than 2 fields",
                ));
            }
            ts = match r.item()? {
                Item::Float(f) => f,
                Item::Uint(v) => v as f64,
                Item::Int(v) => v as f64,
                _ => return Err(DecodeError::Malformed("batch timestamp is not a number")),
            };
            events = Some(read_events(&mut r)?);
            for i in 2..n {
                match (i, r.item()?) {
                    (2, Item::Uint(v)) => dp_rank = Some(v.min(i64::MAX as u64) as i64),
                    (2, Item::Int(v)) => dp_rank = Some(v),
                    (_, other) => r.skip_rest(other, 1)?,
                }
            }
        }
        Item::Map(n) => {
            for _ in 0..n {
                match r.item()? {
                    Item::Str(b"ts") => {
                        ts = match r.item()? {
                            Item::Float(f) => f,
                            Item::Uint(v) => v as f64,
                            Item::Int(v) => v as f64,
                            _ => {
                                return Err(DecodeError::Malformed(
                                    "batch timestamp is not a number",
                                ));
                            }
                        }
                    }
                    Item::Str(b"events") => events = Some(read_events(&mut r)?),
                    Item::Str(b"data_parallel_rank") | Item::Str(b"attn_dp_rank") => {
                        match r.item()? {
                            Item::Uint(v) => dp_rank = Some(v.min(i64::MAX as u64) as i64),
                            Item::Int(v) => dp_rank = Some(v),
                            other => r.skip_rest(other, 1)?,
                        }
                    }
                    other => {
                        r.skip_rest(other, 1)?;
                        r.skip()?;
                    }
                }
            }
        }
        _ => return Err(DecodeError::Malformed("event batch is not an array or map")),
    }
    let Some(events) = events else {
        return Err(DecodeError::Malformed("event batch has no events"));
    };
    if r.remaining() != 0 {
        return Err(DecodeError::Malformed("bytes after the event batch"));
    }
    Ok(EngineBatch {
        ts,
        events,
        dp_rank,
    })
}

fn read_events(r: &mut Reader<'_>) -> R<Vec<EngineEvent>> {
    let n = match r.item()? {
        Item::Array(n) => n,
        _ => return Err(DecodeError::Malformed("events is not an array")),
    };
    if n > r.limits.max_events {
        return Err(DecodeError::TooLarge("events in one batch"));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(r.event()?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;

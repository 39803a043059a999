//! The proxy-wasm ABI 0.2.1 vocabulary: status codes, enums and the header-pair wire format.
//!
//! Values are those of the spec (github.com/proxy-wasm/spec, `abi-versions/v0.2.1`) and of the Rust SDK's
//! `types.rs`; they are repeated here because the host must speak them without linking the SDK.

/// `proxy_status_t`. The SDK panics on any status it does not expect from a call, so the host must
/// answer exactly what Envoy answers in each case (see the call sites in `host.rs`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
    BrokenConnection = 11,
    Unimplemented = 12,
}

impl Status {
    pub fn code(self) -> i32 {
        self as u32 as i32
    }
}

/// What a stream callback returned (`proxy_action_t`; for bodies 1 is `StopIterationAndBuffer`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// StopIteration on headers, StopIterationAndBuffer on bodies.
    Pause,
    /// Any other value: the ABI defines none for HTTP streams, so the host treats it as an error.
    Other(u32),
}

impl Action {
    pub fn from_raw(v: i32) -> Action {
        match v {
            0 => Action::Continue,
            1 => Action::Pause,
            v => Action::Other(v as u32),
        }
    }
}

/// `proxy_log_level_t`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl LogLevel {
    pub fn from_raw(v: i32) -> Option<LogLevel> {
        Some(match v {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            5 => LogLevel::Critical,
            _ => return None,
        })
    }
}

/// `proxy_map_type_t`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MapType {
    RequestHeaders,
    RequestTrailers,
    ResponseHeaders,
    ResponseTrailers,
    GrpcInitialMetadata,
    GrpcTrailingMetadata,
    HttpCallResponseHeaders,
    HttpCallResponseTrailers,
}

impl MapType {
    pub fn from_raw(v: i32) -> Option<MapType> {
        Some(match v {
            0 => MapType::RequestHeaders,
            1 => MapType::RequestTrailers,
            2 => MapType::ResponseHeaders,
            3 => MapType::ResponseTrailers,
            4 => MapType::GrpcInitialMetadata,
            5 => MapType::GrpcTrailingMetadata,
            6 => MapType::HttpCallResponseHeaders,
            7 => MapType::HttpCallResponseTrailers,
            _ => return None,
        })
    }
}

/// `proxy_buffer_type_t`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum BufferType {
    RequestBody,
    ResponseBody,
    DownstreamData,
    UpstreamData,
    HttpCallResponseBody,
    GrpcReceiveBuffer,
    VmConfiguration,
    PluginConfiguration,
    CallData,
}

impl BufferType {
    pub fn from_raw(v: i32) -> Option<BufferType> {
        Some(match v {
            0 => BufferType::RequestBody,
            1 => BufferType::ResponseBody,
            2 => BufferType::DownstreamData,
            3 => BufferType::UpstreamData,
            4 => BufferType::HttpCallResponseBody,
            5 => BufferType::GrpcReceiveBuffer,
            6 => BufferType::VmConfiguration,
            7 => BufferType::PluginConfiguration,
            8 => BufferType::CallData,
            _ => return None,
        })
    }
}

/// `proxy_stream_type_t`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StreamType {
    HttpRequest,
    HttpResponse,
    Downstream,
    Upstream,
}

impl StreamType {
    pub fn from_raw(v: i32) -> Option<StreamType> {
        Some(match v {
            0 => StreamType::HttpRequest,
            1 => StreamType::HttpResponse,
            2 => StreamType::Downstream,
            3 => StreamType::Upstream,
            _ => return None,
        })
    }
}

/// `proxy_metric_type_t`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

impl MetricType {
    pub fn from_raw(v: i32) -> Option<MetricType> {
        Some(match v {
            0 => MetricType::Counter,
            1 => MetricType::Gauge,
            2 => MetricType::Histogram,
            _ => return None,
        })
    }
}

/// Header pairs as the host keeps them: raw bytes, since the ABI does not promise UTF-8.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Serializes pairs in the proxy-wasm layout: `count u32`, then `(key_len u32, value_len u32)` per pair,
/// then each key and value followed by a NUL byte. All integers little-endian.
pub fn encode_pairs(pairs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let size = 4 + pairs
        .iter()
        .map(|(k, v)| 10 + k.len() + v.len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Why a serialized pair map from the guest was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PairsError {
    Truncated,
    MissingNul,
}

/// Parses the proxy-wasm pair layout, refusing truncated input and missing terminators (the guest is not
/// trusted: a length that points past the buffer is an error, never a panic). An empty buffer is an empty
/// map, as in the SDK.
pub fn decode_pairs(buf: &[u8]) -> Result<Pairs, PairsError> {
    if buf.is_empty() {
        return Ok(Vec::new());
    }
    let rd = |at: usize| -> Result<usize, PairsError> {
        let b = buf.get(at..at + 4).ok_or(PairsError::Truncated)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let count = rd(0)?;
    let lens_end = count
        .checked_mul(8)
        .and_then(|n| n.checked_add(4))
        .ok_or(PairsError::Truncated)?;
    if lens_end > buf.len() {
        return Err(PairsError::Truncated);
    }
    let mut pairs = Vec::with_capacity(count);
    let mut p = lens_end;
    let mut take = |len: usize| -> Result<Vec<u8>, PairsError> {
        let end = p.checked_add(len).ok_or(PairsError::Truncated)?;
        let s = buf.get(p..end).ok_or(PairsError::Truncated)?;
        if buf.get(end) != Some(&0) {
            return Err(PairsError::MissingNul);
        }
        p = end + 1;
        Ok(s.to_vec())
    };
    for i in 0..count {
        let klen = rd(4 + i * 8)?;
        let vlen = rd(8 + i * 8)?;
        let k = take(klen)?;
        let v = take(vlen)?;
        pairs.push((k, v));
    }
    Ok(pairs)
}

/// Splits a property path: the SDK joins path segments with NUL bytes.
pub fn decode_property_path(buf: &[u8]) -> Vec<String> {
    if buf.is_empty() {
        return Vec::new();
    }
    buf.split(|b| *b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(k: &str, v: &str) -> (Vec<u8>, Vec<u8>) {
        (k.as_bytes().to_vec(), v.as_bytes().to_vec())
    }

    #[test]
    fn pairs_match_the_sdk_layout() {
        // The SDK's own test vector (hostcalls.rs, SERIALIZED_MAP), first two entries.
        let enc = encode_pairs(&[p(":method", "GET"), p(":path", "/bytes/1")]);
        let mut want = vec![2, 0, 0, 0, 7, 0, 0, 0, 3, 0, 0, 0, 5, 0, 0, 0, 8, 0, 0, 0];
        want.extend_from_slice(b":method\0GET\0:path\0/bytes/1\0");
        assert_eq!(enc, want);
        assert_eq!(
            decode_pairs(&enc).unwrap(),
            vec![p(":method", "GET"), p(":path", "/bytes/1")]
        );
    }

    #[test]
    fn hostile_pairs_are_refused() {
        let enc = encode_pairs(&[p("a", "bc")]);
        for cut in 1..enc.len() {
            assert!(decode_pairs(&enc[..cut]).is_err(), "cut {cut}");
        }
        let mut huge = enc.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_pairs(&huge), Err(PairsError::Truncated));
        let mut no_nul = enc.clone();
        let last = no_nul.len() - 1;
        no_nul[last] = b'x';
        assert_eq!(decode_pairs(&no_nul), Err(PairsError::MissingNul));
        assert_eq!(decode_pairs(&[]).unwrap(), vec![]);
    }

    #[test]
    fn property_paths_split_on_nul() {
        assert_eq!(
            decode_property_path(b"ngx\0upstream"),
            vec!["ngx", "upstream"]
        );
        assert!(decode_property_path(b"").is_empty());
    }
}

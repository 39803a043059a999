//! Header maps: get pairs / get value / add / replace / remove / set pairs on the request and
//! response headers and trailers and the (read-only) HTTP-call response headers and trailers, in the
//! SDK's pair serialization; names are lower-cased as Envoy does. A map that does not exist in the
//! current context is `BadArgument`, as in Envoy.

use super::memory::{HostResult, ok, read_or_status, refuse_if_asked, return_bytes, status};
use super::{ENV, VmState};
use crate::abi::{MapType, Pairs, Status, decode_pairs, encode_pairs};
use wasmtime::{Caller, Linker};

/// First value of a header (names compared case-insensitively), as text.
pub fn header_value<'a>(pairs: &'a [(Vec<u8>, Vec<u8>)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

/// Builds header pairs from text, lower-casing names as Envoy does.
pub fn pairs(list: &[(&str, &str)]) -> Pairs {
    list.iter()
        .map(|(k, v)| (k.to_ascii_lowercase().into_bytes(), v.as_bytes().to_vec()))
        .collect()
}

impl VmState {
    fn map(&self, map: MapType) -> Option<&Pairs> {
        match map {
            MapType::HttpCallResponseHeaders => self.call_response.as_ref()?.headers.as_ref(),
            MapType::HttpCallResponseTrailers => self.call_response.as_ref()?.trailers.as_ref(),
            _ => {
                let s = self.streams.get(&self.effective)?;
                match map {
                    MapType::RequestHeaders => Some(&s.request_headers),
                    MapType::RequestTrailers => s.request_trailers.as_ref(),
                    MapType::ResponseHeaders => s.response_headers.as_ref(),
                    MapType::ResponseTrailers => s.response_trailers.as_ref(),
                    _ => None,
                }
            }
        }
    }

    /// Maps the filter may modify: the call response is read-only in Envoy.
    fn map_mut(&mut self, map: MapType) -> Option<&mut Pairs> {
        let id = self.effective;
        let s = self.streams.get_mut(&id)?;
        match map {
            MapType::RequestHeaders => Some(&mut s.request_headers),
            MapType::RequestTrailers => s.request_trailers.as_mut(),
            MapType::ResponseHeaders => s.response_headers.as_mut(),
            MapType::ResponseTrailers => s.response_trailers.as_mut(),
            _ => None,
        }
    }
}

/// Links the header-map calls.
pub(super) fn add_headers(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    // Kept whole: one registration per header-map host function, a flat list.
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, VmState>, map: i32, ptr_ptr: i32, size_ptr: i32| -> HostResult {
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data().map(map) else {
                return status(Status::BadArgument);
            };
            let bytes = encode_pairs(pairs);
            return_bytes(&mut c, &bytes, ptr_ptr, size_ptr)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_header_map_pairs",
        |mut c: Caller<'_, VmState>, map: i32, ptr: i32, len: i32| -> HostResult {
            let raw = read_or_status!(&mut c, ptr, len);
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Ok(new) = decode_pairs(&raw) else {
                c.data_mut().note("malformed header pairs".into());
                return status(Status::BadArgument);
            };
            let Some(target) = c.data_mut().map_mut(map) else {
                return status(Status::BadArgument);
            };
            *target = new
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect();
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_value",
        |mut c: Caller<'_, VmState>,
         map: i32,
         kptr: i32,
         klen: i32,
         ptr_ptr: i32,
         size_ptr: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_get_header_map_value");
            let key = read_or_status!(&mut c, kptr, klen);
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data().map(map) else {
                return status(Status::BadArgument);
            };
            let Some(value) = pairs
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(&key))
                .map(|(_, v)| v.clone())
            else {
                return status(Status::NotFound);
            };
            return_bytes(&mut c, &value, ptr_ptr, size_ptr)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_replace_header_map_value",
        |mut c: Caller<'_, VmState>,
         map: i32,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_replace_header_map_value");
            let key = read_or_status!(&mut c, kptr, klen).to_ascii_lowercase();
            let value = read_or_status!(&mut c, vptr, vlen);
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data_mut().map_mut(map) else {
                return status(Status::BadArgument);
            };
            match pairs.iter().position(|(k, _)| *k == key) {
                Some(i) => {
                    pairs[i].1 = value;
                    let mut j = i + 1;
                    while j < pairs.len() {
                        if pairs[j].0 == key {
                            pairs.remove(j);
                        } else {
                            j += 1;
                        }
                    }
                }
                None => pairs.push((key, value)),
            }
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, VmState>, map: i32, kptr: i32, klen: i32| -> HostResult {
            refuse_if_asked!(c, "proxy_remove_header_map_value");
            let key = read_or_status!(&mut c, kptr, klen).to_ascii_lowercase();
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data_mut().map_mut(map) else {
                return status(Status::BadArgument);
            };
            pairs.retain(|(k, _)| *k != key);
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_add_header_map_value",
        |mut c: Caller<'_, VmState>,
         map: i32,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32|
         -> HostResult {
            let key = read_or_status!(&mut c, kptr, klen).to_ascii_lowercase();
            let value = read_or_status!(&mut c, vptr, vlen);
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data_mut().map_mut(map) else {
                return status(Status::BadArgument);
            };
            pairs.push((key, value));
            ok()
        },
    )?;
    Ok(())
}

//! Properties: `proxy_set_property` is recorded on the stream (nginx's `["ngx", VAR]`) or the root
//! context; `proxy_get_property` answers what was set, plus the few attributes a proxy answers by itself
//! ([`builtin_property`]); anything else is `NotFound`.

use super::headers::header_value;
use super::memory::{HostResult, ok, read_or_status, refuse_if_asked, return_bytes, status};
use super::{ENV, VmState};
use crate::abi::{Status, decode_property_path};
use wasmtime::{Caller, Linker};

/// Properties a proxy answers by itself (a small subset of Envoy's attributes).
fn builtin_property(st: &VmState, path: &[String]) -> Option<Vec<u8>> {
    let p: Vec<&str> = path.iter().map(String::as_str).collect();
    match p.as_slice() {
        ["plugin_name"] => Some(st.options.plugin_name.clone().into_bytes()),
        ["plugin_vm_id"] => Some(st.options.vm_id.clone().into_bytes()),
        ["plugin_root_id"] => Some(Vec::new()),
        // Envoy 1.40 answers the node id under its CEL attribute name `xds.node` (`node.id` came
        // back empty in e2e/test_proxies.py), so the harness answers it there.
        ["xds", "node", "id"] => st.options.node_id.clone().map(String::into_bytes),
        ["request", "path"] | ["request", "method"] => {
            let s = st.streams.get(&st.effective)?;
            let name = if p[1] == "path" { ":path" } else { ":method" };
            header_value(&s.request_headers, name).map(|v| v.as_bytes().to_vec())
        }
        _ => None,
    }
}

/// Links the property calls.
pub(super) fn add_properties(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        ENV,
        "proxy_get_property",
        |mut c: Caller<'_, VmState>,
         pptr: i32,
         plen: i32,
         ptr_ptr: i32,
         size_ptr: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_get_property");
            let path = decode_property_path(&read_or_status!(&mut c, pptr, plen));
            let value = {
                let st = c.data();
                let stream_prop = st
                    .streams
                    .get(&st.effective)
                    .and_then(|s| s.properties.get(&path));
                stream_prop
                    .or_else(|| st.root_properties.get(&path))
                    .cloned()
                    .or_else(|| builtin_property(st, &path))
            };
            match value {
                Some(v) => return_bytes(&mut c, &v, ptr_ptr, size_ptr),
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_property",
        |mut c: Caller<'_, VmState>, pptr: i32, plen: i32, vptr: i32, vlen: i32| -> HostResult {
            refuse_if_asked!(c, "proxy_set_property");
            let path = decode_property_path(&read_or_status!(&mut c, pptr, plen));
            let value = read_or_status!(&mut c, vptr, vlen);
            let st = c.data_mut();
            let id = st.effective;
            match st.streams.get_mut(&id) {
                Some(s) => {
                    s.properties.insert(path, value);
                }
                None => {
                    st.root_properties.insert(path, value);
                }
            }
            ok()
        },
    )?;
    Ok(())
}

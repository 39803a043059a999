//! The host's own safety net, on tiny hand-assembled modules (the real filter never traps, so it cannot
//! show that a trap is caught): a trap in a callback is reported with its callback and kills the
//! worker, a runaway loop is stopped by fuel, a refused configuration is reported, and a module that
//! imports something the host lacks is refused at load with the names.

use kvsteer_wasm_host::{FilterModule, HostError, HostMode, Proxy, ProxyOptions, pairs};

fn leb(mut v: u32, out: &mut Vec<u8>) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn name(s: &str, out: &mut Vec<u8>) {
    leb(s.len() as u32, out);
    out.extend_from_slice(s.as_bytes());
}

fn section(id: u8, items: &[Vec<u8>], out: &mut Vec<u8>) {
    let mut body = Vec::new();
    leb(items.len() as u32, &mut body);
    for i in items {
        body.extend_from_slice(i);
    }
    out.push(id);
    leb(body.len() as u32, out);
    out.extend(body);
}

const I32: u8 = 0x7f;

fn functype(params: &[u8], results: &[u8]) -> Vec<u8> {
    let mut t = vec![0x60];
    leb(params.len() as u32, &mut t);
    t.extend_from_slice(params);
    leb(results.len() as u32, &mut t);
    t.extend_from_slice(results);
    t
}

/// A proxy-wasm module whose `proxy_on_configure` returns `configure_ok`, whose request-headers
/// callback executes `unreachable`, and whose request-body callback loops forever. With `import`, it
/// also imports `env::<import>` of type `() -> ()`.
fn module(configure_ok: bool, import: Option<&str>) -> Vec<u8> {
    let types = vec![
        functype(&[], &[]),                 // 0
        functype(&[I32], &[I32]),           // 1
        functype(&[I32, I32], &[]),         // 2
        functype(&[I32, I32], &[I32]),      // 3
        functype(&[I32, I32, I32], &[I32]), // 4
    ];
    // (export name, type, body)
    let funcs: Vec<(&str, u32, Vec<u8>)> = vec![
        ("proxy_abi_version_0_2_1", 0, vec![0x0b]),
        ("proxy_on_memory_allocate", 1, vec![0x41, 0x80, 0x08, 0x0b]), // i32.const 1024
        ("proxy_on_context_create", 2, vec![0x0b]),
        (
            "proxy_on_configure",
            3,
            vec![0x41, configure_ok as u8, 0x0b],
        ),
        ("proxy_on_request_headers", 4, vec![0x00, 0x0b]), // unreachable
        // loop (br 0) end; i32.const 0
        (
            "proxy_on_request_body",
            4,
            vec![0x03, 0x40, 0x0c, 0x00, 0x0b, 0x41, 0x00, 0x0b],
        ),
    ];
    let imported = import.is_some() as u32;
    let mut m = b"\0asm\x01\0\0\0".to_vec();
    section(1, &types, &mut m);
    if let Some(field) = import {
        let mut i = Vec::new();
        name("env", &mut i);
        name(field, &mut i);
        i.extend_from_slice(&[0x00, 0x00]); // func, type 0
        section(2, &[i], &mut m);
    }
    let fsec: Vec<Vec<u8>> = funcs.iter().map(|(_, t, _)| vec![*t as u8]).collect();
    section(3, &fsec, &mut m);
    section(5, &[vec![0x00, 0x01]], &mut m); // one memory, min 1 page
    let mut exports: Vec<Vec<u8>> = funcs
        .iter()
        .enumerate()
        .map(|(i, (n, _, _))| {
            let mut e = Vec::new();
            name(n, &mut e);
            e.push(0x00);
            leb(i as u32 + imported, &mut e);
            e
        })
        .collect();
    let mut mem = Vec::new();
    name("memory", &mut mem);
    mem.extend_from_slice(&[0x02, 0x00]);
    exports.push(mem);
    section(7, &exports, &mut m);
    let code: Vec<Vec<u8>> = funcs
        .iter()
        .map(|(_, _, body)| {
            let mut f = vec![0x00]; // no locals
            f.extend_from_slice(body);
            let mut c = Vec::new();
            leb(f.len() as u32, &mut c);
            c.extend(f);
            c
        })
        .collect();
    section(10, &code, &mut m);
    m
}

fn worker(configure_ok: bool) -> Result<kvsteer_wasm_host::WorkerVm, HostError> {
    let m = FilterModule::from_bytes(&module(configure_ok, None), true)?;
    Proxy::new(&m, ProxyOptions::new(HostMode::Envoy, "{}")).start_worker()
}

#[test]
fn a_trap_is_reported_and_kills_the_worker() {
    let mut w = worker(true).unwrap();
    let id = w.new_stream().unwrap();
    let err = w
        .request_headers(id, pairs(&[(":method", "POST")]), false)
        .unwrap_err();
    match &err {
        HostError::Trap { callback, trap, .. } => {
            assert_eq!(*callback, "proxy_on_request_headers");
            assert!(trap.contains("unreachable"), "{trap}");
        }
        other => panic!("expected a trap, got {other}"),
    }
    assert!(w.is_dead());
    assert!(matches!(w.new_stream(), Err(HostError::Dead { .. })));
}

#[test]
fn a_runaway_loop_is_stopped_by_fuel() {
    let mut w = worker(true).unwrap();
    let id = w.new_stream().unwrap();
    let err = w.request_body(id, b"x", true).unwrap_err();
    match err {
        HostError::Trap { callback, trap, .. } => {
            assert_eq!(callback, "proxy_on_request_body");
            assert!(trap.contains("fuel"), "{trap}");
        }
        other => panic!("expected a trap, got {other}"),
    }
}

#[test]
fn a_refused_configuration_is_reported() {
    match worker(false) {
        Err(HostError::Refused { callback, .. }) => assert_eq!(callback, "proxy_on_configure"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("configuration accepted"),
    }
}

#[test]
fn unknown_imports_are_refused_at_load() {
    let err = FilterModule::from_bytes(&module(true, Some("proxy_teleport")), true)
        .err()
        .expect("refused");
    let HostError::Load(msg) = err else {
        panic!("{err}")
    };
    assert!(msg.contains("env::proxy_teleport"), "{msg}");
    // A known name with the wrong signature compiles but cannot be instantiated: a load error too.
    let m = FilterModule::from_bytes(&module(true, Some("proxy_log")), true).unwrap();
    match Proxy::new(&m, ProxyOptions::new(HostMode::Envoy, "{}")).start_worker() {
        Err(HostError::Load(msg)) => assert!(msg.contains("proxy_log"), "{msg}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a mistyped import was linked"),
    }
    let not_proxy_wasm = FilterModule::from_bytes(b"\0asm\x01\0\0\0", true).err();
    assert!(matches!(not_proxy_wasm, Some(HostError::Load(_))));
}

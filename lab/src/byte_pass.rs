//! The floor a body reader is measured against: one plain pass over the same bytes, in the same
//! engine. A hand-assembled wasm function loads each byte and adds it to a running sum (one load,
//! one add, one compare and branch a byte, with no vector instructions), compiled by the same
//! wasmtime/Cranelift as the filter, so `filter-bench` can print the filter's cost per request as a
//! multiple of it on the same machine in the same run.

use std::time::{Duration, Instant};
use wasmtime::{Config, Engine, Instance, Memory, Module, Store, TypedFunc};

/// `(module (memory (export "memory") 1) (func (export "pass") (param $p i32) (param $n i32)
/// (result i32) ...))`: sums the bytes `[p, p + n)`.
const MODULE: &[u8] = &[
    0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, // magic, version 1
    0x01, 0x07, 0x01, 0x60, 0x02, 0x7f, 0x7f, 0x01, 0x7f, // type 0: (i32, i32) -> i32
    0x03, 0x02, 0x01, 0x00, // function 0 has type 0
    0x05, 0x03, 0x01, 0x00, 0x01, // one memory, at least 1 page
    0x07, 0x11, 0x02, // two exports
    0x04, b'p', b'a', b's', b's', 0x00, 0x00, // "pass": function 0
    0x06, b'm', b'e', b'm', b'o', b'r', b'y', 0x02, 0x00, // "memory": memory 0
    0x0a, 0x2f, 0x01, 0x2d, // code: one body of 45 bytes
    0x01, 0x02, 0x7f, // locals: $end, $sum (i32)
    0x20, 0x00, 0x20, 0x01, 0x6a, 0x21, 0x02, // $end = $p + $n
    0x02, 0x40, 0x03, 0x40, // block, loop
    0x20, 0x00, 0x20, 0x02, 0x4f, 0x0d, 0x01, // br_if out when $p >= $end
    0x20, 0x03, 0x20, 0x00, 0x2d, 0x00, 0x00, 0x6a, 0x21, 0x03, // $sum += load8_u($p)
    0x20, 0x00, 0x41, 0x01, 0x6a, 0x21, 0x00, // $p += 1
    0x0c, 0x00, 0x0b, 0x0b, // br loop; end loop; end block
    0x20, 0x03, 0x0b, // return $sum
];

/// One instance of the byte pass.
pub struct BytePass {
    store: Store<()>,
    memory: Memory,
    pass: TypedFunc<(i32, i32), i32>,
}

impl BytePass {
    pub fn new() -> Result<Self, String> {
        let engine = Engine::new(&Config::new()).map_err(|e| format!("{e:#}"))?;
        let module = Module::new(&engine, MODULE).map_err(|e| format!("{e:#}"))?;
        let mut store = Store::new(&engine, ());
        let instance = Instance::new(&mut store, &module, &[]).map_err(|e| format!("{e:#}"))?;
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or("byte pass: no memory")?;
        let pass = instance
            .get_typed_func(&mut store, "pass")
            .map_err(|e| format!("{e:#}"))?;
        Ok(Self {
            store,
            memory,
            pass,
        })
    }

    /// Copies `bytes` into the instance (not timed), then times one pass over them; returns the sum
    /// (so a test can check the pass really reads them) and the time of the call.
    pub fn run(&mut self, bytes: &[u8]) -> Result<(u32, Duration), String> {
        let have = self.memory.data_size(&self.store);
        if have < bytes.len() {
            let pages = (bytes.len() - have).div_ceil(65536) as u64;
            self.memory
                .grow(&mut self.store, pages)
                .map_err(|e| format!("{e:#}"))?;
        }
        self.memory
            .write(&mut self.store, 0, bytes)
            .map_err(|e| format!("{e:#}"))?;
        let n = i32::try_from(bytes.len()).map_err(|_| "byte pass: body too large")?;
        let t = Instant::now();
        let sum = self
            .pass
            .call(&mut self.store, (0, n))
            .map_err(|e| format!("{e:#}"))?;
        Ok((sum as u32, t.elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pass_reads_every_byte() {
        let mut p = BytePass::new().unwrap();
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let want: u32 = bytes.iter().map(|&b| b as u32).sum();
        assert_eq!(p.run(&bytes).unwrap().0, want);
        assert_eq!(p.run(b"abc").unwrap().0, 97 + 98 + 99);
    }
}

//! wasmtime harness (issue 4).

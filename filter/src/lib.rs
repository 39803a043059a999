//! proxy-wasm filter (issue 4).

//! The page's entry points (wasm-bindgen). JSON in, JSON out: the page stays plain JavaScript.

use wasm_bindgen::prelude::*;

use crate::replay::{ReplayRequest, run_json};

/// Runs one policy's replay. `request` is a [`ReplayRequest`] as JSON; `trace` is the text of the
/// trace slice the workload needs (empty for RL). Returns the [`crate::replay::ReplayResult`] as JSON,
/// or throws an error message.
#[wasm_bindgen]
pub fn run_replay(request: &str, trace: &str) -> Result<String, JsValue> {
    let req: ReplayRequest =
        serde_json::from_str(request).map_err(|e| JsValue::from_str(&format!("request: {e}")))?;
    run_json(&req, trace).map_err(|e| JsValue::from_str(&e))
}

/// The policy names the core accepts, in the core's order.
#[wasm_bindgen]
pub fn policies() -> String {
    crate::replay::policy_names().join(",")
}

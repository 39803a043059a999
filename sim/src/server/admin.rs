//! `POST /admin/fault`: the knobs tests and benchmarks turn to make a replica misbehave (restart,
//! slow down, fail requests, lose its feed).

use super::Shared;
use super::api::ApiError;
use serde_json::{Value, json};

/// Fault knobs set through `POST /admin/fault`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Fraction of generation requests answered with HTTP 500.
    pub error_rate: f64,
    /// The feed answers 503 while set.
    pub feed_outage: bool,
}

/// Applies a JSON object of faults (`restart`, `slowdown`, `error_rate`, `feed_outage`) and answers
/// the knobs' values after it. A bad field is refused with the fields before it already applied,
/// as the replica always did.
pub(super) fn set_faults(shared: &Shared, body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("malformed JSON: {e}")))?;
    let Some(obj) = v.as_object() else {
        return Err(ApiError::bad("body", "expected a JSON object"));
    };
    let mut g = shared.lock();
    for (k, v) in obj {
        match k.as_str() {
            "restart" => match v.as_bool() {
                Some(true) => {
                    let now = shared.clock.now_us();
                    for e in g.engines.iter_mut() {
                        e.restart(now);
                    }
                }
                Some(false) => {}
                None => return Err(ApiError::bad("restart", "restart must be a boolean")),
            },
            "slowdown" => match v.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => {
                    for e in g.engines.iter_mut() {
                        e.set_slowdown(f);
                    }
                }
                _ => {
                    return Err(ApiError::bad(
                        "slowdown",
                        "slowdown must be a positive number",
                    ));
                }
            },
            "error_rate" => match v.as_f64() {
                Some(f) if (0.0..=1.0).contains(&f) => g.faults.error_rate = f,
                _ => {
                    return Err(ApiError::bad(
                        "error_rate",
                        "error_rate must be a number in [0, 1]",
                    ));
                }
            },
            "feed_outage" => match v.as_bool() {
                Some(b) => g.faults.feed_outage = b,
                None => {
                    return Err(ApiError::bad(
                        "feed_outage",
                        "feed_outage must be a boolean",
                    ));
                }
            },
            _ => {
                return Err(ApiError::bad(
                    "body",
                    format!(
                        "unknown fault {k:?}; known: restart, slowdown, error_rate, feed_outage"
                    ),
                ));
            }
        }
    }
    shared.cv.notify_all();
    Ok(
        json!({"epoch": g.engines[0].epoch(), "slowdown": g.engines[0].slowdown(),
        "error_rate": g.faults.error_rate, "feed_outage": g.faults.feed_outage}),
    )
}

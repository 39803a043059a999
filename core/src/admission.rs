//! Admission at saturation: a priority class per request, and shedding the requests whose predicted
//! wait exceeds their class's bound (docs/design/admission.md).
//!
//! Routing alone can only pick the least bad queue once every replica is saturated: every request is
//! admitted and every request waits, the ones that matter included. Shedding answers a request the
//! fleet cannot serve in time at once (HTTP 429 with `Retry-After`), so the client can back off or go
//! elsewhere, and the requests that stay keep their time to first token. The bound is in seconds of
//! predicted wait, the one figure an operator can set from a service objective, not in queued tokens.
//!
//! This module is pure: the class from a header value and the model, the bound check, `Retry-After`
//! and the error body. The filter reads the header, calls it, and sends the local response.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;

use crate::config::{ConfigError, PolicyKind};
use crate::load::LoadTotals;
use crate::policy::kv_time::Terms;
use crate::speed::EngineProfile;

/// A request's priority class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// Never shed.
    Critical,
    /// Shed past its bound (10 s by default).
    Standard,
    /// Shed first: its bound is the shortest (2 s by default).
    Sheddable,
}

/// Longest header value read as a class name: longer values are not a class, whatever they hold.
pub const MAX_CLASS_VALUE_BYTES: usize = 32;

/// Most entries in `admission.model_classes`.
pub const MAX_MODEL_CLASSES: usize = 4096;

/// Longest model name in `admission.model_classes` (bytes).
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// Longest `Retry-After` the filter sends, whatever `retry_after_max_s` says (an hour).
pub const MAX_RETRY_AFTER_S: u32 = 3600;

impl Class {
    pub const ALL: [Class; 3] = [Class::Critical, Class::Standard, Class::Sheddable];

    pub const fn name(self) -> &'static str {
        match self {
            Class::Critical => "critical",
            Class::Standard => "standard",
            Class::Sheddable => "sheddable",
        }
    }

    /// Position in [`Class::ALL`], for per-class counters.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// A class by its name as the configuration writes it (exact, lower case).
    pub fn from_name(name: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == name)
    }

    /// A class from a header value: its name, ASCII case ignored, surrounding spaces and tabs
    /// trimmed. Anything else (longer than [`MAX_CLASS_VALUE_BYTES`], not UTF-8, another word) is
    /// no class: a hostile value costs a bounded comparison and never an error.
    pub fn from_header(value: &[u8]) -> Option<Class> {
        if value.len() > MAX_CLASS_VALUE_BYTES {
            return None;
        }
        let v = value.trim_ascii();
        Class::ALL
            .into_iter()
            .find(|c| c.name().as_bytes().eq_ignore_ascii_case(v))
    }

    /// The bound a class has when `admission.bounds_s` does not name it.
    const fn default_bound_s(self) -> Option<f64> {
        match self {
            Class::Critical => None,
            Class::Standard => Some(10.0),
            Class::Sheddable => Some(2.0),
        }
    }
}

/// The `routing.admission` section as written (docs/reference/configuration.md). Absent, nothing
/// is classed or shed.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// A request header naming the class (`critical`, `standard`, `sheddable`). Absent: classes
    /// come from the model table and the default only.
    pub priority_header: Option<String>,
    /// Whether the header is believed. A client could otherwise mark all its traffic critical, so
    /// by default a client's copy is removed before the request goes upstream (and counted), as the
    /// destination header's is; set it only where the operator's own route writes the header.
    pub trust_priority_header: bool,
    /// Model name (the body's `model`, exact) to class name.
    pub model_classes: BTreeMap<String, String>,
    /// The class of a request neither the header nor the table classes.
    pub default_class: String,
    /// Per class: the longest predicted wait (s) a request of it is admitted with; `null`: never
    /// shed. Classes not named keep their default (standard 10, sheddable 2, critical never).
    pub bounds_s: BTreeMap<String, Option<f64>>,
    /// `Retry-After` is the predicted wait rounded up, at least 1 and at most this (s).
    pub retry_after_max_s: u32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            priority_header: None,
            trust_priority_header: false,
            model_classes: BTreeMap::new(),
            default_class: Class::Standard.name().to_string(),
            bounds_s: BTreeMap::new(),
            retry_after_max_s: 60,
        }
    }
}

fn err(field: String, message: impl Into<String>) -> ConfigError {
    ConfigError::routing(field, message)
}

fn class_field(field: String, name: &str) -> Result<Class, ConfigError> {
    Class::from_name(name).ok_or_else(|| {
        err(
            field,
            format!("unknown class {name:?} (known: critical, standard, sheddable)"),
        )
    })
}

/// A header name a proxy accepts and the filter can compare: lower-case token characters, not a
/// pseudo-header.
fn valid_header_name(s: &str) -> bool {
    (1..=128).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl AdmissionConfig {
    /// Checks every field; errors name it by its path under `routing` (`admission.bounds_s.urgent`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(h) = &self.priority_header
            && !valid_header_name(h)
        {
            return Err(err(
                "admission.priority_header".into(),
                format!("{h:?} must be 1-128 of [a-z0-9_-] (a lower-case header name)"),
            ));
        }
        if self.trust_priority_header && self.priority_header.is_none() {
            return Err(err(
                "admission.trust_priority_header".into(),
                "set without admission.priority_header: no header to trust",
            ));
        }
        class_field("admission.default_class".into(), &self.default_class)?;
        if self.model_classes.len() > MAX_MODEL_CLASSES {
            return Err(err(
                "admission.model_classes".into(),
                format!(
                    "at most {MAX_MODEL_CLASSES} models, got {}",
                    self.model_classes.len()
                ),
            ));
        }
        for (model, class) in &self.model_classes {
            let field = format!("admission.model_classes.{model}");
            if model.is_empty() || model.len() > MAX_MODEL_NAME_BYTES {
                return Err(err(
                    field,
                    format!("a model name must be 1-{MAX_MODEL_NAME_BYTES} bytes"),
                ));
            }
            class_field(field, class)?;
        }
        for (name, bound) in &self.bounds_s {
            let field = format!("admission.bounds_s.{name}");
            let class = class_field(field.clone(), name)?;
            match (class, bound) {
                (_, None) => {}
                (Class::Critical, Some(_)) => {
                    return Err(err(
                        field,
                        "critical requests are never shed: use null or omit it",
                    ));
                }
                (_, Some(b)) if !(b.is_finite() && *b > 0.0) => {
                    return Err(err(
                        field,
                        format!("must be a finite number of seconds > 0 (or null), got {b}"),
                    ));
                }
                _ => {}
            }
        }
        if !(1..=MAX_RETRY_AFTER_S).contains(&self.retry_after_max_s) {
            return Err(err(
                "admission.retry_after_max_s".into(),
                format!(
                    "must be 1..={MAX_RETRY_AFTER_S}, got {}",
                    self.retry_after_max_s
                ),
            ));
        }
        Ok(())
    }
}

/// What the bound check says about a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    Admit,
    Shed(Shed),
}

/// A request refused for its predicted wait.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shed {
    pub class: Class,
    /// The predicted wait on the replica the policy chose (s).
    pub wait_s: f64,
    /// Its class's bound (s).
    pub bound_s: f64,
    /// The `Retry-After` to send (s).
    pub retry_after_s: u32,
}

impl Shed {
    /// The 429's body, in the OpenAI error shape clients already parse for rate limits.
    pub fn body(&self) -> Vec<u8> {
        let message = format!(
            "kvsteer: the fleet is saturated: a {} request would wait about {:.1} s for its \
             prefill to start, over its bound of {} s; retry after {} s",
            self.class.name(),
            self.wait_s,
            self.bound_s,
            self.retry_after_s
        );
        serde_json::to_vec(&serde_json::json!({"error": {
            "message": message,
            "type": "rate_limit_exceeded",
            "code": 429,
        }}))
        .unwrap_or_default()
    }
}

/// `Retry-After` for a predicted wait: rounded up to whole seconds, at least 1 (0 would invite an
/// immediate retry into the same queue), at most `max_s`; a wait that is not a number gets `max_s`.
pub fn retry_after_s(wait_s: f64, max_s: u32) -> u32 {
    let max_s = max_s.max(1);
    if wait_s.is_nan() {
        return max_s;
    }
    (wait_s.ceil().clamp(1.0, max_s as f64)) as u32
}

/// The predicted wait (s) before `replica` starts this request's prefill. Under `kv_time` it is the
/// policy's own `wait` term for the replica (queued prefill at its learned speed, and the time for
/// room in its cache). Under the other policies it is the replica's queued prefill as the load
/// table holds it, converted to seconds with the engine profile's linear-layer time per token and
/// the replica's learned speed (1 unless `kv_time` learns it): a lower bound, since it leaves out
/// attention over long contexts (unless `kv_load.queue_in_time` books it) and waiting for cache
/// room. 0 for a replica out of range: never shed for want of a figure.
pub fn predicted_wait_s(
    policy: PolicyKind,
    replica: usize,
    terms: &[Terms],
    load: &[LoadTotals],
    profile: &EngineProfile,
    speed: f64,
) -> f64 {
    if policy == PolicyKind::KvTime
        && let Some(t) = terms.get(replica)
    {
        return t.wait;
    }
    load.get(replica)
        .map_or(0.0, |l| speed * profile.work_s(l.prefill_tokens as f64))
}

/// [`AdmissionConfig`] resolved for use per request.
#[derive(Clone, Debug)]
pub struct Admission {
    priority_header: Option<String>,
    trust: bool,
    models: HashMap<String, Class>,
    default_class: Class,
    bounds: [Option<f64>; 3],
    retry_after_max_s: u32,
}

impl Admission {
    /// From a validated section (a value [`AdmissionConfig::validate`] refuses falls back to its
    /// default here rather than failing).
    pub fn new(cfg: &AdmissionConfig) -> Admission {
        let mut bounds = Class::ALL.map(Class::default_bound_s);
        for (name, b) in &cfg.bounds_s {
            if let Some(c) = Class::from_name(name)
                && c != Class::Critical
            {
                bounds[c.index()] = b.filter(|b| b.is_finite() && *b > 0.0);
            }
        }
        Admission {
            priority_header: cfg.priority_header.clone(),
            trust: cfg.trust_priority_header,
            models: cfg
                .model_classes
                .iter()
                .filter_map(|(m, c)| Some((m.clone(), Class::from_name(c)?)))
                .collect(),
            default_class: Class::from_name(&cfg.default_class).unwrap_or(Class::Standard),
            bounds,
            retry_after_max_s: cfg.retry_after_max_s.clamp(1, MAX_RETRY_AFTER_S),
        }
    }

    /// The configured priority header.
    pub fn priority_header(&self) -> Option<&str> {
        self.priority_header.as_deref()
    }

    /// Whether a client's copy of the priority header is to be believed (else removed).
    pub fn trusts_header(&self) -> bool {
        self.trust
    }

    /// The class a priority header's value names, only when the header is trusted.
    pub fn header_class(&self, value: &[u8]) -> Option<Class> {
        if !self.trust || self.priority_header.is_none() {
            return None;
        }
        Class::from_header(value)
    }

    /// A request's class: the trusted header's, else its model's in the table, else the default.
    pub fn class(&self, header: Option<Class>, model: Option<&str>) -> Class {
        header
            .or_else(|| model.and_then(|m| self.models.get(m).copied()))
            .unwrap_or(self.default_class)
    }

    /// The class's bound (s); `None`: never shed.
    pub fn bound_s(&self, class: Class) -> Option<f64> {
        self.bounds[class.index()]
    }

    /// Whether a request of `class` whose chosen replica's predicted wait is `wait_s` is admitted.
    /// A wait that is not a number admits (the prediction failed, not the fleet).
    pub fn check(&self, class: Class, wait_s: f64) -> Verdict {
        match self.bound_s(class) {
            Some(bound_s) if wait_s > bound_s => Verdict::Shed(Shed {
                class,
                wait_s,
                bound_s,
                retry_after_s: retry_after_s(wait_s, self.retry_after_max_s),
            }),
            _ => Verdict::Admit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(json: &str) -> Result<AdmissionConfig, ConfigError> {
        let full = format!(r#"{{"admission":{json}}}"#);
        let cfg = crate::RoutingConfig::from_json(&full)?;
        Ok(cfg.admission.expect("section present"))
    }

    #[test]
    fn classes_from_header_values_are_bounded_and_forgiving() {
        assert_eq!(Class::from_header(b"critical"), Some(Class::Critical));
        assert_eq!(Class::from_header(b" Sheddable\t"), Some(Class::Sheddable));
        assert_eq!(Class::from_header(b"STANDARD"), Some(Class::Standard));
        assert_eq!(Class::from_header(b"urgent"), None);
        assert_eq!(Class::from_header(b""), None);
        assert_eq!(Class::from_header(&[0xff, 0xfe, 0x00]), None);
        let long = [b' '; MAX_CLASS_VALUE_BYTES + 1];
        assert_eq!(Class::from_header(&long), None);
        let mut padded = vec![b' '; MAX_CLASS_VALUE_BYTES - 8];
        padded.extend_from_slice(b"critical");
        assert_eq!(Class::from_header(&padded), Some(Class::Critical));
    }

    #[test]
    fn the_header_counts_only_when_trusted() {
        let trusted = Admission::new(
            &section(r#"{"priority_header":"x-priority","trust_priority_header":true}"#).unwrap(),
        );
        assert_eq!(trusted.header_class(b"critical"), Some(Class::Critical));
        let untrusted = Admission::new(&section(r#"{"priority_header":"x-priority"}"#).unwrap());
        assert!(!untrusted.trusts_header());
        assert_eq!(untrusted.header_class(b"critical"), None);
        assert_eq!(untrusted.class(None, None), Class::Standard);
    }

    #[test]
    fn class_is_header_then_model_then_default() {
        let a = Admission::new(
            &section(
                r#"{"priority_header":"x-priority","trust_priority_header":true,
                    "model_classes":{"batch-8b":"sheddable","prod-70b":"critical"},
                    "default_class":"sheddable"}"#,
            )
            .unwrap(),
        );
        assert_eq!(
            a.class(Some(Class::Standard), Some("prod-70b")),
            Class::Standard
        );
        assert_eq!(a.class(None, Some("prod-70b")), Class::Critical);
        assert_eq!(a.class(None, Some("batch-8b")), Class::Sheddable);
        assert_eq!(a.class(None, Some("other")), Class::Sheddable);
        assert_eq!(a.class(None, None), Class::Sheddable);
    }

    #[test]
    fn bounds_default_per_class_and_critical_is_never_shed() {
        let a = Admission::new(&section("{}").unwrap());
        assert_eq!(a.bound_s(Class::Critical), None);
        assert_eq!(a.bound_s(Class::Standard), Some(10.0));
        assert_eq!(a.bound_s(Class::Sheddable), Some(2.0));
        assert_eq!(a.check(Class::Critical, 1e9), Verdict::Admit);
        assert_eq!(
            a.check(Class::Sheddable, 2.0),
            Verdict::Admit,
            "at the bound"
        );
        assert_eq!(a.check(Class::Sheddable, f64::NAN), Verdict::Admit);
        let Verdict::Shed(s) = a.check(Class::Sheddable, 2.3) else {
            panic!("over the bound")
        };
        assert_eq!(
            (s.class, s.bound_s, s.retry_after_s),
            (Class::Sheddable, 2.0, 3)
        );
        assert_eq!(a.check(Class::Standard, 9.0), Verdict::Admit);
        // A class named keeps the others' defaults; null never sheds it.
        let a =
            Admission::new(&section(r#"{"bounds_s":{"standard":null,"sheddable":5}}"#).unwrap());
        assert_eq!(a.bound_s(Class::Standard), None);
        assert_eq!(a.bound_s(Class::Sheddable), Some(5.0));
        assert_eq!(a.check(Class::Standard, 1e6), Verdict::Admit);
    }

    #[test]
    fn retry_after_is_whole_seconds_between_one_and_the_cap() {
        assert_eq!(retry_after_s(0.0, 60), 1);
        assert_eq!(retry_after_s(0.2, 60), 1);
        assert_eq!(retry_after_s(2.0, 60), 2);
        assert_eq!(retry_after_s(2.01, 60), 3);
        assert_eq!(retry_after_s(1e12, 60), 60);
        assert_eq!(retry_after_s(f64::INFINITY, 30), 30);
        assert_eq!(retry_after_s(f64::NAN, 30), 30);
        assert_eq!(retry_after_s(-4.0, 30), 1);
        assert_eq!(retry_after_s(5.0, 0), 1, "a zero cap still says 1");
        let a = Admission::new(&section(r#"{"retry_after_max_s":4}"#).unwrap());
        let Verdict::Shed(s) = a.check(Class::Standard, 50.0) else {
            panic!("over the bound")
        };
        assert_eq!(s.retry_after_s, 4);
    }

    #[test]
    fn the_body_is_an_openai_error() {
        let s = Shed {
            class: Class::Sheddable,
            wait_s: 7.25,
            bound_s: 2.0,
            retry_after_s: 8,
        };
        let v: serde_json::Value = serde_json::from_slice(&s.body()).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_exceeded");
        assert_eq!(v["error"]["code"], 429);
        let m = v["error"]["message"].as_str().unwrap();
        assert!(
            m.contains("sheddable") && m.contains("7.2") && m.contains("8 s"),
            "{m}"
        );
    }

    #[test]
    fn the_wait_is_kv_times_term_or_the_queue_in_seconds() {
        let profile = EngineProfile::default();
        let terms = vec![
            Terms {
                wait: 0.5,
                prefill: 1.0,
                decode: 0.0,
                stall: 0.0,
                evict: 0.0,
                adapter: 0.0,
                later: 0.0,
            };
            2
        ];
        let load = vec![
            LoadTotals {
                prefill_tokens: 100_000,
                ..LoadTotals::default()
            },
            LoadTotals::default(),
        ];
        assert_eq!(
            predicted_wait_s(PolicyKind::KvTime, 0, &terms, &load, &profile, 1.0),
            0.5
        );
        // 100,000 tokens at 27 us a token: 2.7 s; twice that at half speed.
        let w = predicted_wait_s(PolicyKind::KvLoad, 0, &[], &load, &profile, 1.0);
        assert!((w - 2.7).abs() < 1e-9, "{w}");
        let w2 = predicted_wait_s(PolicyKind::RoundRobin, 0, &[], &load, &profile, 2.0);
        assert!((w2 - 5.4).abs() < 1e-9, "{w2}");
        assert_eq!(
            predicted_wait_s(PolicyKind::KvLoad, 1, &[], &load, &profile, 1.0),
            0.0
        );
        assert_eq!(
            predicted_wait_s(PolicyKind::KvLoad, 9, &[], &load, &profile, 1.0),
            0.0
        );
        // kv_time without terms for the replica (a fallback decision): the queue in seconds.
        let w3 = predicted_wait_s(PolicyKind::KvTime, 0, &[], &load, &profile, 1.0);
        assert!((w3 - 2.7).abs() < 1e-9, "{w3}");
    }

    #[test]
    fn errors_name_the_field() {
        let field = |json: &str| section(json).unwrap_err().field;
        assert_eq!(
            field(r#"{"bounds_s":{"urgent":3}}"#),
            "admission.bounds_s.urgent"
        );
        assert_eq!(
            field(r#"{"bounds_s":{"standard":0}}"#),
            "admission.bounds_s.standard"
        );
        assert_eq!(
            field(r#"{"bounds_s":{"standard":-1}}"#),
            "admission.bounds_s.standard"
        );
        assert_eq!(
            field(r#"{"bounds_s":{"critical":30}}"#),
            "admission.bounds_s.critical"
        );
        assert_eq!(
            field(r#"{"model_classes":{"m":"gold"}}"#),
            "admission.model_classes.m"
        );
        assert_eq!(
            field(r#"{"default_class":"Critical"}"#),
            "admission.default_class"
        );
        assert_eq!(
            field(r#"{"priority_header":"X Priority"}"#),
            "admission.priority_header"
        );
        assert_eq!(
            field(r#"{"trust_priority_header":true}"#),
            "admission.trust_priority_header"
        );
        assert_eq!(
            field(r#"{"retry_after_max_s":0}"#),
            "admission.retry_after_max_s"
        );
        assert_eq!(field(r#"{"bound":1}"#), "admission.bound");
        let e = section(r#"{"model_classes":{"m":"gold"}}"#).unwrap_err();
        assert!(e.to_string().contains("unknown class \"gold\""), "{e}");
        // A bound that is not a number is refused by its type, naming the field.
        assert_eq!(
            field(r#"{"bounds_s":{"standard":"10"}}"#),
            "admission.bounds_s.standard"
        );
        // Absent: no section at all.
        assert!(
            crate::RoutingConfig::from_json("{}")
                .unwrap()
                .admission
                .is_none()
        );
    }
}

//! Admission before booking (`routing.admission`, docs/design/admission.md): a request is classed
//! and routed, and when its replica's predicted wait exceeds its class's bound it is refused with
//! nothing booked, so a shed request never touches the load table.

use super::{BodyFallback, WorkerState};
use crate::config::FilterConfig;
use kvsteer_core::PolicyKind;
use kvsteer_core::admission::{self, Admission, Class, Shed, Verdict};
use kvsteer_core::request::EarlyScan;
use kvsteer_core::router::{Decision, Router};
use kvsteer_core::speed::EngineProfile;

/// Priority classes and shedding (`routing.admission`), and their counters.
#[derive(Clone, Debug)]
pub struct AdmissionGate {
    /// `None`: every request is admitted.
    admission: Option<Admission>,
    /// The engine profile that converts queued prefill into seconds for shedding under a policy
    /// other than `kv_time` (`routing.kv_time.profile`).
    profile: EngineProfile,
    /// Per class, in [`Class::ALL`] order: requests admitted, and shed.
    admitted: [u64; 3],
    shed: [u64; 3],
    /// Client copies of an untrusted priority header removed.
    priority_headers_removed: u64,
}

impl AdmissionGate {
    pub fn new(cfg: &FilterConfig) -> AdmissionGate {
        AdmissionGate {
            admission: cfg.routing.admission.as_ref().map(Admission::new),
            profile: cfg.routing.kv_time.profile.profile(),
            admitted: [0; 3],
            shed: [0; 3],
            priority_headers_removed: 0,
        }
    }

    /// Whether a request is classed and judged at all (`routing.admission` configured).
    pub fn configured(&self) -> bool {
        self.admission.is_some()
    }

    /// A request of `class` was admitted (booked).
    pub fn admitted(&mut self, class: Class) {
        self.admitted[class.index()] += 1;
    }

    /// The class of a request with this trusted header's class and model.
    pub fn class_of(&self, header: Option<Class>, model: Option<&str>) -> Class {
        self.admission
            .as_ref()
            .map_or(Class::Standard, |a| a.class(header, model))
    }

    /// `Err` when the decision's predicted wait exceeds the class's bound (counted). A health
    /// probe is always admitted: shedding it would leave its ejected replica unprobed.
    pub fn judge(
        &mut self,
        class: Class,
        d: &Decision,
        router: &Router,
        policy: PolicyKind,
    ) -> Result<(), Shed> {
        let Some(adm) = &self.admission else {
            return Ok(());
        };
        if d.probe || adm.bound_s(class).is_none() {
            return Ok(());
        }
        let load = if policy == PolicyKind::KvTime && d.fallback.is_none() {
            Vec::new()
        } else {
            router.effective_load()
        };
        let terms = if d.fallback.is_none() {
            router.last_terms()
        } else {
            &[]
        };
        let wait = admission::predicted_wait_s(
            policy,
            d.replica,
            terms,
            &load,
            &self.profile,
            router.speed_factor(d.replica),
        );
        match adm.check(class, wait) {
            Verdict::Admit => Ok(()),
            Verdict::Shed(s) => {
                self.shed[class.index()] += 1;
                Err(s)
            }
        }
    }
}

impl WorkerState {
    /// Priority classes and shedding, when configured.
    pub fn admission(&self) -> Option<&Admission> {
        self.admission.admission.as_ref()
    }

    /// A client's copy of an untrusted priority header was removed.
    pub fn priority_header_removed(&mut self) {
        self.admission.priority_headers_removed += 1;
    }

    /// Per class in [`Class::ALL`] order: (admitted, shed); and untrusted priority headers removed.
    pub fn admission_counts(&self) -> ([u64; 3], [u64; 3], u64) {
        let a = &self.admission;
        (a.admitted, a.shed, a.priority_headers_removed)
    }

    /// [`WorkerState::route_body_early`] with admission: with `routing.admission` the request is
    /// classed (the trusted header's class `header`, else its model's, else the default) and, when
    /// the chosen replica's predicted wait exceeds its class's bound, refused with nothing booked
    /// (`Err`, for the filter's 429). Without the section, exactly `route_body_early`.
    #[allow(clippy::too_many_arguments)]
    pub fn route_body_admitted(
        &mut self,
        request_id: u64,
        path: &str,
        body: &[u8],
        session: Option<&str>,
        early: Option<EarlyScan>,
        header: Option<Class>,
        now_ms: u64,
    ) -> Result<Decision, Shed> {
        if !self.admission.configured() || self.pd.disaggregated() {
            return Ok(self.route_body_early(request_id, path, body, session, early, now_ms));
        }
        if body.len() > self.cfg.routing.max_body_bytes {
            return self.route_fallback_admitted(
                request_id,
                BodyFallback::TooLarge,
                body.len(),
                header,
                now_ms,
            );
        }
        let tok = self.prompts.tokenizer();
        let r = &self.cfg.routing;
        let read = kvsteer_core::request::read_request_early(
            path,
            body,
            session,
            r.block_size,
            r.max_body_bytes,
            tok,
            early,
            r.adapters.as_ref(),
        );
        let req = match read {
            Ok(req) => req,
            Err(_) => {
                self.counters.fallback(BodyFallback::Unreadable);
                return self.admit_unread_or_shed(request_id, body.len(), header, now_ms);
            }
        };
        // Route, judge, and only then book: a shed request never touches the load table.
        let d = self.router.route(&req, now_ms);
        let class = self.admission.class_of(header, req.model.as_deref());
        let policy = self.cfg.routing.policy;
        self.admission.judge(class, &d, &self.router, policy)?;
        self.router.admit(request_id, &req, &d, now_ms);
        self.counters.booked(1);
        self.admission.admitted(class);
        Ok(d)
    }

    /// [`WorkerState::route_fallback`] with admission (see [`WorkerState::route_body_admitted`]):
    /// a request routed without its body is classed by the trusted header or the default (its model
    /// is unknown) and judged by the same bound.
    pub fn route_fallback_admitted(
        &mut self,
        request_id: u64,
        why: BodyFallback,
        body_bytes: usize,
        header: Option<Class>,
        now_ms: u64,
    ) -> Result<Decision, Shed> {
        if !self.admission.configured() || self.pd.disaggregated() {
            return Ok(self.route_fallback(request_id, why, body_bytes, now_ms));
        }
        self.counters.fallback(why);
        self.admit_unread_or_shed(request_id, body_bytes, header, now_ms)
    }

    fn admit_unread_or_shed(
        &mut self,
        request_id: u64,
        body_bytes: usize,
        header: Option<Class>,
        now_ms: u64,
    ) -> Result<Decision, Shed> {
        let d = self.router.route_fallback(now_ms);
        let class = self.admission.class_of(header, None);
        let policy = self.cfg.routing.policy;
        self.admission.judge(class, &d, &self.router, policy)?;
        self.router
            .admit_unread(request_id, &d, (body_bytes / 4) as u64);
        self.counters.booked(1);
        self.admission.admitted(class);
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::testing::*;

    #[test]
    fn a_shed_request_books_nothing_and_critical_ones_always_pass() {
        for policy in ["kv_load", "kv_time", "round_robin"] {
            let mut w = worker_routing(&format!(
                r#"{{"policy":"{policy}","admission":{{"bounds_s":{{"sheddable":0.5}},
                    "model_classes":{{"batch":"sheddable"}}}}}}"#
            ));
            let body = |model: &str, id: u32| {
                let prompt: Vec<u32> = (0..40_000).map(|i| i * 7 + id).collect();
                format!(r#"{{"model":"{model}","prompt":{prompt:?},"max_tokens":8}}"#)
            };
            // Critical requests pile 40,000-token prefills on both replicas: never shed.
            for id in 0..6u64 {
                let b = body("prod", id as u32);
                let d = w.route_body_admitted(
                    id,
                    "/v1/completions",
                    b.as_bytes(),
                    None,
                    None,
                    Some(Class::Critical),
                    0,
                );
                assert!(d.is_ok(), "{policy}: critical request {id} shed");
            }
            let before = w.bookings();
            let active = w.stats().active_requests;
            let b = body("batch", 99);
            let shed = w
                .route_body_admitted(99, "/v1/completions", b.as_bytes(), None, None, None, 0)
                .expect_err("a sheddable request behind 2 x 120,000 queued tokens");
            assert_eq!(shed.class, Class::Sheddable, "{policy}");
            assert!(
                shed.wait_s > 0.5 && shed.retry_after_s >= 1,
                "{policy}: {shed:?}"
            );
            assert_eq!(w.bookings(), before, "{policy}: nothing booked");
            assert_eq!(w.stats().active_requests, active, "{policy}");
            assert!(!w.release(99), "{policy}: nothing to release");
            // Unread bodies are judged too (by the header or the default class).
            let unread = w.route_body_admitted(
                100,
                "/v1/completions",
                b"{not json",
                None,
                None,
                Some(Class::Sheddable),
                0,
            );
            assert!(unread.is_err(), "{policy}");
            let (admitted, shed, _) = w.admission_counts();
            assert_eq!(admitted, [6, 0, 0], "{policy}");
            assert_eq!(shed, [0, 0, 2], "{policy}");
            for id in 0..6 {
                assert!(w.release(id), "{policy}");
            }
            let (booked, released) = w.bookings();
            assert_eq!(booked, released, "{policy}");
            // An idle fleet admits the sheddable request.
            assert!(
                w.route_body_admitted(101, "/v1/completions", b.as_bytes(), None, None, None, 0)
                    .is_ok(),
                "{policy}"
            );
        }
    }

    /// The gate alone: classes from the header, then the model, then the default; a probe is
    /// never judged; without the section everything is standard and admitted.
    #[test]
    fn the_gate_classes_and_never_sheds_a_probe() {
        let mut w = worker_routing(
            r#"{"policy":"kv_load","admission":{"bounds_s":{"sheddable":0.5},
                "model_classes":{"batch":"sheddable"}}}"#,
        );
        let mut gate = AdmissionGate::new(w.config());
        assert!(gate.configured());
        assert_eq!(gate.class_of(None, Some("batch")), Class::Sheddable);
        assert_eq!(
            gate.class_of(Some(Class::Critical), Some("batch")),
            Class::Critical
        );
        let mut d = w.router.route_fallback(0);
        d.probe = true;
        let policy = w.config().routing.policy;
        assert!(gate.judge(Class::Sheddable, &d, &w.router, policy).is_ok());
        gate.admitted(Class::Sheddable);
        assert_eq!((gate.admitted, gate.shed), ([0, 0, 1], [0; 3]));
        let plain = AdmissionGate::new(worker("kv_load").config());
        assert!(!plain.configured());
        assert_eq!(plain.class_of(None, Some("batch")), Class::Standard);
    }

    #[test]
    fn without_the_section_nothing_is_classed() {
        let mut w = worker("kv_load");
        assert!(w.admission().is_none());
        let body = br#"{"model":"m","prompt":"hello there"}"#;
        let d = w.route_body_admitted(1, "/v1/completions", body, None, None, None, 0);
        assert!(d.is_ok());
        assert_eq!(w.admission_counts(), ([0; 3], [0; 3], 0));
        assert_eq!(w.bookings(), (1, 0));
    }
}

//! Admission before booking (`routing.admission`, docs/design/admission.md): a request is classed
//! and routed, and when its replica's predicted wait exceeds its class's bound it is refused with
//! nothing booked, so a shed request never touches the load table.

use super::{BodyFallback, WorkerState};
use kvsteer_core::admission::{self, Admission, Class, Shed, Verdict};
use kvsteer_core::request::EarlyScan;
use kvsteer_core::router::Decision;

impl WorkerState {
    /// Priority classes and shedding, when configured.
    pub fn admission(&self) -> Option<&Admission> {
        self.admission.as_ref()
    }

    /// A client's copy of an untrusted priority header was removed.
    pub fn priority_header_removed(&mut self) {
        self.priority_headers_removed += 1;
    }

    /// Per class in [`Class::ALL`] order: (admitted, shed); and untrusted priority headers removed.
    pub fn admission_counts(&self) -> ([u64; 3], [u64; 3], u64) {
        (self.admitted, self.shed, self.priority_headers_removed)
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
        if self.admission.is_none() || self.disaggregated {
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
        let tok = prompt_tokenizer!(self);
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
                self.body_fallbacks[BodyFallback::Unreadable as usize] += 1;
                return self.admit_unread_or_shed(request_id, body.len(), header, now_ms);
            }
        };
        // Route, judge, and only then book: a shed request never touches the load table.
        let d = self.router.route(&req, now_ms);
        let class = self.class_of(header, req.model.as_deref());
        self.judge(class, &d)?;
        self.router.admit(request_id, &req, &d, now_ms);
        self.bookings += 1;
        self.admitted[class.index()] += 1;
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
        if self.admission.is_none() || self.disaggregated {
            return Ok(self.route_fallback(request_id, why, body_bytes, now_ms));
        }
        self.body_fallbacks[why as usize] += 1;
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
        let class = self.class_of(header, None);
        self.judge(class, &d)?;
        self.router
            .admit_unread(request_id, &d, (body_bytes / 4) as u64);
        self.bookings += 1;
        self.admitted[class.index()] += 1;
        Ok(d)
    }

    fn class_of(&self, header: Option<Class>, model: Option<&str>) -> Class {
        self.admission
            .as_ref()
            .map_or(Class::Standard, |a| a.class(header, model))
    }

    /// `Err` when the decision's predicted wait exceeds the class's bound (counted). A health
    /// probe is always admitted: shedding it would leave its ejected replica unprobed.
    fn judge(&mut self, class: Class, d: &Decision) -> Result<(), Shed> {
        let Some(adm) = &self.admission else {
            return Ok(());
        };
        if d.probe || adm.bound_s(class).is_none() {
            return Ok(());
        }
        let policy = self.cfg.routing.policy;
        let load = if policy == kvsteer_core::PolicyKind::KvTime && d.fallback.is_none() {
            Vec::new()
        } else {
            self.router.effective_load()
        };
        let terms = if d.fallback.is_none() {
            self.router.last_terms()
        } else {
            &[]
        };
        let wait = admission::predicted_wait_s(
            policy,
            d.replica,
            terms,
            &load,
            &self.profile,
            self.router.speed_factor(d.replica),
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

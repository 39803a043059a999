//! A request's way through the proxy, phase by phase, as a client's would go: the request phase
//! (headers, body chunks, trailers) through one worker; the filter's decision (answer locally, hold
//! the request, or release it); and, once released, the upstream: the replica's engine, or the
//! replica's fault, or a refusal. The response phase is in `response.rs`; where a released request
//! goes is in `destination.rs`.

use super::destination::Placement;
use super::response::Flight;
use super::{Harness, HarnessError, ProxyAnswer, RequestRecord, RequestSpec, ResponseFault};
use crate::abi::Pairs;
use crate::host::{HostError, StreamState};
use crate::openai::{SseWriter, completion_body_for, error_response, request_headers, sse_headers};
use kvsteer_sim::EngineRequest;
use serde_json::Value;

/// A request the filter has not released yet.
pub(super) struct Paused {
    pub(super) id: u64,
    worker: usize,
    stream: u32,
    spec: RequestSpec,
    from_driver: bool,
}

impl Harness {
    /// Sends a request through the filter at the current virtual time. Returns its id.
    pub fn send(&mut self, spec: &RequestSpec) -> Result<u64, HarnessError> {
        let id = self.next_id;
        self.next_id += 1;
        self.send_with_id(id, spec, false)?;
        Ok(id)
    }

    /// Sends request `id` (the driver's own id for a driven request, whose issue the driver has
    /// already recorded) and carries it as far as the filter lets it go now.
    pub(super) fn send_with_id(
        &mut self,
        id: u64,
        spec: &RequestSpec,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        self.set_now(self.now_us);
        let w = self.pick_worker(spec)?;
        self.stats.requests += 1;
        let body = match &spec.raw_body {
            Some(b) => b.clone(),
            None => completion_body_for(spec.model.as_deref(), &spec.prompt, spec.max_tokens),
        };
        let path = spec.path.as_deref().unwrap_or("/v1/completions");
        let session = spec
            .session
            .as_deref()
            .map(|s| (self.cfg.session_header.as_str(), s));
        let headers = request_headers(path, body.len(), session, &spec.headers);
        let session_label = spec
            .session
            .clone()
            .unwrap_or_else(|| format!("request-{id}"));
        if !from_driver {
            self.recorder
                .issued(id, &session_label, self.now_us, spec.prompt.len() as u64);
        }
        self.records.insert(
            id,
            RequestRecord {
                id,
                worker: w,
                issued_us: self.now_us,
                ..Default::default()
            },
        );
        let stream = self.request_phase(w, headers, &body, spec.trailers.as_ref())?;
        self.after_request_phase(id, w, stream, spec, from_driver)
    }

    /// The worker a request goes through: the one its spec names, else the next of the proxy it is
    /// spread to (round robin within the proxy, as a proxy's listener hands connections out).
    fn pick_worker(&mut self, spec: &RequestSpec) -> Result<usize, HarnessError> {
        Ok(match spec.worker {
            Some(w) if w < self.workers.len() => w,
            Some(w) => return Err(HarnessError::Config(format!("no worker {w}"))),
            None => {
                let p = self.pick_proxy(spec.session.as_deref());
                let w = p * self.cfg.workers + self.rr_worker[p] % self.cfg.workers;
                self.rr_worker[p] += 1;
                w
            }
        })
    }

    /// The proxy a request without a chosen worker goes through ([`super::ProxySpread`]).
    fn pick_proxy(&mut self, session: Option<&str>) -> usize {
        let n = self.cfg.proxies;
        if n == 1 {
            return 0;
        }
        if let (super::ProxySpread::PerSession, Some(s)) = (self.cfg.proxy_spread, session) {
            // FNV-1a of the session id, finished with a multiply so nearby ids spread.
            let h = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
            return (h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % n;
        }
        // xorshift64*
        let mut x = self.proxy_rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.proxy_rng = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as usize % n
    }

    /// Opens a stream on worker `w` and pushes the request through the filter: headers, the body in
    /// `body_chunk_bytes` chunks (as Envoy hands a filter its body in slices), then any trailers,
    /// end of stream on the last of them. Returns the stream.
    fn request_phase(
        &mut self,
        w: usize,
        headers: Pairs,
        body: &[u8],
        trailers: Option<&Vec<(String, String)>>,
    ) -> Result<u32, HarnessError> {
        let started = std::time::Instant::now();
        let worker = &mut self.workers[w];
        let stream = worker.new_stream()?;
        worker.request_headers(stream, headers, body.is_empty() && trailers.is_none())?;
        if !body.is_empty() {
            let n = self.cfg.body_chunk_bytes.max(1);
            let mut chunks = body.chunks(n).peekable();
            while let Some(c) = chunks.next() {
                let last = chunks.peek().is_none() && trailers.is_none();
                worker.request_body(stream, c, last)?;
                self.stats.request_body_chunks += 1;
            }
        }
        if let Some(t) = trailers {
            let pairs = t
                .iter()
                .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
                .collect();
            worker.request_trailers(stream, pairs)?;
        }
        self.stats.request_filter_ns += started.elapsed().as_nanos() as u64;
        Ok(stream)
    }

    /// Acts on what the filter decided once the request phase ran (or, for a held request, once
    /// it resumed): a local response fails the request; a request neither answered nor released is
    /// held ([`Harness::check_paused`] looks again); a released one is placed and sent upstream.
    fn after_request_phase(
        &mut self,
        id: u64,
        w: usize,
        stream: u32,
        spec: &RequestSpec,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        let st = self.workers[w]
            .stream(stream)
            .ok_or_else(|| HostError::Usage(format!("stream {stream} vanished")))?
            .clone();
        if let Some(lr) = &st.local_response {
            let lr = lr.clone();
            return self.answered_locally(id, w, stream, &lr, from_driver);
        }
        if !st.released {
            // The filter may still release it (proxy_continue_stream after a callout).
            self.paused.push(Paused {
                id,
                worker: w,
                stream,
                spec: spec.clone(),
                from_driver,
            });
            return Ok(());
        }
        let placed = self.place(id, spec, &st);
        if !placed.oracle {
            self.tell_upstream_address(w, stream, placed.replica)?;
        }
        self.record_release(id, &placed, &st);
        self.recorder.routed(id, placed.replica);
        self.upstream(id, w, stream, spec, placed.replica, from_driver)
    }

    /// The filter answered the request itself (`lr`): the stream ends there and the request
    /// counts as failed; the answer is kept as the client receives it.
    fn answered_locally(
        &mut self,
        id: u64,
        w: usize,
        stream: u32,
        lr: &crate::host::LocalResponse,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        self.stats.local_responses += 1;
        let rec = self.records.get_mut(&id).expect("record inserted at send");
        rec.local_response = Some(lr.status);
        rec.local_headers = lr
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    String::from_utf8_lossy(k).into_owned(),
                    String::from_utf8_lossy(v).into_owned(),
                )
            })
            .collect();
        rec.local_body = lr.body.clone();
        rec.failed = true;
        self.workers[w].end_stream(stream)?;
        self.fail_request(id, from_driver);
        Ok(())
    }

    /// Requests the filter paused: released since? local response? Still paused is fine until the run
    /// ends; [`Harness::run_until_idle`] reports them as stuck.
    pub(super) fn check_paused(&mut self) -> Result<(), HarnessError> {
        if self.paused.is_empty() {
            return Ok(());
        }
        let waiting = std::mem::take(&mut self.paused);
        for p in waiting {
            let st = self.workers[p.worker].stream(p.stream);
            let progressed = st.is_some_and(|s| s.released || s.local_response.is_some());
            if progressed {
                self.after_request_phase(p.id, p.worker, p.stream, &p.spec, p.from_driver)?;
            } else {
                self.paused.push(p);
            }
        }
        Ok(())
    }

    /// Keeps in the request's record where it went and the request headers as the upstream got
    /// them (after the filter's rewrites), for tests to check.
    fn record_release(&mut self, id: u64, placed: &Placement, st: &StreamState) {
        let rec = self.records.get_mut(&id).expect("record inserted at send");
        rec.released = true;
        rec.destination = placed.destination.clone();
        rec.replica = Some(placed.replica);
        rec.retried_from = placed.retried_from;
        rec.fallback = placed.fallback;
        rec.upstream_headers = st
            .upstream_headers
            .as_ref()
            .map(|h| {
                h.iter()
                    .map(|(k, v)| {
                        (
                            String::from_utf8_lossy(k).into_owned(),
                            String::from_utf8_lossy(v).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
    }

    /// The upstream's side of a released request on `replica`: its fault, or the engine running it
    /// (the response then streams from engine events), or a refusal when the engine cannot run it.
    fn upstream(
        &mut self,
        id: u64,
        w: usize,
        stream: u32,
        spec: &RequestSpec,
        replica: usize,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        if let Some(a) = &spec.proxy_answer {
            return self.proxy_answers(id, w, stream, a.clone(), from_driver);
        }
        let status = match self.replicas[replica].response_fault {
            ResponseFault::Status(code) => code,
            _ => 200,
        };
        self.tell_answered_by_replica(w, stream, status)?;
        if self.replicas[replica].response_fault != ResponseFault::Healthy {
            return self.answer_with_fault(id, w, stream, replica, from_driver);
        }
        match self.submit(id, spec, replica) {
            Ok(()) => {
                self.flights.insert(
                    id,
                    Flight {
                        worker: w,
                        stream,
                        prompt_len: spec.prompt.len() as u32,
                        output: Vec::new(),
                        unsent: 0,
                        sse: SseWriter::new(id, self.now_us / 1_000_000, self.cfg.split_every),
                        from_driver,
                        headers_sent: false,
                    },
                );
                Ok(())
            }
            Err(message) => {
                self.tell_answered_by_replica(w, stream, 400)?;
                self.refuse(id, w, stream, message, from_driver)
            }
        }
    }

    /// Hands the request to `replica`'s engine; `Err` with the upstream's message when it would not
    /// run it.
    fn submit(&mut self, id: u64, spec: &RequestSpec, replica: usize) -> Result<(), String> {
        let req = EngineRequest {
            id,
            prompt: spec.prompt.clone(),
            max_tokens: spec.max_tokens,
            ignore_eos: true,
            min_tokens: 0,
        };
        if spec
            .raw_body
            .as_deref()
            .is_some_and(|b| !carries_prompt(b, &spec.prompt))
        {
            // A hand-made body that is not a completions request for the spec's prompt is not a
            // prompt the engine could run: the upstream refuses it.
            Err("the request body is not a completions request".to_string())
        } else {
            // The simulator's server rule: any `model` but the served one names a LoRA adapter.
            let adapter = spec.model.as_deref().filter(|m| *m != crate::openai::MODEL);
            self.replicas[replica]
                .engine
                .submit_with_adapter(self.now_us, req, adapter)
                .map_err(|e| e.to_string())
        }
    }

    /// The upstream refuses the request with a 400 carrying `message`, passed back through the
    /// filter's response phase.
    fn refuse(
        &mut self,
        id: u64,
        w: usize,
        stream: u32,
        message: String,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        self.stats.rejected += 1;
        let (headers, body) = error_response(&message);
        let worker = &mut self.workers[w];
        worker.response_headers(stream, headers, false)?;
        worker.response_body(stream, &body, true)?;
        let st = worker.end_stream(stream)?;
        let rec = self.records.get_mut(&id).expect("record inserted at send");
        rec.rejected = Some(message);
        rec.failed = true;
        rec.downstream_bytes = st.downstream_body.len();
        self.fail_request(id, from_driver);
        Ok(())
    }

    /// The proxy answers a released request itself ([`ProxyAnswer`]): no replica sees it.
    fn proxy_answers(
        &mut self,
        id: u64,
        w: usize,
        stream: u32,
        a: ProxyAnswer,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        self.stats.proxy_answers += 1;
        self.tell_proxy_answered(w, stream, &a.details)?;
        let (headers, body) = crate::openai::engine_error_response(a.status, &a.details);
        let worker = &mut self.workers[w];
        worker.response_headers(stream, headers, false)?;
        worker.response_body(stream, &body, true)?;
        let st = worker.end_stream(stream)?;
        let rec = self.records.get_mut(&id).expect("record inserted at send");
        rec.downstream_bytes = st.downstream_body.len();
        self.fail_request(id, from_driver);
        Ok(())
    }

    /// Fails a request the way the replica's [`ResponseFault`] says, at once.
    fn answer_with_fault(
        &mut self,
        id: u64,
        w: usize,
        stream: u32,
        replica: usize,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        self.replicas[replica].faulted += 1;
        let worker = &mut self.workers[w];
        match self.replicas[replica].response_fault {
            ResponseFault::Healthy => unreachable!("only faults are answered here"),
            ResponseFault::Status(code) => {
                let (headers, body) = crate::openai::engine_error_response(code, "engine failed");
                worker.response_headers(stream, headers, false)?;
                worker.response_body(stream, &body, true)?;
            }
            ResponseFault::StreamError => {
                worker.response_headers(stream, sse_headers(), false)?;
                worker.response_body(
                    stream,
                    &crate::openai::sse_error_event("engine failed"),
                    false,
                )?;
                worker.response_body(stream, b"data: [DONE]\n\n", true)?;
            }
        }
        let st = worker.end_stream(stream)?;
        let rec = self.records.get_mut(&id).expect("record inserted at send");
        rec.downstream_bytes = st.downstream_body.len();
        self.fail_request(id, from_driver);
        Ok(())
    }

    /// Counts a request as failed everywhere: stats, recorder, record, and the driver (which may
    /// then issue the session's next turn).
    pub(super) fn fail_request(&mut self, id: u64, from_driver: bool) {
        self.stats.failed += 1;
        self.recorder.failed(id, self.now_us);
        if let Some(rec) = self.records.get_mut(&id) {
            rec.failed = true;
            rec.finished_us = Some(self.now_us);
        }
        if from_driver && let Some(d) = self.driver.as_mut() {
            let _ = d.fail(id, self.now_us);
        }
    }
}

/// Whether a hand-made body is a completions request whose `prompt` is exactly `prompt`'s token ids
/// (another spelling of the body the harness would build): the engine runs it as that prompt.
fn carries_prompt(body: &[u8], prompt: &[u32]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    v.get("prompt")
        .and_then(Value::as_array)
        .is_some_and(|ids| {
            ids.len() == prompt.len()
                && ids
                    .iter()
                    .zip(prompt)
                    .all(|(a, &b)| a.as_u64() == Some(u64::from(b)))
        })
}

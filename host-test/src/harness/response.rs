//! The response phase: engine events become what the proxy would push through the filter. The first
//! token sends the response headers, tokens go out as SSE events in `chunk_tokens` batches (some
//! chunks split mid-event, `split_every`, as a network would), and the finish sends the last event
//! with the usage and ends the stream; an aborted request's stream ends without end of stream, as a
//! dead upstream connection's does.

use super::{Harness, HarnessError};
use crate::abi::Action;
use crate::host::StreamState;
use crate::openai::{SseWriter, sse_headers};
use kvsteer_sim::{EngineEvent, FinishReason};

/// A request the engine is running: where its response goes and what of it has not gone yet.
pub(super) struct Flight {
    pub(super) worker: usize,
    pub(super) stream: u32,
    pub(super) prompt_len: u32,
    /// Every token generated so far.
    pub(super) output: Vec<u32>,
    /// How many of `output`'s last tokens have not been pushed through the filter yet.
    pub(super) unsent: usize,
    pub(super) sse: SseWriter,
    pub(super) from_driver: bool,
    pub(super) headers_sent: bool,
}

impl Flight {
    /// Adds a token the engine generated; it goes out with the next chunk.
    fn push(&mut self, token: u32) {
        self.output.push(token);
        self.unsent += 1;
    }
}

/// An engine's finish, as the response's last event and the record need it.
struct Finish {
    t_us: u64,
    prompt_tokens: u32,
    cached_tokens: u32,
    completion_tokens: u32,
    reason: &'static str,
}

impl Harness {
    /// Steps one engine to now (after a restart, to deliver its aborts) and streams its events.
    pub(super) fn drain_engine(&mut self, replica: usize) -> Result<(), HarnessError> {
        let now = self.now_us;
        self.replicas[replica].engine.advance(now, &mut self.events);
        self.drain_events()
    }

    /// Streams the engine events collected in `events`, keeping the buffer's allocation.
    pub(super) fn drain_events(&mut self) -> Result<(), HarnessError> {
        let events = std::mem::take(&mut self.events);
        for ev in &events {
            self.on_engine_event(ev)?;
        }
        let mut events = events;
        events.clear();
        self.events = events;
        Ok(())
    }

    /// Pushes a request's response on for one engine event. Events of requests no longer in flight
    /// (direct submissions, requests already failed) are dropped.
    fn on_engine_event(&mut self, ev: &EngineEvent) -> Result<(), HarnessError> {
        let id = ev.id();
        if !self.flights.contains_key(&id) {
            return Ok(()); // a direct submission, or a request already failed
        }
        match *ev {
            EngineEvent::FirstToken { t_us, token, .. } => self.on_first_token(id, t_us, token),
            EngineEvent::Token { token, .. } => self.on_token(id, token),
            EngineEvent::Finished {
                t_us,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                ..
            } => {
                let f = self.flights.remove(&id).expect("checked above");
                if reason == FinishReason::Abort {
                    return self.on_abort(id, &f);
                }
                let finish = Finish {
                    t_us,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                    reason: reason.as_str(),
                };
                self.on_finished(id, f, &finish)
            }
        }
    }

    /// The first token: the response headers go out with it (its time is the time to first token).
    fn on_first_token(&mut self, id: u64, t_us: u64, token: u32) -> Result<(), HarnessError> {
        let f = self
            .flights
            .get_mut(&id)
            .expect("checked by on_engine_event");
        f.push(token);
        let (w, stream) = (f.worker, f.stream);
        if !f.headers_sent {
            f.headers_sent = true;
            self.workers[w].response_headers(stream, sse_headers(), false)?;
        }
        if let Some(r) = self.records.get_mut(&id) {
            r.first_token_us.get_or_insert(t_us);
        }
        self.recorder.first_token(id, t_us);
        self.flush_tokens(id)
    }

    /// A later token: held until `chunk_tokens` of them make a chunk.
    fn on_token(&mut self, id: u64, token: u32) -> Result<(), HarnessError> {
        let f = self
            .flights
            .get_mut(&id)
            .expect("checked by on_engine_event");
        f.push(token);
        if f.unsent >= self.cfg.chunk_tokens.max(1) {
            self.flush_tokens(id)?;
        }
        Ok(())
    }

    /// Pushes the tokens not sent yet through the filter as one body chunk. The filter must let
    /// it through: holding a response chunk would hold the client's tokens.
    fn flush_tokens(&mut self, id: u64) -> Result<(), HarnessError> {
        let Some(f) = self.flights.get_mut(&id) else {
            return Ok(());
        };
        if f.unsent == 0 {
            return Ok(());
        }
        let start = f.output.len() - f.unsent;
        f.unsent = 0;
        let chunk = f.sse.tokens(&f.output[start..]);
        let (w, stream) = (f.worker, f.stream);
        let action = self.workers[w].response_body(stream, &chunk, false)?;
        self.stats.response_body_chunks += 1;
        if action != Action::Continue {
            return Err(HarnessError::ResponsePaused { request: id });
        }
        Ok(())
    }

    /// The upstream connection died mid-stream (the engine aborted the request): the proxy ends the
    /// stream without end of stream, and the request failed.
    fn on_abort(&mut self, id: u64, f: &Flight) -> Result<(), HarnessError> {
        let st = self.workers[f.worker].end_stream(f.stream)?;
        if let Some(r) = self.records.get_mut(&id) {
            r.downstream_bytes = st.downstream_body.len();
        }
        self.fail_request(id, f.from_driver);
        Ok(())
    }

    /// The engine finished the request: the last SSE event (the tokens left, the finish reason and
    /// the usage, then `[DONE]`) with end of stream, and the stream closes.
    fn on_finished(&mut self, id: u64, mut f: Flight, done: &Finish) -> Result<(), HarnessError> {
        let (w, stream) = (f.worker, f.stream);
        let start = f.output.len() - f.unsent;
        let chunk = f.sse.finish(
            &f.output[start..],
            done.reason,
            done.prompt_tokens,
            done.completion_tokens,
            done.cached_tokens,
        );
        if !f.headers_sent {
            self.workers[w].response_headers(stream, sse_headers(), false)?;
        }
        let action = self.workers[w].response_body(stream, &chunk, true)?;
        self.stats.response_body_chunks += 1;
        if action != Action::Continue {
            return Err(HarnessError::ResponsePaused { request: id });
        }
        let st = self.workers[w].end_stream(stream)?;
        self.complete(id, &f, done, &st);
        Ok(())
    }

    /// Records a finished request (its record, the recorder's metrics) and tells the driver, which
    /// may then issue the session's next turn.
    fn complete(&mut self, id: u64, f: &Flight, done: &Finish, st: &StreamState) {
        let explained = self.explained(st);
        if let Some(r) = self.records.get_mut(&id) {
            r.explained = explained;
            r.finished_us = Some(done.t_us);
            r.prompt_tokens = done.prompt_tokens;
            r.cached_tokens = done.cached_tokens;
            r.completion_tokens = done.completion_tokens;
            r.downstream_bytes = st.downstream_body.len();
        }
        debug_assert_eq!(f.prompt_len, done.prompt_tokens);
        self.recorder.finished(
            id,
            done.t_us,
            done.cached_tokens as u64,
            done.completion_tokens as u64,
        );
        if f.from_driver
            && let Some(d) = self.driver.as_mut()
        {
            let _ = d.complete(id, done.t_us, &f.output);
        }
    }

    /// The configured `explain_header` as the client got it on a finished stream.
    fn explained(&self, st: &StreamState) -> Option<String> {
        let name = self.cfg.filter_extra.get("explain_header")?.as_str()?;
        st.response_headers
            .as_ref()?
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

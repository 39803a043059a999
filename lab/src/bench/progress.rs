//! Running the replays of a bench or demo run on a few threads, with one progress bar of requests
//! done across them. The bar (indicatif) is drawn on stderr only when stderr is a terminal: a run
//! whose output goes to a log file gets a line per finished replay instead (replays done, of how
//! many, and the time so far), rather than thousands of `\r` redraws or nothing for half an hour.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Instant;

/// The bar for `total` requests; hidden unless stderr is a terminal.
pub fn bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("requests [{bar:30}] {percent:>3}% {pos}/{len} {elapsed}")
    {
        bar.set_style(style.progress_chars("#."));
    }
    bar
}

/// Runs job `order[0]`, then `order[1]`, ... on `threads` threads; `job(i, tick)` runs job `i` and
/// calls `tick(done)` with the requests it has finished so far. Returns each job's result in the
/// order they finished.
pub fn run_jobs<R, F>(order: &[usize], threads: usize, total: u64, job: F) -> Vec<(usize, R)>
where
    R: Send,
    F: Fn(usize, &dyn Fn(u64)) -> R + Sync,
{
    let bar = bar(total);
    let lines = !std::io::stderr().is_terminal();
    let started = Instant::now();
    let max_job = order.iter().max().map_or(0, |&m| m + 1);
    // Requests done per job, so a tick adds only what is new.
    let done = Mutex::new(vec![0u64; max_job]);
    let queue = Mutex::new(order.iter().rev().copied().collect::<Vec<usize>>());
    let results = Mutex::new(Vec::with_capacity(order.len()));
    std::thread::scope(|s| {
        for _ in 0..threads.min(order.len()) {
            let (queue, done, results, bar, job) = (&queue, &done, &results, &bar, &job);
            s.spawn(move || {
                loop {
                    let next = queue.lock().ok().and_then(|mut q| q.pop());
                    let Some(i) = next else { break };
                    let tick = |n: u64| {
                        if let Ok(mut d) = done.lock() {
                            bar.inc(n.saturating_sub(d[i]));
                            d[i] = d[i].max(n);
                        }
                    };
                    let r = job(i, &tick);
                    if let Ok(mut res) = results.lock() {
                        res.push((i, r));
                        if lines {
                            eprintln!(
                                "  {} of {} replays done, {:.0} s",
                                res.len(),
                                order.len(),
                                started.elapsed().as_secs_f64()
                            );
                        }
                    }
                }
            });
        }
    });
    bar.finish();
    results.into_inner().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_job_runs_once_and_reports_its_result() {
        let order = [3, 0, 2, 1, 4];
        let out = run_jobs(&order, 2, 50, |i, tick| {
            for n in 1..=10 {
                tick(n);
            }
            i * 10
        });
        let mut got: Vec<(usize, usize)> = out;
        got.sort();
        assert_eq!(got, vec![(0, 0), (1, 10), (2, 20), (3, 30), (4, 40)]);
    }

    #[test]
    fn one_thread_runs_jobs_in_the_order_given() {
        let out = run_jobs(&[2, 0, 1], 1, 0, |i, _| i);
        assert_eq!(
            out.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            vec![2, 0, 1]
        );
    }

    #[test]
    fn no_jobs_no_threads() {
        let out: Vec<(usize, ())> = run_jobs(&[], 4, 0, |_, _| ());
        assert!(out.is_empty());
    }

    #[test]
    fn the_bar_is_hidden_without_a_terminal() {
        // Tests run with stderr captured or redirected, never a terminal.
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() {
            assert!(bar(10).is_hidden());
        }
    }
}

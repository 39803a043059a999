//! RL rollout structure (docs/design/design.md section 7).

use kvsteer_workload::rl::{RlParams, generate};
use kvsteer_workload::{Driver, Mode, Prompt};

fn first_prompt(w: &kvsteer_workload::Workload, s: usize) -> &[u32] {
    match &w.sessions[s].turns[0].prompt {
        Prompt::Append(t) => t,
        other => panic!("RL turns append, got {other:?}"),
    }
}

#[test]
fn default_shape_matches_design() {
    let p = RlParams::default();
    let w = generate(&p).unwrap();
    assert_eq!(w.sessions.len(), 80);
    assert!(w.sessions.iter().all(|s| s.turns.len() == 10));
    assert_eq!(w.total_requests(), 800);
    assert_eq!(w.block_size, 16);
    assert_eq!(w.default_mode, Mode::Closed { concurrency: 16 });
    for s in 0..80 {
        assert_eq!(first_prompt(&w, s).len(), 2048 + 512 + 1024);
    }
}

#[test]
fn prefixes_are_shared_exactly_as_designed() {
    let w = generate(&RlParams::default()).unwrap();
    let p0 = first_prompt(&w, 0);
    for s in 1..80 {
        let p = first_prompt(&w, s);
        assert_eq!(
            p[..2048],
            p0[..2048],
            "system prefix shared by all (session {s})"
        );
        let same_step = s / 8 == 0;
        assert_eq!(
            p[2048..2560] == p0[2048..2560],
            same_step,
            "step state shared within a step only (session {s})"
        );
        assert_ne!(
            p[2560..2576],
            p0[2560..2576],
            "rollout part is the rollout's own (session {s})"
        );
    }
    // Within step 3, all rollouts share the step state.
    let a = first_prompt(&w, 24);
    for s in 25..32 {
        assert_eq!(first_prompt(&w, s)[..2560], a[..2560]);
    }
}

#[test]
fn stragglers_are_the_last_turn_of_rollouts_0_and_4() {
    let w = generate(&RlParams::default()).unwrap();
    let mut long = 0;
    for (i, s) in w.sessions.iter().enumerate() {
        for (t, turn) in s.turns.iter().enumerate() {
            let straggler = t == 9 && (i % 8 == 0 || i % 8 == 4);
            assert_eq!(
                turn.output_tokens,
                if straggler { 8192 } else { 1024 },
                "session {i} turn {t}"
            );
            long += usize::from(straggler);
        }
    }
    assert_eq!(long, 20);
}

#[test]
fn later_turns_append_output_and_env_tokens() {
    let p = RlParams::small();
    let w = generate(&p).unwrap();
    let mut d = Driver::new(w.clone(), Mode::Closed { concurrency: 1 });
    let mut out = vec![];
    d.poll(0, &mut out);
    assert_eq!(out.len(), 1);
    let first = out[0].clone();
    assert_eq!(&*first.prompt, first_prompt(&w, 0));
    let generated: Vec<u32> = (0..first.output_tokens).map(|i| 90_000 + i).collect();
    d.complete(first.request_id, 1_000, &generated).unwrap();
    out.clear();
    d.poll(1_000, &mut out);
    let second = &out[0];
    let n = first.prompt.len() + generated.len();
    assert_eq!(second.prompt[..first.prompt.len()], first.prompt[..]);
    assert_eq!(second.prompt[first.prompt.len()..n], generated[..]);
    let new = second.prompt.len() - n;
    assert!(
        (p.env_tokens_min..=p.env_tokens_max).contains(&new),
        "{new} env tokens"
    );
    let Prompt::Append(expected) = &w.sessions[0].turns[1].prompt else {
        panic!()
    };
    assert_eq!(&second.prompt[n..], &expected[..]);
}

#[test]
fn env_tokens_vary_within_the_documented_range() {
    let w = generate(&RlParams::default()).unwrap();
    let lens: Vec<usize> = w
        .sessions
        .iter()
        .flat_map(|s| &s.turns[1..])
        .map(|t| match &t.prompt {
            Prompt::Append(v) => v.len(),
            _ => 0,
        })
        .collect();
    assert!(lens.iter().all(|l| (128..=256).contains(l)));
    assert!(lens.iter().min() < lens.iter().max());
}

#[test]
fn seeds_change_tokens_not_structure() {
    let a = generate(&RlParams::small()).unwrap();
    let b = generate(&RlParams {
        seed: 7,
        ..RlParams::small()
    })
    .unwrap();
    assert_eq!(a.total_requests(), b.total_requests());
    assert_ne!(first_prompt(&a, 0), first_prompt(&b, 0));
    assert_eq!(
        first_prompt(&a, 0),
        first_prompt(&generate(&RlParams::small()).unwrap(), 0)
    );
}

#[test]
fn bad_params_are_refused() {
    assert!(
        generate(&RlParams {
            turns: 0,
            ..RlParams::small()
        })
        .is_err()
    );
    assert!(
        generate(&RlParams {
            env_tokens_min: 9,
            env_tokens_max: 8,
            ..RlParams::small()
        })
        .is_err()
    );
}

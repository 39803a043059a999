//! The command lines of the `bench` and `demo` binaries (clap), and the policy lists both compare, so
//! both spell their flags, lists and errors one way. A bad argument exits with status 2, the usage
//! error scripts can tell from a failed run (1); `--help` prints each flag's meaning.

use crate::bench::scenario::Scale;
use clap::Parser;
use kvsteer_core::PolicyKind;
use std::path::PathBuf;

/// The routing policies both binaries compare (and run when `--policies` is not given), in table
/// order: the names of [`PolicyKind::ALL`], the core's list, so a policy added there is compared here.
pub const POLICIES: [&str; PolicyKind::ALL.len()] = {
    let mut names = [""; PolicyKind::ALL.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = PolicyKind::ALL[i].name();
        i += 1;
    }
    names
};

/// [`POLICIES`] as owned names, the default for an `Args` field.
pub fn default_policies() -> Vec<String> {
    POLICIES.iter().map(|s| s.to_string()).collect()
}

/// `kv_load` as the routers users would otherwise pick set it (the presets of
/// docs/reference/configuration.md): the report measures kvsteer's default against each.
pub const PRESET_VARIANTS: [&str; 3] = [
    "kv_load@preset=dynamo",
    "kv_load@preset=ray_balanced",
    "kv_load@preset=ray_kv_biased",
];

/// What the benchmark compares when `--policies` is not given: every policy, then the presets, then
/// the oracle ([`kvsteer_host_test::oracle`]: the limit, which no deployable policy can reach; the report labels
/// it so and ranks the policies without it).
pub fn bench_policies() -> Vec<String> {
    POLICIES
        .iter()
        .chain(&PRESET_VARIANTS)
        .chain(&[kvsteer_host_test::oracle::ORACLE])
        .map(|s| s.to_string())
        .collect()
}

/// A comma-separated list (`a, b,,c`): items trimmed, empty ones dropped, so a trailing comma or a
/// space after one is harmless. One value, so a flag given twice keeps its last list.
#[derive(Clone, Debug, PartialEq)]
pub struct List(pub Vec<String>);

fn list(s: &str) -> Result<List, String> {
    Ok(List(split_list(s)))
}

/// Splits `a, b,,c` into `["a", "b", "c"]`.
pub fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(|x| x.trim().to_string())
        .filter(|x| !x.is_empty())
        .collect()
}

fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `bench`'s flags as clap reads them; [`BenchArgs`] is what the binary uses.
#[derive(Parser, Debug)]
#[command(
    name = "bench",
    about = "The benchmark behind the results report: every policy on the matrix's workloads \
             through kvsteer_filter.wasm in the wasmtime harness.",
    args_override_self = true
)]
struct BenchCli {
    /// Cut-down workloads, one seed: minutes.
    #[arg(long, overrides_with = "smoke")]
    quick: bool,
    /// Tiny slices, one seed, seconds; checks that the outputs are well-formed and exits non-zero
    /// if not.
    #[arg(long, overrides_with = "quick")]
    smoke: bool,
    /// Seeds per scenario and policy (default 3; 1 with --quick or --smoke).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    seeds: Option<u64>,
    /// The first seed (default 0): `--first-seed 9 --seeds 9` draws seeds 9 to 17, new draws to
    /// set beside an earlier run's 0 to 8.
    #[arg(long, value_name = "K", default_value_t = 0)]
    first_seed: u64,
    /// Policies to compare: names, or variants `kv_load@overlap_credit=2@...` setting numbers in
    /// the policy's own section; `oracle` or `oracle@decode=1@stall=1` for the limit (default:
    /// every policy, the presets, then the oracle).
    #[arg(long, value_name = "a,b", value_parser = list)]
    policies: Option<List>,
    /// Scenario ids or groups (rl, weka, mooncake, azure); also the groups only this flag selects:
    /// proxies and proxies-session (docs/reports/proxies.md), dp (docs/design/dp.md), pd and
    /// pd-shape (docs/design/pd.md), weka-fixed, mooncake-fixed, azure-fixed (recorded timing).
    #[arg(long, value_name = "id|group,..", value_parser = list)]
    only: Option<List>,
    /// Replays run in parallel (default: available cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    jobs: Option<u64>,
    /// Proxy worker VMs.
    #[arg(long, value_name = "N", default_value_t = 2,
        value_parser = clap::value_parser!(u64).range(1..))]
    workers: u64,
    /// Where to write (default: docs/reports/ for a full run, out/bench-<scale>/ otherwise).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// The traces' folder (default: the repository's traces/).
    #[arg(long, value_name = "DIR")]
    traces: Option<PathBuf>,
    /// Write the Envoy slice's workload (the matrix's `slice` scenario at this scale) to FILE as
    /// JSON and run nothing.
    #[arg(long, value_name = "FILE")]
    export_slice: Option<PathBuf>,
    /// Write every replay's per-request rows (CSV) under DIR, for diagnosing a policy.
    #[arg(long, value_name = "DIR")]
    rows: Option<PathBuf>,
}

/// What `bench` was asked to do.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchArgs {
    pub scale: Scale,
    pub seeds: Option<u64>,
    /// The first seed drawn (`--first-seed`).
    pub first_seed: u64,
    pub policies: Vec<String>,
    pub only: Vec<String>,
    pub jobs: usize,
    pub workers: usize,
    pub out: Option<PathBuf>,
    pub traces: PathBuf,
    pub export_slice: Option<PathBuf>,
    /// Where to write every replay's per-request rows (CSV), for diagnosing a policy.
    pub rows: Option<PathBuf>,
}

impl BenchArgs {
    /// The process's arguments; exits with status 2 (0 for `--help`) when they do not parse.
    pub fn parse() -> Self {
        Self::try_parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// `args` (the program name first) read as `bench` would.
    pub fn try_parse_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let c = BenchCli::try_parse_from(args)?;
        let policies = c.policies.map_or_else(bench_policies, |l| l.0);
        let invalid = |m: String| {
            <BenchCli as clap::CommandFactory>::command()
                .error(clap::error::ErrorKind::ValueValidation, m)
        };
        if policies.is_empty() {
            return Err(invalid("--policies must name at least one policy".into()));
        }
        for p in &policies {
            crate::bench::run::check_spec(p).map_err(invalid)?;
        }
        Ok(BenchArgs {
            scale: if c.smoke {
                Scale::Smoke
            } else if c.quick {
                Scale::Quick
            } else {
                Scale::Full
            },
            seeds: c.seeds,
            first_seed: c.first_seed,
            policies,
            only: c.only.map(|l| l.0).unwrap_or_default(),
            jobs: c.jobs.map_or_else(available_cores, |n| n as usize),
            workers: c.workers as usize,
            out: c.out,
            traces: c.traces.unwrap_or_else(|| {
                kvsteer_host_test::artifact::workspace_root()
                    .join(kvsteer_workload::catalog::DEFAULT_TRACES)
            }),
            export_slice: c.export_slice,
            rows: c.rows,
        })
    }
}

/// `demo`'s flags as clap reads them; [`DemoArgs`] is what the binary uses.
#[derive(Parser, Debug)]
#[command(
    name = "demo",
    about = "The main job: the RL straggler workload through kvsteer_filter.wasm, once per policy, \
             and a comparison.",
    args_override_self = true
)]
struct DemoCli {
    /// The scaled-down workload (seconds).
    #[arg(long)]
    small: bool,
    /// Policies to compare (default: every policy).
    #[arg(long, value_name = "a,b", value_parser = list)]
    policies: Option<List>,
    /// Proxy worker VMs.
    #[arg(long, value_name = "N", default_value_t = 2,
        value_parser = clap::value_parser!(u64).range(1..))]
    workers: u64,
    /// Policies run in parallel (default: available cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    jobs: Option<u64>,
    /// Where to write (default: out/demo in the repository).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// What `demo` was asked to do.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoArgs {
    pub small: bool,
    pub policies: Vec<String>,
    pub workers: usize,
    pub jobs: usize,
    pub out: PathBuf,
}

impl DemoArgs {
    /// The process's arguments; exits with status 2 (0 for `--help`) when they do not parse.
    pub fn parse() -> Self {
        Self::try_parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// `args` (the program name first) read as `demo` would.
    pub fn try_parse_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let c = DemoCli::try_parse_from(args)?;
        Ok(DemoArgs {
            small: c.small,
            policies: c.policies.map_or_else(default_policies, |l| l.0),
            workers: c.workers as usize,
            jobs: c.jobs.map_or_else(available_cores, |n| n as usize),
            out: c
                .out
                .unwrap_or_else(|| kvsteer_host_test::artifact::workspace_root().join("out/demo")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    fn bench(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        BenchArgs::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
    }

    fn demo(args: &[&str]) -> Result<DemoArgs, clap::Error> {
        DemoArgs::try_parse_from(std::iter::once("demo").chain(args.iter().copied()))
    }

    #[test]
    fn bench_defaults() {
        let a = bench(&[]).unwrap();
        assert_eq!(a.scale, Scale::Full);
        assert_eq!(a.seeds, None);
        assert_eq!(a.policies, bench_policies());
        assert!(a.only.is_empty());
        assert_eq!(a.workers, 2);
        assert_eq!(a.jobs, available_cores());
        assert_eq!(a.out, None);
        assert!(
            a.traces
                .ends_with(kvsteer_workload::catalog::DEFAULT_TRACES)
        );
        assert!(a.export_slice.is_none() && a.rows.is_none());
    }

    #[test]
    fn bench_flags_and_lists() {
        let a = bench(&[
            "--smoke",
            "--seeds",
            "7",
            "--policies",
            " round_robin, kv_load,,",
            "--only",
            "rl,weka-c8",
            "--jobs",
            "3",
            "--workers",
            "4",
            "--out",
            "x",
            "--traces",
            "t",
            "--rows",
            "r",
            "--export-slice",
            "s.jsonl",
        ])
        .unwrap();
        assert_eq!(a.scale, Scale::Smoke);
        assert_eq!(a.seeds, Some(7));
        assert_eq!(a.first_seed, 0);
        assert_eq!(bench(&["--first-seed", "9"]).unwrap().first_seed, 9);
        assert!(bench(&["--first-seed", "-1"]).is_err());
        assert_eq!(a.policies, ["round_robin", "kv_load"]);
        assert_eq!(a.only, ["rl", "weka-c8"]);
        assert_eq!((a.jobs, a.workers), (3, 4));
        assert_eq!(a.out, Some(PathBuf::from("x")));
        assert_eq!(a.traces, PathBuf::from("t"));
        assert_eq!(a.rows, Some(PathBuf::from("r")));
        assert_eq!(a.export_slice, Some(PathBuf::from("s.jsonl")));
    }

    #[test]
    fn the_last_of_a_repeated_flag_wins() {
        assert_eq!(bench(&["--smoke", "--quick"]).unwrap().scale, Scale::Quick);
        assert_eq!(bench(&["--quick", "--smoke"]).unwrap().scale, Scale::Smoke);
        let a = bench(&[
            "--seeds", "2", "--seeds", "5", "--only", "rl", "--only", "azure",
        ])
        .unwrap();
        assert_eq!((a.seeds, a.only), (Some(5), vec!["azure".to_string()]));
    }

    #[test]
    fn bad_arguments_are_usage_errors() {
        for (args, kind) in [
            (&["--seeds", "0"][..], ErrorKind::ValueValidation),
            (&["--jobs", "x"], ErrorKind::ValueValidation),
            (&["--workers", "-1"], ErrorKind::UnknownArgument),
            (&["--seeds"], ErrorKind::InvalidValue),
            (&["--nope"], ErrorKind::UnknownArgument),
            (&["--policies", " , "], ErrorKind::ValueValidation),
            (
                &["--policies", "no_such_policy"],
                ErrorKind::ValueValidation,
            ),
        ] {
            let e = bench(args)
                .err()
                .unwrap_or_else(|| panic!("{args:?} parsed"));
            assert_eq!(e.kind(), kind, "{args:?}: {e}");
            assert_eq!(e.exit_code(), 2, "{args:?}");
        }
        assert_eq!(
            bench(&["--help"]).unwrap_err().kind(),
            ErrorKind::DisplayHelp
        );
    }

    #[test]
    fn demo_defaults_and_flags() {
        let a = demo(&[]).unwrap();
        assert!(!a.small);
        assert_eq!(a.policies, default_policies());
        assert_eq!((a.workers, a.jobs), (2, available_cores()));
        assert!(a.out.ends_with("out/demo"));
        let a = demo(&[
            "--small",
            "--policies",
            "kv_load",
            "--workers",
            "1",
            "--jobs",
            "2",
            "--out",
            "o",
        ])
        .unwrap();
        assert!(a.small);
        assert_eq!(a.policies, ["kv_load"]);
        assert_eq!((a.workers, a.jobs, a.out), (1, 2, PathBuf::from("o")));
        assert_eq!(
            demo(&["--jobs", "0"]).unwrap_err().kind(),
            ErrorKind::ValueValidation
        );
    }

    #[test]
    fn list_of_only_commas_is_empty() {
        assert!(split_list(" , ,").is_empty());
        assert!(split_list("").is_empty());
        assert_eq!(
            split_list("kv_load@overlap_credit=2"),
            vec!["kv_load@overlap_credit=2"]
        );
    }

    #[test]
    fn bench_policies_are_the_policies_then_valid_presets_then_the_oracle() {
        let p = bench_policies();
        assert_eq!(p[..POLICIES.len()], default_policies()[..]);
        let n = POLICIES.len() + PRESET_VARIANTS.len();
        assert_eq!(p[POLICIES.len()..n], PRESET_VARIANTS.map(String::from)[..]);
        assert_eq!(p[n..], [kvsteer_host_test::oracle::ORACLE.to_string()]);
        for v in PRESET_VARIANTS {
            crate::bench::run::routing(v).unwrap();
        }
    }

    #[test]
    fn default_policies_match_the_table_order() {
        let p = default_policies();
        assert_eq!(p.len(), POLICIES.len());
        assert_eq!(p.first().map(String::as_str), Some("round_robin"));
        assert_eq!(p.last().map(String::as_str), Some("kv_load"));
        let core: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(POLICIES.to_vec(), core);
    }
}

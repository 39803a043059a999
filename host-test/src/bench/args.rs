//! Command-line reading shared by the `bench` and `demo` binaries, so both spell their flags, lists
//! and error messages one way (and a fix to one reaches the other). Deliberately tiny: two binaries
//! with a dozen flags between them do not earn a parser dependency on a 2-core build.

use kvsteer_core::PolicyKind;

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

/// `kv_load` as the routers users would otherwise pick set it (the presets of docs/configuration.md):
/// the report measures kvsteer's default against each.
pub const PRESET_VARIANTS: [&str; 3] = [
    "kv_load@preset=dynamo",
    "kv_load@preset=ray_balanced",
    "kv_load@preset=ray_kv_biased",
];

/// What the benchmark compares when `--policies` is not given: every policy, then the presets, then
/// the oracle ([`crate::oracle`]: the limit, which no deployable policy can reach; the report labels
/// it so and ranks the policies without it).
pub fn bench_policies() -> Vec<String> {
    POLICIES
        .iter()
        .chain(&PRESET_VARIANTS)
        .chain(&[crate::oracle::ORACLE])
        .map(|s| s.to_string())
        .collect()
}

/// Walks the arguments flag by flag; a flag that takes a value pulls it with [`ArgReader::value`]
/// (or the typed forms), so a missing value is an error naming the flag rather than a panic.
pub struct ArgReader<I> {
    args: I,
}

impl ArgReader<std::iter::Skip<std::env::Args>> {
    /// The process's arguments, without the program name.
    pub fn from_env() -> Self {
        ArgReader::new(std::env::args().skip(1))
    }
}

impl<I: Iterator<Item = String>> ArgReader<I> {
    pub fn new(args: I) -> Self {
        ArgReader { args }
    }

    /// The next flag, or `None` when the arguments are used up.
    pub fn next_flag(&mut self) -> Option<String> {
        self.args.next()
    }

    /// The value after `flag`.
    pub fn value(&mut self, flag: &str) -> Result<String, String> {
        self.args.next().ok_or(format!("{flag} needs a value"))
    }

    /// The value after `flag` as a whole number; the error quotes what was given.
    pub fn number(&mut self, flag: &str) -> Result<u64, String> {
        let v = self.value(flag)?;
        v.parse()
            .map_err(|_| format!("{flag}: not a number: {v:?}"))
    }

    /// The value after `flag` as a comma-separated list (see [`split_list`]).
    pub fn list(&mut self, flag: &str) -> Result<Vec<String>, String> {
        Ok(split_list(&self.value(flag)?))
    }
}

/// Splits `a, b,,c` into `["a", "b", "c"]`: items trimmed, empty ones dropped, so a trailing comma
/// or a space after one is harmless.
pub fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(|x| x.trim().to_string())
        .filter(|x| !x.is_empty())
        .collect()
}

/// The parsed arguments, or (for a bad argument or `--help`) the message on stderr and exit status
/// 2, the usage-error status both binaries use so scripts can tell it from a failed run (1).
pub fn or_usage_exit<T>(parsed: Result<T, String>) -> T {
    parsed.unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    })
}

/// The error for an argument neither binary knows.
pub fn unknown(arg: &str) -> String {
    format!("unknown argument {arg:?} (try --help)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(args: &[&str]) -> ArgReader<std::vec::IntoIter<String>> {
        ArgReader::new(
            args.iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .into_iter(),
        )
    }

    #[test]
    fn flags_and_values_come_in_order() {
        let mut r = reader(&["--seeds", "7", "--policies", " a, b,,c ", "--out", "x"]);
        assert_eq!(r.next_flag().as_deref(), Some("--seeds"));
        assert_eq!(r.number("--seeds"), Ok(7));
        assert_eq!(r.next_flag().as_deref(), Some("--policies"));
        assert_eq!(
            r.list("--policies"),
            Ok(vec!["a".into(), "b".into(), "c".into()])
        );
        assert_eq!(r.next_flag().as_deref(), Some("--out"));
        assert_eq!(r.value("--out").as_deref(), Ok("x"));
        assert_eq!(r.next_flag(), None);
    }

    #[test]
    fn missing_value_names_the_flag() {
        let mut r = reader(&["--jobs"]);
        r.next_flag();
        assert_eq!(r.value("--jobs"), Err("--jobs needs a value".to_string()));
        let mut r = reader(&["--only"]);
        r.next_flag();
        assert_eq!(r.list("--only"), Err("--only needs a value".to_string()));
        let mut r = reader(&["--seeds"]);
        r.next_flag();
        assert_eq!(
            r.number("--seeds"),
            Err("--seeds needs a value".to_string())
        );
    }

    #[test]
    fn bad_number_quotes_the_value() {
        for bad in ["", "-1", "3.5", "x", "99999999999999999999"] {
            let mut r = reader(&[bad]);
            assert_eq!(
                r.number("--workers"),
                Err(format!("--workers: not a number: {bad:?}")),
                "{bad:?}"
            );
        }
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
        assert_eq!(p[n..], [crate::oracle::ORACLE.to_string()]);
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

    #[test]
    fn unknown_argument_points_at_help() {
        assert_eq!(
            unknown("--nope"),
            "unknown argument \"--nope\" (try --help)"
        );
    }
}

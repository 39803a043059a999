//! `--notes-only`: the report's analysis (`results/notes.md`, written by hand after looking at a
//! run) put into an existing `results.md` without running anything.

use std::path::Path;

/// `--notes-only`: puts the current `results/notes.md` (the hand-written analysis, which is written
/// after looking at a run) into the existing `results.md` in place of the analysis it was generated
/// with, exactly where a run puts it; nothing is replayed and no figure changes.
pub(crate) fn refresh_notes(out: &Path) -> Result<(), String> {
    let report = out.join("results.md");
    let notes_path = out.join("results").join("notes.md");
    let md = std::fs::read_to_string(&report).map_err(|e| format!("{}: {e}", report.display()))?;
    let notes = std::fs::read_to_string(&notes_path)
        .map_err(|e| format!("{}: {e}", notes_path.display()))?;
    let md = splice_notes(&md, &notes)
        .ok_or_else(|| format!("{}: no analysis section to replace", report.display()))?;
    std::fs::write(&report, md).map_err(|e| format!("{}: {e}", report.display()))?;
    eprintln!("put {} into {}", notes_path.display(), report.display());
    Ok(())
}

/// `md` with its `## Analysis` section's body replaced by `notes` (the body runs to the next `## `
/// heading; notes use `###` and below). None when there is no such section.
fn splice_notes(md: &str, notes: &str) -> Option<String> {
    const HEAD: &str = "## Analysis\n\n";
    let start = md.find(HEAD)? + HEAD.len();
    let end = md[start..]
        .find("\n## ")
        .map_or(md.len(), |i| start + i + 1);
    let mut out = String::with_capacity(md.len() + notes.len());
    out.push_str(&md[..start]);
    out.push_str(notes);
    out.push('\n');
    out.push_str(&md[end..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::splice_notes;

    #[test]
    fn notes_replace_only_the_analysis_body() {
        let md = "# R\n\n## Claims\n\nc\n## Analysis\n\nold\n### x\nold too\n\n## RL\n\ntable\n";
        let out = splice_notes(md, "new\n### y\n").unwrap();
        assert_eq!(
            out,
            "# R\n\n## Claims\n\nc\n## Analysis\n\nnew\n### y\n\n## RL\n\ntable\n"
        );
        assert_eq!(splice_notes("# no analysis\n", "n"), None);
        // At the end of the report.
        assert_eq!(
            splice_notes("## Analysis\n\nold\n", "new\n").unwrap(),
            "## Analysis\n\nnew\n\n"
        );
    }
}

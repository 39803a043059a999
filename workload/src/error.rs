//! Errors of trace reading and driving. Trace bytes are untrusted: every malformed line becomes a typed
//! error naming the file position, never a panic.

use std::fmt;

#[derive(Debug)]
pub enum WorkloadError {
    /// The trace file could not be read.
    Io { path: String, error: std::io::Error },
    /// A line of a trace could not be parsed or carries impossible values.
    Parse { line: usize, message: String },
    /// A parameter is out of its range.
    Param(String),
}

impl fmt::Display for WorkloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkloadError::Io { path, error } => write!(f, "cannot read {path}: {error}"),
            WorkloadError::Parse { line, message } => write!(f, "line {line}: {message}"),
            WorkloadError::Param(m) => write!(f, "bad parameter: {m}"),
        }
    }
}

impl std::error::Error for WorkloadError {}

/// Reads a trace file as text. A path ending in `.xz` is decompressed in memory (the vendored traces
/// in `traces/` are xz-compressed: 19 MB of text as 264 KB); any other path is read as it is, so a user
/// can point the readers at their own uncompressed trace.
pub(crate) fn read_file(path: &std::path::Path) -> Result<String, WorkloadError> {
    let io = |error| WorkloadError::Io {
        path: path.display().to_string(),
        error,
    };
    if path.extension().is_none_or(|e| e != "xz") {
        return std::fs::read_to_string(path).map_err(io);
    }
    let compressed = std::fs::read(path).map_err(io)?;
    let mut text = Vec::new();
    lzma_rs::xz_decompress(&mut compressed.as_slice(), &mut text).map_err(|e| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not a valid .xz file: {e}"),
        ))
    })?;
    String::from_utf8(text).map_err(|e| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("decompressed text is not UTF-8: {e}"),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_damaged_xz_file_is_an_io_error_naming_the_path() {
        let path =
            std::env::temp_dir().join(format!("kvsteer-bad-{}.jsonl.xz", std::process::id()));
        std::fs::write(&path, b"\xfd7zXZ\0 definitely not xz").unwrap();
        let err = read_file(&path).unwrap_err();
        std::fs::remove_file(&path).ok();
        match err {
            WorkloadError::Io { path: p, error } => {
                assert!(p.ends_with(".jsonl.xz"), "{p}");
                assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
            }
            other => panic!("expected Io, got {other:?}"),
        }
    }

    #[test]
    fn a_missing_file_is_an_io_error() {
        assert!(matches!(
            read_file(std::path::Path::new("no/such/trace.csv.xz")),
            Err(WorkloadError::Io { .. })
        ));
    }
}

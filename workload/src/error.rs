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

pub(crate) fn read_file(path: &std::path::Path) -> Result<String, WorkloadError> {
    std::fs::read_to_string(path).map_err(|error| WorkloadError::Io {
        path: path.display().to_string(),
        error,
    })
}

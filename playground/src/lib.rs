//! Browser playground (issue 8).

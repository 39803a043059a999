//! Simulated engine replica (issue 3).

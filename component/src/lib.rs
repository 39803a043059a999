//! The routing core as a component (issue 8).

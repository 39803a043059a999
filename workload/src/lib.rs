//! Workloads and routing-quality measurement.

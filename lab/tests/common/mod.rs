//! Shared setup of the lab's integration tests: the harness crate's (`kvsteer_host_test::testing`),
//! which host-test's own tests use too.
#![allow(unused_imports)]

pub use kvsteer_host_test::testing::{assert_clean, harness_with, module, tokens};

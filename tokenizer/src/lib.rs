//! Engine-exact tokenization (issue 7).

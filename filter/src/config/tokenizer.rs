//! The `tokenizer` section (docs/design/tokenizer.md): read into the tokenizer's own configuration
//! in the full build, refused by name in the lean one.

#[cfg(not(feature = "tokenizer"))]
use super::err;
use super::{ConfigError, FilterConfig};

/// The `tokenizer` section: the tokenizer's own configuration in the full build.
#[cfg(feature = "tokenizer")]
pub type TokenizerSection = kvsteer_tokenizer::TokenizerConfig;
/// The lean build (without the `tokenizer` cargo feature) still reads the section, as any JSON, so
/// that [`FilterConfig::validate`] refuses it naming the missing feature rather than serde calling it
/// an unknown field, and never silently routes by the approximate identity an operator did not ask for.
#[cfg(not(feature = "tokenizer"))]
pub type TokenizerSection = serde_json::Value;

impl FilterConfig {
    /// The lean build refuses a `tokenizer` section (an explicit `null` is no section); the full
    /// build takes any the tokenizer's configuration reads.
    pub(super) fn validate_tokenizer(&self) -> Result<(), ConfigError> {
        #[cfg(not(feature = "tokenizer"))]
        if self.tokenizer.is_some() {
            return err(
                "tokenizer",
                "this kvsteer_filter.wasm is the lean build, without the `tokenizer` cargo feature \
                 (no vocabulary or chat templates): use the full build or remove the section",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::FilterConfig;
    #[cfg(not(feature = "tokenizer"))]
    use crate::config::tests::refused;

    const WITH_TOKENIZER: &str = r#"{"replicas":[{"name":"r0","endpoint":"127.0.0.1:8000",
        "feed_cluster":"f0"}],"tokenizer":{"chat_template":"kvsteer_sim"}}"#;

    #[cfg(not(feature = "tokenizer"))]
    #[test]
    fn the_lean_build_refuses_a_tokenizer_section_naming_the_feature() {
        let e = refused(WITH_TOKENIZER);
        assert!(e.starts_with("tokenizer:"), "{e}");
        assert!(e.contains("`tokenizer` cargo feature"), "{e}");
        // An empty section is refused too; an explicit null means no tokenizer, as in the full build.
        assert!(
            refused(&WITH_TOKENIZER.replace(r#"{"chat_template":"kvsteer_sim"}"#, "{}"))
                .contains("lean build")
        );
        let null = WITH_TOKENIZER.replace(r#"{"chat_template":"kvsteer_sim"}"#, "null");
        assert!(FilterConfig::from_json(null.as_bytes()).is_ok());
    }

    #[cfg(feature = "tokenizer")]
    #[test]
    fn the_full_build_reads_the_tokenizer_section() {
        let c = FilterConfig::from_json(WITH_TOKENIZER.as_bytes()).unwrap();
        assert_eq!(c.tokenizer.unwrap().chat_template, "kvsteer_sim");
    }

    /// A Hugging Face bundle arrives as text inside the section; a bad one refuses the configuration
    /// naming `tokenizer.huggingface` and what in the file was wrong.
    #[cfg(feature = "tokenizer")]
    #[test]
    fn a_hugging_face_bundle_is_loaded_or_refused_by_name() {
        let bundle = serde_json::json!({
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
            "pre_tokenizer": {"type": "ByteLevel", "use_regex": true}
        });
        let section = |json: &str| {
            let t = serde_json::json!({"huggingface": {"tokenizer_json": json},
                "chat_template_jinja": "{{ messages[0].content }}"});
            WITH_TOKENIZER.replace(r#"{"chat_template":"kvsteer_sim"}"#, &t.to_string())
        };
        let ok = FilterConfig::from_json(section(&bundle.to_string()).as_bytes()).unwrap();
        assert!(crate::worker::WorkerState::new(ok).is_ok());
        let bad = bundle.to_string().replace("a b", "a c");
        let cfg = FilterConfig::from_json(section(&bad).as_bytes()).unwrap();
        let e = crate::worker::WorkerState::new(cfg)
            .err()
            .unwrap()
            .to_string();
        assert!(e.starts_with("tokenizer.huggingface"), "{e}");
        assert!(e.contains("merges[0]"), "{e}");
    }
}

//! The VM's text-prompt tokenizer (full build only): built at configure time from the `tokenizer`
//! section, or loaded once its Hugging Face bundle is fetched at run time ([`super::bundle`]). In the
//! lean build this part holds nothing, a `tokenizer` section is refused, and text prompts keep the
//! approximate identity.

use crate::config::{ConfigError, FilterConfig};
use kvsteer_core::request::PromptTokenizer;
#[cfg(feature = "tokenizer")]
use kvsteer_tokenizer::TextTokenizer;

/// The tokenizer and, when it is fetched at run time, the fetch of its bundle.
#[derive(Default)]
pub struct Prompts {
    /// Text-prompt tokenizer, when configured (and, when fetched, loaded).
    #[cfg(feature = "tokenizer")]
    tokenizer: Option<TextTokenizer>,
    /// The Hugging Face bundle's fetch, when it is fetched at run time (`huggingface.fetch`): the
    /// tokenizer is `None` until it has loaded.
    #[cfg(feature = "tokenizer")]
    pub(super) bundle: Option<super::bundle::BundleFetchState>,
}

/// The tokenizer's refusal as the plugin configuration's: the tokenizer writes `field: message`
/// with the field relative to its own section, which is `tokenizer` here.
#[cfg(feature = "tokenizer")]
fn tokenizer_error(e: String) -> ConfigError {
    match e.split_once(": ") {
        Some((field, message)) => ConfigError::at(format!("tokenizer.{field}"), message),
        None => ConfigError::at("tokenizer", e),
    }
}

impl Prompts {
    /// The configuration's tokenizer, built now or its bundle's fetch planned; nothing without a
    /// `tokenizer` section (or in the lean build, where the configuration refuses one).
    #[cfg(feature = "tokenizer")]
    pub fn new(cfg: &FilterConfig) -> Result<Prompts, ConfigError> {
        let (tokenizer, bundle) = match &cfg.tokenizer {
            Some(t) => match TextTokenizer::deferred(t) {
                Some(f) => {
                    TextTokenizer::check_deferred(t).map_err(tokenizer_error)?;
                    (None, Some(super::bundle::BundleFetchState::new(f.clone())))
                }
                None => (Some(TextTokenizer::new(t).map_err(tokenizer_error)?), None),
            },
            None => (None, None),
        };
        Ok(Prompts { tokenizer, bundle })
    }

    /// The lean build: no tokenizer.
    #[cfg(not(feature = "tokenizer"))]
    pub fn new(_cfg: &FilterConfig) -> Result<Prompts, ConfigError> {
        Ok(Prompts {})
    }

    /// The tokenizer as the core reads a prompt with it; `None` without one (or in the lean build).
    pub fn tokenizer(&mut self) -> Option<&mut dyn PromptTokenizer> {
        #[cfg(feature = "tokenizer")]
        let tok = self
            .tokenizer
            .as_mut()
            .map(|t| t as &mut dyn PromptTokenizer);
        #[cfg(not(feature = "tokenizer"))]
        let tok: Option<&mut dyn PromptTokenizer> = None;
        tok
    }

    /// Whether text prompts are tokenized now.
    #[cfg(feature = "tokenizer")]
    pub fn ready(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// The tokenizer's counters, when there is one.
    #[cfg(feature = "tokenizer")]
    pub fn stats(&self) -> Option<kvsteer_tokenizer::TokenizerStats> {
        self.tokenizer.as_ref().map(|t| t.stats())
    }

    /// Installs the tokenizer a fetched bundle built.
    #[cfg(feature = "tokenizer")]
    pub(super) fn install(&mut self, tokenizer: TextTokenizer) {
        self.tokenizer = Some(tokenizer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> FilterConfig {
        let json = format!(
            r#"{{"replicas":[{{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}}]{extra}}}"#
        );
        FilterConfig::from_json(json.as_bytes()).unwrap()
    }

    #[test]
    fn no_section_no_tokenizer() {
        let mut p = Prompts::new(&cfg("")).unwrap();
        assert!(p.tokenizer().is_none());
    }

    #[cfg(feature = "tokenizer")]
    #[test]
    fn a_built_in_vocabulary_is_ready_at_once_and_a_bad_one_is_refused_by_name() {
        let section =
            r#","tokenizer":{"vocabulary":"o200k_harmony","chat_template":"kvsteer_sim"}"#;
        let mut p = Prompts::new(&cfg(section)).unwrap();
        assert!(p.ready() && p.bundle.is_none());
        assert!(p.tokenizer().is_some());
        assert_eq!(p.stats().map(|s| s.exact), Some(0));
        let bad = section.replace("kvsteer_sim", "nope");
        let e = Prompts::new(&cfg(&bad)).err().unwrap();
        assert!(e.to_string().contains("tokenizer.chat_template"), "{e}");
    }
}

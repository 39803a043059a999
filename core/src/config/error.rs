//! The one configuration refusal type.

/// A configuration problem, naming the field. The one refusal type of the routing core and of the
/// filter built on it, so a host, `kvsteer-check` and the component handle one error whichever layer
/// refused; `document` keeps each layer's message as it reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The configuration the field path starts from, printed before it: [`ConfigError::ROUTING`] for
    /// a [`RoutingConfig`]; empty where the path starts at the root of what the host handed over (the
    /// filter's plugin configuration, whose `routing` field nests a routing configuration's error).
    pub document: &'static str,
    /// Dotted path of the field (`kv_load.temperature`), or `.` for the document itself.
    pub field: String,
    pub message: String,
}

impl ConfigError {
    /// The `document` of a routing configuration's errors.
    pub const ROUTING: &'static str = "routing config";

    /// A routing configuration's field refused.
    pub fn routing(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            document: Self::ROUTING,
            field: field.into(),
            message: message.into(),
        }
    }

    /// A field refused in a document whose paths start at its root (the filter's plugin
    /// configuration): printed as `field: message`.
    pub fn at(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            document: "",
            field: field.into(),
            message: message.into(),
        }
    }
}

impl core::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if !self.document.is_empty() {
            write!(f, "{}: ", self.document)?;
        }
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

pub(crate) fn err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::routing(field, message)
}

/// The one check of a field that must be a finite number >= 0 (a weight, a scale, a count of
/// tokens): every section's such fields are refused with the same words.
pub(crate) fn non_negative(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(err(field, format!("must be a finite number >= 0, got {v}")))
    }
}

//! Shedding (`routing.admission`, docs/design/admission.md) checked against the rest of the
//! filter's configuration.

use super::{ConfigError, FilterConfig, err};

impl FilterConfig {
    /// Shedding fits a fleet where one decision sends the request (not a P/D fleet's two legs), and
    /// the priority header must not be one the filter writes or reads for something else: removing
    /// an untrusted copy would remove the filter's own.
    pub(super) fn validate_admission(&self) -> Result<(), ConfigError> {
        let Some(a) = &self.routing.admission else {
            return Ok(());
        };
        if self.disaggregated() {
            return err(
                "routing.admission",
                "not supported in a prefill/decode fleet (replicas with roles)",
            );
        }
        if let Some(h) = &a.priority_header {
            let taken = [
                ("destination_header", &self.destination_header),
                ("cluster_header", &self.cluster_header),
                ("rank_header", &self.rank_header),
                ("session_header", &self.session_header),
            ];
            for (field, name) in taken {
                if name.eq_ignore_ascii_case(h) {
                    return err(
                        "routing.admission.priority_header",
                        format!("{h:?} is already {field}"),
                    );
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::FilterConfig;

    #[test]
    fn admission_is_checked_against_the_rest_of_the_configuration() {
        let replicas =
            r#""replicas":[{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}]"#;
        let with = |extra: &str| {
            FilterConfig::from_json(format!("{{{replicas}, {extra}}}").as_bytes()).map(|_| ())
        };
        assert!(with(r#""routing":{"admission":{"priority_header":"x-priority"}}"#).is_ok());
        let e =
            with(r#""routing":{"admission":{"priority_header":"x-gateway-destination-endpoint"}}"#)
                .unwrap_err();
        assert!(e.to_string().contains("already destination_header"), "{e}");
        let e = with(r#""routing":{"admission":{"bounds_s":{"urgent":1}}}"#).unwrap_err();
        assert!(e.to_string().contains("admission.bounds_s.urgent"), "{e}");
        let pd = r#""replicas":[
            {"name":"p","endpoint":"127.0.0.1:8000","feed_cluster":"f0","role":"prefill","prefill_cluster":"c"},
            {"name":"d","endpoint":"127.0.0.1:8001","feed_cluster":"f1","role":"decode"}],
            "routing":{"admission":{}}"#;
        let e = FilterConfig::from_json(format!("{{{pd}}}").as_bytes()).unwrap_err();
        assert!(e.to_string().contains("prefill/decode"), "{e}");
    }
}

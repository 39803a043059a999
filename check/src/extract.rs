//! Finds the plugin configuration strings in what an operator deploys, so that the check judges the
//! exact bytes the proxy will hand to `on_configure`, not a copy kept beside the deployment.
//!
//! Read: the plugin configuration itself; an Envoy bootstrap or Istio manifests (YAML or JSON, one
//! or several documents: every Envoy wasm filter's `configuration`, every `WasmPlugin`'s
//! `pluginConfig`); nginx.conf (every `proxy_wasm` directive's argument). Not read: configurations
//! that arrive over xDS only, nginx `include` files, Helm templates.

use serde_yaml::Value;

/// The Envoy wasm filter's type: its `config.configuration` is what `on_configure` reads.
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const STRING_VALUE: &str = "type.googleapis.com/google.protobuf.StringValue";
/// Envoy hands a Struct to the plugin serialized as JSON.
const STRUCT: &str = "type.googleapis.com/google.protobuf.Struct";

/// What the input is; `Auto` looks at it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Auto,
    /// The plugin configuration JSON itself.
    Plugin,
    /// An Envoy bootstrap, an Istio `EnvoyFilter` or `WasmPlugin` (YAML or JSON, multi-document).
    Manifest,
    /// nginx.conf with ngx_wasm_module's `proxy_wasm` directives.
    Nginx,
}

/// One plugin configuration found in the input.
#[derive(Debug, PartialEq, Eq)]
pub struct Found {
    /// Where it sits, for the operator; `None` when the input is the configuration itself.
    pub place: Option<String>,
    pub bytes: Vec<u8>,
    /// The clusters of the Envoy bootstrap it sits in, where that bootstrap defines all of its
    /// clusters statically (no CDS): the only ones its callouts can reach. `None` elsewhere.
    pub clusters: Option<Vec<String>>,
}

/// Every plugin configuration in `input`, or why none can be read (the exit-2 case).
pub fn extract(input: &[u8], format: Format) -> Result<Vec<Found>, String> {
    let format = match format {
        Format::Auto => detect(input),
        f => f,
    };
    match format {
        // The bytes as they are, even if they are not JSON: the filter's parser gives the verdict.
        Format::Plugin | Format::Auto => Ok(vec![Found {
            place: None,
            bytes: input.to_vec(),
            clusters: None,
        }]),
        Format::Manifest => {
            let docs = yaml_documents(text(input)?)?;
            let found = from_manifests(&docs)?;
            if found.is_empty() {
                return Err("no Envoy wasm filter configuration and no WasmPlugin found".into());
            }
            Ok(found)
        }
        Format::Nginx => {
            let found = from_nginx(text(input)?)?;
            if found.is_empty() {
                return Err("no proxy_wasm directive found".into());
            }
            Ok(found)
        }
    }
}

fn text(input: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(input).map_err(|e| format!("not UTF-8 text: {e}"))
}

/// A manifest has one of these top-level keys; a plugin configuration never does (the filter refuses
/// unknown fields), so a bootstrap without a wasm filter is reported as such instead of being judged
/// as a plugin configuration.
const MANIFEST_KEYS: [&str; 5] = [
    "static_resources",
    "dynamic_resources",
    "admin",
    "apiVersion",
    "kind",
];

fn detect(input: &[u8]) -> Format {
    if let Ok(s) = std::str::from_utf8(input) {
        if let Ok(docs) = yaml_documents(s) {
            let manifest = docs.iter().any(|d| {
                d.as_mapping()
                    .is_some_and(|m| MANIFEST_KEYS.iter().any(|k| m.contains_key(*k)))
            });
            if manifest {
                return Format::Manifest;
            }
        }
        if from_nginx(s).is_ok_and(|f| !f.is_empty()) {
            return Format::Nginx;
        }
    }
    Format::Plugin
}

fn yaml_documents(s: &str) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    for de in serde_yaml::Deserializer::from_str(s) {
        let mut v = Value::deserialize(de).map_err(|e| format!("not YAML or JSON: {e}"))?;
        v.apply_merge()
            .map_err(|e| format!("YAML merge keys: {e}"))?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

use serde::Deserialize as _;

fn from_manifests(docs: &[Value]) -> Result<Vec<Found>, String> {
    let mut out = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        let doc_place = if docs.len() > 1 {
            format!("document {}, ", i + 1)
        } else {
            String::new()
        };
        if doc.get("kind").and_then(Value::as_str) == Some("WasmPlugin") {
            let name = doc
                .get("metadata")
                .and_then(|m| m.get("name"))
                .and_then(Value::as_str)
                .unwrap_or("?");
            let place = format!("{doc_place}WasmPlugin {name:?} pluginConfig");
            // Istio sends a missing pluginConfig as an empty configuration, which the filter refuses.
            let bytes = match doc.get("spec").and_then(|s| s.get("pluginConfig")) {
                None => Vec::new(),
                Some(v) => serde_json::to_vec(v).map_err(|e| format!("{place}: {e}"))?,
            };
            out.push(Found {
                place: Some(place),
                bytes,
                clusters: None,
            });
            continue;
        }
        let first = out.len();
        walk(doc, &doc_place, &mut out)?;
        if let Some(names) = static_clusters(doc) {
            for f in &mut out[first..] {
                f.clusters = Some(names.clone());
            }
        }
    }
    Ok(out)
}

/// The names of an Envoy bootstrap's clusters when it defines them all statically: a bootstrap with
/// `static_resources.clusters` and no `dynamic_resources.cds_config`. `None` for anything else (an
/// Istio manifest, a bootstrap whose clusters come over CDS), where the check cannot know them.
fn static_clusters(doc: &Value) -> Option<Vec<String>> {
    let clusters = doc
        .get("static_resources")?
        .get("clusters")?
        .as_sequence()?;
    if doc
        .get("dynamic_resources")
        .and_then(|d| d.get("cds_config"))
        .is_some()
    {
        return None;
    }
    Some(
        clusters
            .iter()
            .filter_map(|c| c.get("name").and_then(Value::as_str).map(str::to_string))
            .collect(),
    )
}

/// Every Envoy wasm filter config under `v`, wherever it sits (a listener's filter chain, an
/// `EnvoyFilter` patch, an ECDS resource).
fn walk(v: &Value, doc_place: &str, out: &mut Vec<Found>) -> Result<(), String> {
    match v {
        Value::Mapping(m) => {
            if m.get("@type").and_then(Value::as_str) == Some(WASM_TYPE) {
                let config = m.get("config");
                let name = config
                    .and_then(|c| c.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let place = format!("{doc_place}wasm filter {name:?}");
                let bytes = configuration(config.and_then(|c| c.get("configuration")))
                    .map_err(|e| format!("{place}: {e}"))?;
                out.push(Found {
                    place: Some(place),
                    bytes,
                    clusters: None,
                });
                return Ok(());
            }
            for (_, child) in m {
                walk(child, doc_place, out)?;
            }
        }
        Value::Sequence(s) => {
            for child in s {
                walk(child, doc_place, out)?;
            }
        }
        Value::Tagged(t) => walk(&t.value, doc_place, out)?,
        _ => {}
    }
    Ok(())
}

/// The bytes Envoy hands to the plugin for a `configuration` (a `google.protobuf.Any`).
fn configuration(any: Option<&Value>) -> Result<Vec<u8>, String> {
    // No configuration: the plugin is configured with an empty one.
    let Some(any) = any else {
        return Ok(Vec::new());
    };
    match any.get("@type").and_then(Value::as_str) {
        Some(STRING_VALUE) => match any.get("value") {
            Some(Value::String(s)) => Ok(s.as_bytes().to_vec()),
            None => Ok(Vec::new()),
            Some(_) => Err("configuration: a StringValue's value must be a string".into()),
        },
        Some(STRUCT) => {
            // The JSON form of an Any holding a Struct keeps the object under `value`.
            let value = any.get("value").cloned().unwrap_or(Value::Null);
            serde_json::to_vec(&value).map_err(|e| format!("configuration: {e}"))
        }
        Some(other) => Err(format!(
            "configuration of type {other} is not read by this check (StringValue and Struct are)"
        )),
        None => Err("configuration without an @type".into()),
    }
}

/// Every `proxy_wasm MODULE [CONFIG];` directive's configuration, by nginx's own quoting rules: a
/// `'...'` or `"..."` argument where a backslash escapes the quote and itself (`\n`, `\r`, `\t` are
/// control characters), `#` starts a comment outside quotes.
fn from_nginx(s: &str) -> Result<Vec<Found>, String> {
    let mut out = Vec::new();
    // The directive being read: its line and arguments so far; `None` outside a `proxy_wasm`.
    let mut directive: Option<(usize, Vec<String>)> = None;
    let mut at_statement_start = true;
    let mut line = 1;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' => line += 1,
            c if c.is_whitespace() => {}
            '#' => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        line += 1;
                        break;
                    }
                }
            }
            ';' | '{' | '}' => {
                if let Some((at, args)) = directive.take() {
                    if c != ';' {
                        return Err(format!("line {at}: proxy_wasm directive not ended by ';'"));
                    }
                    let place =
                        format!("proxy_wasm {} (line {at})", args.first().map_or("", |a| a));
                    match args.len() {
                        1 | 2 => out.push(Found {
                            place: Some(place),
                            bytes: args.get(1).cloned().unwrap_or_default().into_bytes(),
                            clusters: None,
                        }),
                        n => return Err(format!("{place}: {n} arguments, 1 or 2 expected")),
                    }
                }
                at_statement_start = true;
            }
            _ => {
                let start_line = line;
                let token = if c == '\'' || c == '"' {
                    quoted(&mut chars, c, &mut line).ok_or_else(|| {
                        format!("line {start_line}: unterminated {c}-quoted string")
                    })?
                } else {
                    let mut token = String::new();
                    token.push(c);
                    while let Some(&d) = chars.peek() {
                        if d.is_whitespace() || matches!(d, ';' | '{' | '}') {
                            break;
                        }
                        token.push(d);
                        chars.next();
                    }
                    token
                };
                if let Some((_, args)) = directive.as_mut() {
                    args.push(token);
                } else if at_statement_start && token == "proxy_wasm" {
                    directive = Some((start_line, Vec::new()));
                }
                at_statement_start = false;
            }
        }
    }
    if let Some((at, _)) = directive {
        return Err(format!("line {at}: proxy_wasm directive not ended by ';'"));
    }
    Ok(out)
}

/// A `quote`-quoted argument, read after its opening quote by nginx's escapes, with the lines it
/// spans counted into `line`; `None` when the text ends before the closing quote.
fn quoted(
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
    quote: char,
    line: &mut usize,
) -> Option<String> {
    let mut token = String::new();
    while let Some(d) = chars.next() {
        match d {
            '\\' => match chars.next() {
                Some('n') => token.push('\n'),
                Some('r') => token.push('\r'),
                Some('t') => token.push('\t'),
                Some(e) if e == quote || e == '\\' => token.push(e),
                Some(e) => {
                    if e == '\n' {
                        *line += 1;
                    }
                    token.push('\\');
                    token.push(e);
                }
                None => break,
            },
            d if d == quote => return Some(token),
            d => {
                if d == '\n' {
                    *line += 1;
                }
                token.push(d);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(input: &str, format: Format) -> (Option<String>, String) {
        let mut found = extract(input.as_bytes(), format).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        let f = found.remove(0);
        (f.place, String::from_utf8(f.bytes).unwrap())
    }

    #[test]
    fn a_plain_configuration_is_passed_as_it_is_even_when_it_is_not_json() {
        assert_eq!(
            one("{\"replicas\": []}", Format::Auto),
            (None, "{\"replicas\": []}".into())
        );
        assert_eq!(one("not json {", Format::Auto), (None, "not json {".into()));
    }

    #[test]
    fn an_envoy_string_value_is_taken_verbatim() {
        let y = r#"
static_resources:
  listeners:
  - filter_chains:
    - filters:
      - typed_config:
          http_filters:
          - typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: kvsteer
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: |
                    {"replicas": 1}
"#;
        let (place, json) = one(y, Format::Auto);
        assert_eq!(place.as_deref(), Some("wasm filter \"kvsteer\""));
        assert_eq!(json, "{\"replicas\": 1}\n");
    }

    #[test]
    fn a_struct_configuration_and_a_missing_one() {
        let y = r#"{"a": [{"@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
          "config": {"configuration": {"@type": "type.googleapis.com/google.protobuf.Struct",
                                       "value": {"tick_ms": 5}}}},
          {"@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm", "config": {}}],
          "admin": {}}"#;
        let found = extract(y.as_bytes(), Format::Auto).unwrap();
        assert_eq!(found[0].bytes, br#"{"tick_ms":5}"#);
        assert!(found[1].bytes.is_empty());
    }

    #[test]
    fn a_wasm_plugin_among_other_documents() {
        let y = "kind: Gateway\n---\napiVersion: x\nkind: WasmPlugin\nmetadata: {name: k}\n\
                 spec:\n  pluginConfig:\n    replicas: [{name: a, endpoint: \"1.2.3.4:80\"}]\n";
        let (place, json) = one(y, Format::Auto);
        assert_eq!(
            place.as_deref(),
            Some("document 2, WasmPlugin \"k\" pluginConfig")
        );
        assert_eq!(
            json,
            r#"{"replicas":[{"name":"a","endpoint":"1.2.3.4:80"}]}"#
        );
    }

    #[test]
    fn a_manifest_without_the_filter_is_unreadable_not_judged() {
        let e = extract(b"admin: {}\nstatic_resources: {}\n", Format::Auto).unwrap_err();
        assert!(e.contains("no Envoy wasm filter"), "{e}");
    }

    #[test]
    fn nginx_quoting_comments_and_lines() {
        let conf = "# proxy_wasm commented 'x';\nhttp {\n  location / {\n    proxy_wasm kvsteer \
                    '{\"a\": \"it\\'s\"}';\n    proxy_wasm other;\n  }\n}\n";
        let found = extract(conf.as_bytes(), Format::Auto).unwrap();
        assert_eq!(found.len(), 2);
        assert_eq!(
            found[0].place.as_deref(),
            Some("proxy_wasm kvsteer (line 4)")
        );
        assert_eq!(found[0].bytes, br#"{"a": "it's"}"#);
        assert_eq!(found[1].place.as_deref(), Some("proxy_wasm other (line 5)"));
        assert!(found[1].bytes.is_empty());
        let e = extract(b"proxy_wasm k 'open;\n", Format::Nginx).unwrap_err();
        assert!(e.contains("unterminated"), "{e}");
    }
}

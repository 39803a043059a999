//! The `tojson` filter as Hugging Face chat templates see it.
//!
//! transformers replaces Jinja2's `tojson` for chat templates with a plain `json.dumps(x,
//! ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)` (source:
//! transformers `utils/chat_template_utils.py`, which notes that Jinja's own filter escapes HTML
//! characters). minijinja's built-in `tojson` is Jinja2's: compact separators and `<`, `>`, `&`, `'`
//! escaped as `\u003c` and so on, so `{"a": "<b>"}` would render as `{"a":"\u003cb\u003e"}` where the
//! engine renders `{"a": "<b>"}`. Tokens differ, blocks differ; hence this module: Python's output,
//! byte for byte, for the values a template can hold.
//!
//! Maps keep insertion order (minijinja's `preserve_order`), as Python's dicts do: a dict literal
//! written in a template (`{'b': 1, 'a': 2}`) and a request's `tools` JSON are written in the order
//! they were given, and `sort_keys=true` sorts them.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Nesting deeper than this is refused (Python has no limit short of recursion; a template never needs
/// this much and the VM's stack is small).
const MAX_DEPTH: usize = 128;

struct Style {
    ensure_ascii: bool,
    /// `None`: one line.
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn invalid(msg: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg)
}

/// `value | tojson(indent=None, ensure_ascii=False, separators=None, sort_keys=False)`, keyword
/// arguments only (as templates call it).
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    // json.dumps: an int indent is that many spaces (negative counts as 0), a string is used as is.
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match (v.as_i64(), v.as_str()) {
            (Some(n), _) => " ".repeat(n.clamp(0, 64) as usize),
            (None, Some(s)) => s.to_string(),
            _ => {
                return Err(invalid(format!(
                    "tojson: indent must be an int or a string, not {}",
                    v.kind()
                )));
            }
        }),
    };
    // Python's defaults: (', ', ': ') on one line, (',', ': ') with an indent.
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => return Err(invalid("tojson: separators must be two strings".into())),
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = Style {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(out)
}

fn write_value(out: &mut String, v: &Value, s: &Style, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(invalid("tojson: value nested too deeply".into()));
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => {
            let f = f64::try_from(v.clone())?;
            out.push_str(&python_float(f));
        }
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default(), s.ensure_ascii),
        ValueKind::Seq => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), s, depth, |out, i| {
                write_value(out, &items[i], s, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for k in v.try_iter()? {
                let item = v.get_item(&k)?;
                entries.push((key_text(&k)?, item));
            }
            if s.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', entries.len(), s, depth, |out, i| {
                write_str(out, &entries[i].0, s.ensure_ascii);
                out.push_str(&s.key_sep);
                write_value(out, &entries[i].1, s, depth + 1)
            })?;
        }
        // Python's json.dumps refuses these (Undefined, generators, objects, bytes) with a TypeError.
        other => {
            return Err(invalid(format!(
                "tojson: object of kind {other} is not JSON serializable"
            )));
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    s: &Style,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&s.item_sep);
        }
        if let Some(ind) = &s.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth + 1));
        }
        item(out, i)?;
    }
    if let Some(ind) = &s.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// json.dumps turns int, float, bool and None keys into strings; other keys are a TypeError.
fn key_text(k: &Value) -> Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or_default().to_string()),
        ValueKind::Number if k.is_integer() => Ok(k.to_string()),
        ValueKind::Number => Ok(python_float(f64::try_from(k.clone())?)),
        ValueKind::Bool => Ok(if k.is_true() { "true" } else { "false" }.into()),
        ValueKind::None => Ok("null".into()),
        other => Err(invalid(format!(
            "tojson: keys must be str, int, float, bool or None, not {other}"
        ))),
    }
}

/// Python's `json.encoder` string escaping: `"` `\` and the C0 controls always (the five common ones by
/// name, the rest as `\u00XX`, lowercase hex); with `ensure_ascii` everything from DEL up as `\uXXXX`,
/// astral characters as surrogate pairs.
fn write_str(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) >= 0x7f => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `float.__repr__` as json.dumps prints it: the shortest round-trip digits, positional for
/// exponents from -4 to 15, otherwise `1e+16` style; NaN and infinities as JavaScript names.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let exp = f.abs().log10().floor() as i32;
    // Rust's `{:e}` gives the same shortest digits, as "1.5e-7" / "1e16".
    let sci = format!("{f:e}");
    let (mantissa, e) = sci.split_once('e').unwrap_or((&sci, "0"));
    let e: i32 = e.parse().unwrap_or(exp);
    if (-4..16).contains(&e) {
        // Positional: Rust's Debug prints the same shortest digits with a ".0" for integral values.
        format!("{f:?}")
    } else {
        let sign = if e < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", e.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::{Environment, context};

    fn render(src: &str, ctx: Value) -> Result<String, Error> {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(src, ctx)
    }

    #[test]
    fn matches_python_json_dumps() {
        // Expected strings are what CPython 3's json.dumps prints for the same values.
        let v = Value::from_serialize(serde_json_like());
        assert_eq!(
            render("{{ v | tojson }}", context! { v => v.clone() }).unwrap(),
            r#"{"a": [1, 2.5, true, null], "b": "<tag> & 'q' \"d\" \\ é\n\u0001"}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2) }}", context! { v => v.clone() }).unwrap(),
            "{\n  \"a\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"b\": \"<tag> & 'q' \\\"d\\\" \\\\ é\\n\\u0001\"\n}"
        );
        assert_eq!(
            render("{{ 'é😀\x7f' | tojson(ensure_ascii=true) }}", context! {}).unwrap(),
            r#""\u00e9\ud83d\ude00\u007f""#
        );
        assert_eq!(
            render("{{ [[], {}] | tojson(indent=4) }}", context! {}).unwrap(),
            "[\n    [],\n    {}\n]"
        );
        assert_eq!(
            render("{{ [1, 2] | tojson(separators=[',', ':']) }}", context! {}).unwrap(),
            "[1,2]"
        );
        assert_eq!(
            render(
                "{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}",
                context! {}
            )
            .unwrap(),
            r#"{"a": 2, "b": 1}"#
        );
        assert_eq!(
            render("{{ {'b': 1, 'a': 2} | tojson }}", context! {}).unwrap(),
            r#"{"b": 1, "a": 2}"#
        );
    }

    fn serde_json_like() -> std::collections::BTreeMap<&'static str, Value> {
        let mut m = std::collections::BTreeMap::new();
        m.insert(
            "a",
            Value::from(vec![
                Value::from(1),
                Value::from(2.5),
                Value::from(true),
                Value::from(()),
            ]),
        );
        m.insert("b", Value::from("<tag> & 'q' \"d\" \\ é\n\u{1}"));
        m
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (f, py) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e300, "-2.5e+300"),
            (-0.0, "-0.0"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(python_float(f), py, "{f}");
        }
    }

    #[test]
    fn refuses_what_python_refuses() {
        assert!(render("{{ missing | tojson }}", context! {}).is_err());
        assert!(render("{{ 1 | tojson(bogus=1) }}", context! {}).is_err());
        assert!(render("{{ 1 | tojson(indent=[1]) }}", context! {}).is_err());
        let deep = (0..200).fold(Value::from(1), |v, _| Value::from(vec![v]));
        assert!(render("{{ v | tojson }}", context! { v => deep }).is_err());
    }
}

//! JSON string escapes turned into text, the way serde_json reads them (a lone surrogate refused),
//! for the strings the one-pass reader cannot borrow from the body.

/// A string's value from its raw text (escapes already checked for form). None for a lone
/// surrogate, which serde_json refuses in a string it reads.
pub(super) fn unescape(raw: &str) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(p) = rest.find('\\') {
        out.push_str(rest.get(..p)?);
        let esc = rest.get(p + 1..)?;
        let mut chars = esc.chars();
        let c = match chars.next()? {
            '"' => '"',
            '\\' => '\\',
            '/' => '/',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'u' => {
                let hi = hex4(esc.get(1..5)?)?;
                match hi {
                    0xD800..=0xDBFF => {
                        if esc.get(5..7)? != "\\u" {
                            return None;
                        }
                        let lo = hex4(esc.get(7..11)?)?;
                        if !(0xDC00..=0xDFFF).contains(&lo) {
                            return None;
                        }
                        let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                        out.push(char::from_u32(c)?);
                        rest = esc.get(11..)?;
                        continue;
                    }
                    0xDC00..=0xDFFF => return None,
                    _ => {
                        out.push(char::from_u32(hi)?);
                        rest = esc.get(5..)?;
                        continue;
                    }
                }
            }
            _ => return None,
        };
        out.push(c);
        rest = esc.get(1..)?;
    }
    out.push_str(rest);
    Some(out)
}

/// The code unit of the `\uXXXX` escape at `b[at..]`; None when there is none.
pub(super) fn hex_escape(b: &[u8], at: usize) -> Option<u32> {
    if b.get(at..at + 2)? != b"\\u" {
        return None;
    }
    hex4(core::str::from_utf8(b.get(at + 2..at + 6)?).ok()?)
}

pub(super) fn hex4(s: &str) -> Option<u32> {
    if s.len() != 4 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

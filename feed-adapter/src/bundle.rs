//! The engine's tokenizer bundle, served at `GET /kvsteer/tokenizer` for routers that fetch it
//! (`tokenizer.huggingface.fetch`, docs/design/tokenizer.md): the model folder's `tokenizer.json` and
//! `tokenizer_config.json` (`--model-dir`), framed once at start in the core's bundle format
//! ([`kvsteer_core::bundle`]) with the model name (`--model-name`), and logged with its SHA-256,
//! the digest the router's configuration names.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use sha2::{Digest, Sha256};
use std::path::Path;

/// Files larger than this are refused at start (the bundles in use are 7-10 MB).
const MAX_FILE_BYTES: u64 = 256 << 20;

/// The framed bundle and its digest.
#[derive(Clone, Debug)]
pub struct ServedBundle {
    pub body: Bytes,
    pub sha256: String,
}

/// Reads `dir/tokenizer.json` (required) and `dir/tokenizer_config.json` (when present) and frames
/// them. Errors name the file.
pub fn load(dir: &Path, model: Option<&str>) -> Result<ServedBundle, String> {
    let read = |name: &str| -> Result<Option<Vec<u8>>, String> {
        let path = dir.join(name);
        match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
            Ok(m) if m.len() > MAX_FILE_BYTES => {
                return Err(format!(
                    "{}: {} bytes, over 256 MiB",
                    path.display(),
                    m.len()
                ));
            }
            Ok(_) => {}
        }
        std::fs::read(&path)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    let json = read("tokenizer.json")?
        .ok_or_else(|| format!("{}: no tokenizer.json there", dir.display()))?;
    let config = read("tokenizer_config.json")?;
    let body = kvsteer_core::bundle::encode(model, &json, config.as_deref());
    let sha256 = Sha256::digest(&body)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(ServedBundle {
        body: Bytes::from(body),
        sha256,
    })
}

/// The bundle `--model-dir` and `--model-name` ask for, logged with its size and digest.
pub fn from_args(args: &crate::config::Args) -> Result<Option<ServedBundle>, String> {
    let Some(dir) = &args.model_dir else {
        return Ok(None);
    };
    let b = load(dir, args.model_name.as_deref())?;
    tracing::info!(bytes = b.body.len(), sha256 = %b.sha256, dir = %dir.display(),
        "serving the tokenizer bundle at {}", kvsteer_core::bundle::BUNDLE_PATH);
    Ok(Some(b))
}

/// The answer to `GET /kvsteer/tokenizer`: the bundle, or 404 without `--model-dir`.
pub fn answer(bundle: Option<&ServedBundle>) -> Response {
    let Some(b) = bundle else {
        return (
            StatusCode::NOT_FOUND,
            "no tokenizer bundle: start kvsteer-feed with --model-dir\n",
        )
            .into_response();
    };
    let mut r = (
        [(
            header::CONTENT_TYPE,
            kvsteer_core::bundle::BUNDLE_CONTENT_TYPE,
        )],
        b.body.clone(),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&b.sha256) {
        r.headers_mut().insert("x-kvsteer-bundle-sha256", v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_folder_is_framed_and_digested() {
        let dir = std::env::temp_dir().join(format!("kvsteer-bundle-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(load(&dir, None).unwrap_err().contains("no tokenizer.json"));
        std::fs::write(dir.join("tokenizer.json"), b"{\"model\":{}}").unwrap();
        let b = load(&dir, Some("m")).unwrap();
        let d = kvsteer_core::bundle::decode(&b.body).unwrap();
        assert_eq!((d.model, d.tokenizer_config_json), (Some("m"), None));
        std::fs::write(dir.join("tokenizer_config.json"), b"{}").unwrap();
        let b2 = load(&dir, Some("m")).unwrap();
        assert_eq!(
            kvsteer_core::bundle::decode(&b2.body)
                .unwrap()
                .tokenizer_config_json,
            Some(&b"{}"[..])
        );
        assert_ne!(b.sha256, b2.sha256);
        assert_eq!(b2.sha256.len(), 64);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

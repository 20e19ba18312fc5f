//! The caller's side of the head's bearer-token authentication: a token given as a flag
//! (`--head-token`, `--token`) or read from a file (`--head-token-file`, `--token-file`; the
//! whole file, surrounding whitespace trimmed, read again on every connection so a rotated
//! Kubernetes Secret is picked up), sent as `authorization: Bearer TOKEN` metadata on every
//! `HeadService` call by the [`HeadBearer`] interceptor. The head's side (token file, roles,
//! audit log) is `prism_head::auth`.

use std::path::{Path, PathBuf};

use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::proto::v1::head_service_client::HeadServiceClient;

/// The gRPC metadata key carrying the token (`authorization: Bearer TOKEN`).
pub const AUTHORIZATION: &str = "authorization";

/// A `HeadService` client whose calls carry the caller's token (or none).
pub type HeadClient = HeadServiceClient<InterceptedService<Channel, HeadBearer>>;

/// Wraps `channel` into a [`HeadClient`] that sends `bearer` on every call.
pub fn head_client(channel: Channel, bearer: HeadBearer) -> HeadClient {
    HeadServiceClient::with_interceptor(channel, bearer).max_decoding_message_size(MAX_HEAD_RESPONSE_BYTES)
}

/// Largest head response a client decodes (tonic's default is 4 MiB): a cluster status or
/// route table lists every replica (about 120 bytes each), so a large deployment's would not
/// fit the default.
pub const MAX_HEAD_RESPONSE_BYTES: usize = 256 << 20;

/// The flags of a component that calls the head (`prism-worker`, `prism-router`):
/// `--head-token` / `PRISM_HEAD_TOKEN` or `--head-token-file` / `PRISM_HEAD_TOKEN_FILE`.
/// `Debug` never shows the token.
#[derive(Clone, Default, clap::Args)]
pub struct HeadTokenArgs {
    /// Bearer token presented to the head (its `--auth-token-file` gives it the role
    /// `worker` or `router`). Prefer --head-token-file: a flag shows in `ps`.
    #[arg(long = "head-token", env = "PRISM_HEAD_TOKEN", hide_env_values = true, conflicts_with = "head_token_file")]
    pub head_token: Option<String>,
    /// File holding the bearer token presented to the head (a mounted Kubernetes Secret),
    /// read again on every connection so a rotated secret is picked up.
    #[arg(long = "head-token-file", env = "PRISM_HEAD_TOKEN_FILE")]
    pub head_token_file: Option<PathBuf>,
}

impl std::fmt::Debug for HeadTokenArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeadTokenArgs")
            .field("head_token", &self.head_token.as_ref().map(|_| "<redacted>"))
            .field("head_token_file", &self.head_token_file)
            .finish()
    }
}

impl HeadTokenArgs {
    /// Where the token comes from.
    pub fn credential(&self) -> HeadCredential {
        HeadCredential::from_flags(self.head_token.clone(), self.head_token_file.clone())
    }
}

/// A token that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The token file cannot be read.
    #[error("cannot read the token file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The token (from `what`: a flag or a file) is empty or holds characters a gRPC header
    /// cannot carry (only visible ASCII is allowed); the token itself is never shown.
    #[error("the token from {what} is empty or not visible ASCII (no spaces or control characters)")]
    Invalid {
        /// `--head-token`, or the file's path.
        what: String,
    },
}

/// Where a caller's token comes from: nowhere (the head runs open), a literal, or a file.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum HeadCredential {
    /// No token: calls carry no `authorization` metadata.
    #[default]
    None,
    /// A token given directly (a flag or environment variable).
    Token(String),
    /// A file holding the token, read on every [`HeadCredential::bearer`] call.
    File(PathBuf),
}

impl std::fmt::Debug for HeadCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::Token(_) => f.write_str("Token(<redacted>)"),
            Self::File(p) => f.debug_tuple("File").field(p).finish(),
        }
    }
}

impl HeadCredential {
    /// From a pair of flags (`--head-token`, `--head-token-file`); the file wins when both are
    /// set (clap keeps them exclusive on the command line). Empty values count as unset.
    pub fn from_flags(token: Option<String>, file: Option<PathBuf>) -> Self {
        match (token.filter(|t| !t.is_empty()), file.filter(|p| !p.as_os_str().is_empty())) {
            (_, Some(p)) => Self::File(p),
            (Some(t), None) => Self::Token(t),
            (None, None) => Self::None,
        }
    }

    /// The interceptor for a new connection (reads the file now).
    ///
    /// # Errors
    /// [`TokenError`] when the file cannot be read or the token is unusable.
    pub fn bearer(&self) -> Result<HeadBearer, TokenError> {
        match self {
            Self::None => Ok(HeadBearer::default()),
            Self::Token(t) => HeadBearer::new(t, "--head-token"),
            Self::File(p) => HeadBearer::from_file(p),
        }
    }
}

/// Adds `authorization: Bearer TOKEN` to every request (nothing when it holds no token).
/// `Debug` never shows the token.
#[derive(Clone, Default)]
pub struct HeadBearer {
    value: Option<AsciiMetadataValue>,
}

impl std::fmt::Debug for HeadBearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.value.is_some() { "HeadBearer(<redacted>)" } else { "HeadBearer(none)" })
    }
}

impl HeadBearer {
    /// Sends `token`; `what` names its source in errors.
    ///
    /// # Errors
    /// [`TokenError::Invalid`] for an empty token or one with spaces or control characters.
    pub fn new(token: &str, what: &str) -> Result<Self, TokenError> {
        let token = token.trim();
        let invalid = || TokenError::Invalid { what: what.to_owned() };
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid());
        }
        let mut value: AsciiMetadataValue =
            MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| invalid())?;
        value.set_sensitive(true);
        Ok(Self { value: Some(value) })
    }

    /// Sends the token held in `path` (the whole file, whitespace around it trimmed).
    ///
    /// # Errors
    /// [`TokenError`] when the file cannot be read or holds no usable token.
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| TokenError::Read { path: path.to_owned(), source })?;
        Self::new(&text, &path.display().to_string())
    }

    /// True when calls carry a token.
    pub fn is_set(&self) -> bool {
        self.value.is_some()
    }
}

impl Interceptor for HeadBearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.value {
            request.metadata_mut().insert(AUTHORIZATION, v.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interceptor_adds_the_bearer_header() {
        let mut b = HeadBearer::new("  s3cret-token-value\n", "--head-token").expect("valid");
        let req = b.call(tonic::Request::new(())).expect("passes");
        assert_eq!(req.metadata().get(AUTHORIZATION).and_then(|v| v.to_str().ok()), Some("Bearer s3cret-token-value"));
        assert!(!format!("{b:?}").contains("s3cret"));
        let mut none = HeadBearer::default();
        assert!(none.call(tonic::Request::new(())).expect("passes").metadata().get(AUTHORIZATION).is_none());
    }

    #[test]
    fn unusable_tokens_are_refused_without_echoing_them() {
        for bad in ["", "   ", "two words", "tab\there"] {
            let Err(e) = HeadBearer::new(bad, "--head-token") else { panic!("{bad:?} accepted") };
            assert!(matches!(e, TokenError::Invalid { .. }));
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("token");
        std::fs::write(&file, "from-the-file\n").expect("write");
        let c = HeadCredential::from_flags(Some("flag".into()), Some(file.clone()));
        assert_eq!(c, HeadCredential::File(file.clone()));
        assert!(c.bearer().expect("reads").is_set());
        assert!(!format!("{:?}", HeadCredential::Token("hidden".into())).contains("hidden"));
        let missing = HeadCredential::File(dir.path().join("missing"));
        assert!(matches!(missing.bearer(), Err(TokenError::Read { .. })));
        assert_eq!(HeadCredential::from_flags(Some(String::new()), None), HeadCredential::None);
    }
}

//! Connections from the CLI to the head (admin RPCs) and the router (inference), with
//! addresses taken from `--head` / `--router` (env `PRISM_HEAD`, `PRISM_ROUTER`), and the
//! `--model` flag (env `PRISM_MODEL`) of the commands that ask the router for a model.

use anyhow::{Context, Result, bail};
use clap::Args;
use prism_common::head_auth::{HeadClient, HeadCredential, head_client};
use prism_common::proto::v1::ListModelsRequest;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Default head gRPC address (`prism up` and `prism-head` listen here).
pub const DEFAULT_HEAD: &str = "http://127.0.0.1:50050";
/// Default router gRPC address.
pub const DEFAULT_ROUTER: &str = "http://127.0.0.1:50051";

/// Where the cluster is, and the head's token: shared by every subcommand. `Debug` hides
/// the token.
#[derive(Args, Clone)]
pub struct Endpoints {
    /// Head gRPC address (admin commands: status, deploy, scale, cordon, drain).
    #[arg(long, global = true, env = "PRISM_HEAD", default_value = DEFAULT_HEAD)]
    pub head: String,
    /// Router gRPC address (generate, chat, bench).
    #[arg(long, global = true, env = "PRISM_ROUTER", default_value = DEFAULT_ROUTER)]
    pub router: String,
    /// Mutual TLS toward the head (admin commands); `prism up` ignores these and stays
    /// plaintext on loopback.
    #[command(flatten)]
    pub tls: prism_common::tls::TlsArgs,
    /// Bearer token for the head (a head with --auth-token-file asks for one: role `read`
    /// for status, `admin` for deploy, scale, cordon, drain). Prefer --token-file: a flag
    /// shows in `ps` and the shell history.
    #[arg(long, global = true, env = "PRISM_TOKEN", hide_env_values = true, conflicts_with = "token_file")]
    pub token: Option<String>,
    /// File holding the head's bearer token (read on each run).
    #[arg(long, global = true, env = "PRISM_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoints")
            .field("head", &self.head)
            .field("router", &self.router)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("token_file", &self.token_file)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Endpoints {
    /// The head and the credential the admin commands present to it.
    pub fn head_target(&self) -> HeadTarget {
        HeadTarget {
            addr: self.head.clone(),
            credential: HeadCredential::from_flags(self.token.clone(), self.token_file.clone()),
        }
    }
}

/// A head and the token presented to it.
#[derive(Clone, Debug)]
pub struct HeadTarget {
    /// gRPC address.
    pub addr: String,
    /// Token (none: an open head, as `prism up` runs it).
    pub credential: HeadCredential,
}

/// The served model a client command (generate, chat, bench) asks the router for.
#[derive(Args, Clone, Debug, Default)]
pub struct ModelArg {
    /// Served model name (default: the only model the router serves).
    #[arg(long = "model", value_name = "MODEL", env = "PRISM_MODEL")]
    pub name: Option<String>,
}

/// `--api-key`: the key a router with API keys asks for (`Debug` hides it).
#[derive(Args, Clone, Default)]
pub struct KeyArg {
    /// API key of the router, sent as `authorization: Bearer KEY` (vLLM's `--api-key`). A
    /// comma-separated list (PRISM_API_KEY as `prism up` and prism-router read it) sends its
    /// first key.
    #[arg(long = "api-key", env = "PRISM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

impl std::fmt::Debug for KeyArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.api_key.is_some() { "KeyArg(<redacted>)" } else { "KeyArg(None)" })
    }
}

impl KeyArg {
    /// `message` as a router request, with the key when one is set.
    ///
    /// # Errors
    /// The key holds characters gRPC metadata cannot carry (the message does not show it).
    pub fn request<T>(&self, message: T) -> Result<tonic::Request<T>> {
        authorized(message, self.api_key.as_deref().and_then(first_api_key))
    }
}

/// The key a client sends from an `--api-key` / `PRISM_API_KEY` value: the first non-empty
/// entry of a comma-separated list (the form `prism up` and prism-router accept, so one
/// environment serves both), `None` when it holds none.
pub fn first_api_key(list: &str) -> Option<&str> {
    list.split(',').map(str::trim).find(|k| !k.is_empty())
}

/// `message` as a router request carrying `authorization: Bearer KEY` when `api_key` is set.
///
/// # Errors
/// The key holds characters gRPC metadata cannot carry (the message does not show it).
pub fn authorized<T>(message: T, api_key: Option<&str>) -> Result<tonic::Request<T>> {
    let mut r = tonic::Request::new(message);
    if let Some(k) = api_key {
        let v = format!("Bearer {k}")
            .parse()
            .map_err(|_| anyhow::anyhow!("the API key holds characters not allowed in gRPC metadata"))?;
        r.metadata_mut().insert("authorization", v);
    }
    Ok(r)
}

impl ModelArg {
    /// The model named by `--model`, or the router's only model when none is given (asked
    /// with `key`).
    ///
    /// # Errors
    /// Fails when no model is served, or several are and none was named.
    pub async fn resolve(self, client: &mut InferenceServiceClient<Channel>, key: &KeyArg) -> Result<String> {
        if let Some(model) = self.name {
            return Ok(model);
        }
        let models = client
            .list_models(key.request(ListModelsRequest {})?)
            .await
            .map_err(router_status_error)?
            .into_inner()
            .models;
        match models.as_slice() {
            [] => bail!("the router serves no model yet (deploy one, or wait until a replica is Ready)"),
            [one] => Ok(one.id.clone()),
            many => {
                let names: Vec<&str> = many.iter().map(|m| m.id.as_str()).collect();
                bail!("the router serves several models ({}); pick one with --model", names.join(", "))
            }
        }
    }
}

/// Adds `http://` when the address has no scheme (`localhost:50050` → `http://localhost:50050`).
pub fn normalize(addr: &str) -> String {
    if addr.contains("://") { addr.to_owned() } else { format!("http://{addr}") }
}

async fn channel(addr: &str, what: &str) -> Result<Channel> {
    let uri = normalize(addr);
    let endpoint = Endpoint::from_shared(uri.clone())
        .with_context(|| format!("invalid {what} address {uri:?}"))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    // The internal identity is for the head only: the router's public gRPC port is not mTLS.
    let connected =
        if what == "head" { prism_common::tls::client::channel(endpoint).await } else { endpoint.connect().await };
    connected.with_context(|| {
        format!(
            "cannot reach the {what} at {uri} (is `prism up` running? set --{what} or PRISM_{})",
            what.to_uppercase()
        )
    })
}

/// Connects to the head's `HeadService`; every call carries the target's token.
///
/// # Errors
/// Fails when the address is invalid, nothing answers within 5 s, or the token file cannot
/// be read.
pub async fn head(target: &HeadTarget) -> Result<HeadClient> {
    let bearer = target.credential.bearer().context("--token / --token-file")?;
    Ok(head_client(channel(&target.addr, "head").await?, bearer))
}

/// Connects to the router's `InferenceService`.
///
/// # Errors
/// Fails when the address is invalid or nothing answers within 5 s.
pub async fn router(addr: &str) -> Result<InferenceServiceClient<Channel>> {
    Ok(InferenceServiceClient::new(channel(addr, "router").await?))
}

/// Turns a head's gRPC status into a readable error: the head's message, led by what the
/// status code means when the message does not already say it (`deployment "x" not found`,
/// `unavailable: not the leader; …`); an authentication failure names the head's
/// credential flags.
pub fn status_error(status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!(readable(&status, "give the head's token with --token, PRISM_TOKEN or --token-file"))
}

/// As [`status_error`] for the router's `InferenceService`, whose credential is an API key.
pub fn router_status_error(status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!(readable(&status, "give the router's API key with --api-key or PRISM_API_KEY"))
}

/// What a gRPC status code means, in the words a user reads in an error.
fn code_meaning(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "failed",
        Code::InvalidArgument => "invalid request",
        Code::DeadlineExceeded => "timed out",
        Code::NotFound => "not found",
        Code::AlreadyExists => "already exists",
        Code::PermissionDenied => "permission denied",
        Code::ResourceExhausted => "over capacity",
        Code::FailedPrecondition => "refused",
        Code::Aborted => "conflict",
        Code::OutOfRange => "out of range",
        Code::Unimplemented => "not supported by the server",
        Code::Internal => "internal error",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data lost",
        Code::Unauthenticated => "not authenticated",
    }
}

/// The error text for `status`: its message, prefixed with the code's meaning unless the
/// message already says it, and `auth_hint` after an authentication or permission refusal.
fn readable(status: &tonic::Status, auth_hint: &str) -> String {
    let meaning = code_meaning(status.code());
    let message = status.message().trim();
    let text = if message.is_empty() {
        meaning.to_owned()
    } else if message.to_ascii_lowercase().contains(meaning) {
        message.to_owned()
    } else {
        format!("{meaning}: {message}")
    };
    match status.code() {
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => format!("{text} ({auth_hint})"),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_errors_read_as_sentences_with_the_code_in_words() {
        let hint = "give a token";
        let cases = [
            (tonic::Status::not_found("deployment \"x\" not found"), "deployment \"x\" not found"),
            (
                tonic::Status::invalid_argument("replicas 5 > max_replicas 2"),
                "invalid request: replicas 5 > max_replicas 2",
            ),
            (tonic::Status::unavailable("not the leader; leader is h2"), "unavailable: not the leader; leader is h2"),
            (tonic::Status::aborted("conflicting update of /k; retry"), "conflicting update of /k; retry"),
            (tonic::Status::internal(""), "internal error"),
            (
                tonic::Status::unauthenticated("ClusterStatus needs a token"),
                "not authenticated: ClusterStatus needs a token (give a token)",
            ),
            (
                tonic::Status::permission_denied("role read may not call ScaleDeployment"),
                "permission denied: role read may not call ScaleDeployment (give a token)",
            ),
        ];
        for (status, want) in cases {
            let got = readable(&status, hint);
            assert_eq!(got, want);
            assert!(!got.contains(&format!("{:?}", status.code())), "{got}");
        }
    }

    #[test]
    fn normalize_adds_scheme_only_when_missing() {
        assert_eq!(normalize("localhost:50050"), "http://localhost:50050");
        assert_eq!(normalize("http://10.0.0.1:1"), "http://10.0.0.1:1");
        assert_eq!(normalize("https://h:443"), "https://h:443");
    }
}

//! Connections from the CLI to the head (admin RPCs) and the router (inference), with
//! addresses taken from `--head` / `--router` (env `PRISM_HEAD`, `PRISM_ROUTER`), their
//! timeouts (`--connect-timeout`, `--timeout`), and the `--model` flag (env `PRISM_MODEL`)
//! of the commands that ask the router for a model.
//!
//! `--head` is a comma-separated list, as workers and routers take it: the CLI talks to the
//! first head of the list that answers, and when that head is a follower refusing a write
//! (`UNAVAILABLE`, naming the leader) it sends the call once more to the leader it named
//! ([`Head::call`]). Followers apply no write, so the retry cannot apply one twice; reads
//! (`prism status`) are answered by followers too.
//!
//! The head is reached with the internal identity (`--tls-cert/--tls-key/--tls-ca`, mutual
//! TLS) when one is installed; the router's public port with TLS when its address is
//! `https://` (it serves `--public-tls-cert`), verified against the system roots and
//! `--tls-ca`, without a client certificate.

use anyhow::{Context, Result, bail};
use clap::Args;
use prism_common::head_auth::{HeadClient, HeadCredential, head_client};
use prism_common::proto::v1::ListModelsRequest;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::tls::args::parse_interval;
use std::path::PathBuf;
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
    /// Head gRPC address, or a comma-separated list of the cluster's heads (admin commands:
    /// status, deploy, scale, cordon, drain): the first that answers is used, and a write a
    /// follower refuses goes to the leader it names.
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
    /// How long one call to the head (status, deploy, scale, delete, cordon, drain) may take
    /// before the command gives up (`500ms`, `30s`, `2m`). Streams from the router (generate,
    /// chat, bench) have no overall deadline.
    #[arg(long, global = true, env = "PRISM_TIMEOUT", default_value = "30s", value_parser = parse_interval)]
    pub timeout: Duration,
    /// How long connecting to the head or the router (TCP and TLS handshake) may take.
    #[arg(long, global = true, env = "PRISM_CONNECT_TIMEOUT", default_value = "5s", value_parser = parse_interval)]
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoints")
            .field("head", &self.head)
            .field("router", &self.router)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("token_file", &self.token_file)
            .field("tls", &self.tls)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl Endpoints {
    /// The head and the credential the admin commands present to it.
    pub fn head_target(&self) -> HeadTarget {
        HeadTarget {
            addr: self.head.clone(),
            credential: HeadCredential::from_flags(self.token.clone(), self.token_file.clone()),
            timeouts: Timeouts { connect: self.connect_timeout, call: self.timeout },
        }
    }

    /// The router the client commands stream from.
    pub fn router_target(&self) -> RouterTarget {
        RouterTarget { addr: self.router.clone(), ca: self.tls.tls_ca.clone(), connect_timeout: self.connect_timeout }
    }
}

/// How long the CLI waits for the head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP connect and TLS handshake.
    pub connect: Duration,
    /// One call, from sending it to its answer.
    pub call: Duration,
}

impl Default for Timeouts {
    /// The flags' defaults: 5 s to connect, 30 s a call.
    fn default() -> Self {
        Self { connect: Duration::from_secs(5), call: Duration::from_secs(30) }
    }
}

/// A head (or a comma-separated list of a cluster's heads), the token presented to it and
/// how long to wait for it.
#[derive(Clone, Debug)]
pub struct HeadTarget {
    /// gRPC address, or a comma-separated list of addresses.
    pub addr: String,
    /// Token (none: an open head, as `prism up` runs it).
    pub credential: HeadCredential,
    /// Connect and per-call timeouts.
    pub timeouts: Timeouts,
}

impl HeadTarget {
    /// A head at `addr` with the default timeouts.
    pub fn new(addr: impl Into<String>, credential: HeadCredential) -> Self {
        Self { addr: addr.into(), credential, timeouts: Timeouts::default() }
    }

    /// The addresses of the list, `http://` added where no scheme is given, empty entries
    /// dropped.
    pub fn addrs(&self) -> Vec<String> {
        self.addr.split(',').map(str::trim).filter(|a| !a.is_empty()).map(normalize).collect()
    }

    /// As [`status_error`] for a call sent to the head at `addr`, saying which head did not
    /// answer in time when the call timed out.
    fn status_error_at(&self, addr: &str, status: tonic::Status) -> anyhow::Error {
        if timed_out(&status) {
            anyhow::anyhow!(
                "the head at {} did not answer within {} (raise --timeout / PRISM_TIMEOUT if it is only slow); \
                 a change it was asked for may still take effect: `prism status` shows the outcome",
                normalize(addr),
                seconds(self.timeouts.call)
            )
        } else {
            status_error(status)
        }
    }
}

/// A connection to one head of a [`HeadTarget`]'s list that follows the leader: a call a
/// follower refuses naming the leader is sent once more, to the leader, which later calls
/// then go to.
pub struct Head {
    target: HeadTarget,
    /// The address of the head connected to.
    addr: String,
    client: HeadClient,
}

impl Head {
    /// Connects to the first head of `target`'s list that answers.
    ///
    /// # Errors
    /// Fails when the list is empty or invalid, no head answers within the connect timeout
    /// (the last head's error), or the token file cannot be read.
    pub async fn connect(target: &HeadTarget) -> Result<Self> {
        let addrs = target.addrs();
        let mut last = None;
        for addr in addrs {
            match connect_head(target, &addr).await {
                Ok(client) => return Ok(Self { target: target.clone(), addr, client }),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no head address given (--head or PRISM_HEAD)")))
    }

    /// Sends one call (`rpc` makes it on a client of the head); when a follower refuses it
    /// naming another head as the leader, connects to that leader and sends it once more
    /// there. Followers apply no write, so the second send cannot apply one twice.
    ///
    /// # Errors
    /// The head's refusal as a readable error (see [`status_error`]; a timeout names the head), or the
    /// leader's connection error.
    pub async fn call<T, F, Fut>(&mut self, mut rpc: F) -> Result<T>
    where
        F: FnMut(HeadClient) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let status = match rpc(self.client.clone()).await {
            Ok(response) => return Ok(response.into_inner()),
            Err(status) => status,
        };
        let Some(leader) = leader_hint(&status).filter(|l| *l != self.addr) else {
            return Err(self.target.status_error_at(&self.addr, status));
        };
        self.client = connect_head(&self.target, &leader).await?;
        self.addr = leader;
        rpc(self.client.clone())
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.target.status_error_at(&self.addr, s))
    }
}

/// The leader a follower head names when it refuses a call: its `prism-leader` metadata,
/// else the address after "leader is " in a "not the leader" message (`not the leader;
/// leader is ADDR`; a leader still loading the state says "leader is loading …");
/// `None` for other refusals and when the leader is unknown. `http://` is added where the
/// address has no scheme.
pub fn leader_hint(status: &tonic::Status) -> Option<String> {
    if status.code() != tonic::Code::Unavailable {
        return None;
    }
    let from_metadata = status.metadata().get("prism-leader").and_then(|v| v.to_str().ok()).map(str::trim);
    let from_message = || {
        let message = status.message();
        if !message.contains("not the leader") {
            return None;
        }
        let at = message.find("leader is ")? + "leader is ".len();
        message[at..].split(|c: char| c.is_whitespace() || matches!(c, ';' | ',' | ')')).next()
    };
    from_metadata
        .filter(|l| !l.is_empty())
        .or_else(from_message)
        .filter(|l| !l.is_empty() && *l != "unknown")
        .map(normalize)
}

/// Whether `status` is the client's own per-call timeout (tonic reports it as `CANCELLED`
/// with [`tonic::TimeoutExpired`]'s text) rather than an answer of the server.
fn timed_out(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Cancelled && status.message() == tonic::TimeoutExpired(()).to_string()
}

/// `30 s`, `1.5 s`, `500 ms`.
fn seconds(d: Duration) -> String {
    if d < Duration::from_secs(1) { format!("{} ms", d.as_millis()) } else { format!("{} s", d.as_secs_f64()) }
}

/// A router's public gRPC address and how to reach it.
#[derive(Clone, Debug)]
pub struct RouterTarget {
    /// gRPC address; `https://` speaks TLS.
    pub addr: String,
    /// CA bundle trusted next to the system roots (`--tls-ca`) for an `https://` address.
    pub ca: Option<PathBuf>,
    /// TCP connect and TLS handshake.
    pub connect_timeout: Duration,
}

impl RouterTarget {
    /// A router at `addr`, system roots only, the default connect timeout.
    pub fn new(addr: impl Into<String>) -> Self {
        Self { addr: addr.into(), ca: None, connect_timeout: Timeouts::default().connect }
    }
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

/// How [`channel`] secures a connection.
enum Security<'a> {
    /// The process's internal identity when one is installed (the head), else plaintext.
    Internal,
    /// TLS for an `https://` address, verified against the system roots and this CA (the
    /// router's public port), else plaintext.
    Public(Option<&'a std::path::Path>),
}

async fn channel(
    addr: &str,
    what: &str,
    security: Security<'_>,
    connect: Duration,
    call: Option<Duration>,
) -> Result<Channel> {
    let uri = normalize(addr);
    let mut endpoint = Endpoint::from_shared(uri.clone())
        .with_context(|| format!("invalid {what} address {uri:?}"))?
        .connect_timeout(connect)
        .tcp_nodelay(true);
    if let Some(call) = call {
        endpoint = endpoint.timeout(call);
    }
    let connected = match security {
        Security::Internal => prism_common::tls::client::channel(endpoint).await,
        Security::Public(ca) if uri.starts_with("https://") => {
            let config = prism_common::tls::server_only_client_config(ca)?;
            endpoint.connect_with_connector(prism_common::tls::client::TlsConnector::verifying(config)).await
        }
        Security::Public(_) => endpoint.connect().await,
    };
    connected.with_context(|| {
        format!(
            "cannot reach the {what} at {uri} within {} (is `prism up` running? set --{what} or PRISM_{})",
            seconds(connect),
            what.to_uppercase()
        )
    })
}

/// Connects to the first head of the target's list that answers (its `HeadService`); every
/// call carries the target's token and gives up after the target's call timeout ([`Head`]
/// also follows the leader and makes its errors readable).
///
/// # Errors
/// Fails when the address is invalid, nothing answers within the connect timeout, or the
/// token file cannot be read.
pub async fn head(target: &HeadTarget) -> Result<HeadClient> {
    Ok(Head::connect(target).await?.client)
}

/// Connects to the head at `addr` with `target`'s token and timeouts.
async fn connect_head(target: &HeadTarget, addr: &str) -> Result<HeadClient> {
    let bearer = target.credential.bearer().context("--token / --token-file")?;
    let t = target.timeouts;
    Ok(head_client(channel(addr, "head", Security::Internal, t.connect, Some(t.call)).await?, bearer))
}

/// Connects to the router's `InferenceService` (TLS for an `https://` address). Calls have
/// no deadline: a stream lasts as long as the generation.
///
/// # Errors
/// Fails when the address is invalid, the CA file cannot be used, or nothing answers within
/// the connect timeout.
pub async fn router(target: &RouterTarget) -> Result<InferenceServiceClient<Channel>> {
    let security = Security::Public(target.ca.as_deref());
    Ok(InferenceServiceClient::new(channel(&target.addr, "router", security, target.connect_timeout, None).await?))
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
    fn a_follower_names_the_leader_in_metadata_or_in_its_message() {
        let mut with_metadata = tonic::Status::unavailable("not the leader; leader is h1:50050");
        if let Ok(v) = "http://h2:50050".parse() {
            with_metadata.metadata_mut().insert("prism-leader", v);
        }
        assert_eq!(leader_hint(&with_metadata).as_deref(), Some("http://h2:50050"));
        let message = tonic::Status::unavailable("not the leader; leader is http://127.0.0.1:18052");
        assert_eq!(leader_hint(&message).as_deref(), Some("http://127.0.0.1:18052"));
        let bare = tonic::Status::unavailable("not the leader; leader is h3:1");
        assert_eq!(leader_hint(&bare).as_deref(), Some("http://h3:1"));
        assert_eq!(leader_hint(&tonic::Status::unavailable("not the leader; leader is unknown")), None);
        assert_eq!(leader_hint(&tonic::Status::unavailable("leader is loading cluster state")), None);
        assert_eq!(leader_hint(&tonic::Status::internal("leader is h4:1")), None);
    }

    #[test]
    fn the_head_flag_takes_a_comma_separated_list() {
        let target = HeadTarget::new(" h1:50050, http://h2:50050 ,,", HeadCredential::default());
        assert_eq!(target.addrs(), ["http://h1:50050", "http://h2:50050"]);
        assert_eq!(HeadTarget::new(DEFAULT_HEAD, HeadCredential::default()).addrs(), [DEFAULT_HEAD]);
    }

    #[test]
    fn normalize_adds_scheme_only_when_missing() {
        assert_eq!(normalize("localhost:50050"), "http://localhost:50050");
        assert_eq!(normalize("http://10.0.0.1:1"), "http://10.0.0.1:1");
        assert_eq!(normalize("https://h:443"), "https://h:443");
    }
}

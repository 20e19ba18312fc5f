//! Bearer-token authentication and roles of the head. Tokens come from the file given as
//! `--auth-token-file` (one `TOKEN role=ROLE [name=LABEL]` per line, `#` comments); callers
//! send `authorization: Bearer TOKEN` metadata (`prism_common::head_auth`). Without a token
//! file the head runs open, as `prism up` does on loopback.
//!
//! Each RPC is allowed to a set of roles ([`Rpc::allows`]): `read` may look (cluster
//! status, listings, route watches), `admin` may do everything, `worker` may only hold a
//! worker session, `router` may watch routes and report demand. A missing or unknown token
//! is `UNAUTHENTICATED`; a known token without the role is `PERMISSION_DENIED` naming the
//! roles that may call. Tokens are compared in constant time and never logged or echoed:
//! callers are named by their label (`name=`, else `ROLE-lineN`).

use prism_common::bearer::{bearer_token, ct_eq};
use std::path::Path;
use std::sync::Arc;

use tonic::Status;

/// Shortest token accepted in the file (a guessable token protects nothing).
pub const MIN_TOKEN_LEN: usize = 16;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Everything, including deploy, scale, drain and cordon.
    Admin,
    /// Cluster status, listings and route watches.
    Read,
    /// A worker agent's session (registration, status, drain reports).
    Worker,
    /// A router's route watch and demand reports.
    Router,
}

impl Role {
    /// The role's name in the token file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::Read => "read",
            Self::Worker => "worker",
            Self::Router => "router",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Self::Admin, Self::Read, Self::Worker, Self::Router].into_iter().find(|r| r.as_str() == s)
    }
}

/// The head's RPCs (and the HTTP event log), for the role table and the audit log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    /// `WorkerSession`.
    WorkerSession,
    /// `WatchRoutes`.
    WatchRoutes,
    /// `ReportDemand`.
    ReportDemand,
    /// `ApplyDeployment`.
    ApplyDeployment,
    /// `DeleteDeployment`.
    DeleteDeployment,
    /// `ScaleDeployment`.
    ScaleDeployment,
    /// `ListDeployments`.
    ListDeployments,
    /// `ListNodes`.
    ListNodes,
    /// `ListReplicas`.
    ListReplicas,
    /// `ClusterStatus`.
    ClusterStatus,
    /// `CordonNode`.
    CordonNode,
    /// `UncordonNode`.
    UncordonNode,
    /// `DrainNode`.
    DrainNode,
    /// `GET /v1/events` on the head's HTTP port.
    Events,
}

impl Rpc {
    /// Every RPC, for tables and tests.
    pub const ALL: [Self; 14] = [
        Self::WorkerSession,
        Self::WatchRoutes,
        Self::ReportDemand,
        Self::ApplyDeployment,
        Self::DeleteDeployment,
        Self::ScaleDeployment,
        Self::ListDeployments,
        Self::ListNodes,
        Self::ListReplicas,
        Self::ClusterStatus,
        Self::CordonNode,
        Self::UncordonNode,
        Self::DrainNode,
        Self::Events,
    ];

    /// The method name as in `head.proto` (`GET /v1/events` for the event log).
    pub fn name(self) -> &'static str {
        match self {
            Self::WorkerSession => "WorkerSession",
            Self::WatchRoutes => "WatchRoutes",
            Self::ReportDemand => "ReportDemand",
            Self::ApplyDeployment => "ApplyDeployment",
            Self::DeleteDeployment => "DeleteDeployment",
            Self::ScaleDeployment => "ScaleDeployment",
            Self::ListDeployments => "ListDeployments",
            Self::ListNodes => "ListNodes",
            Self::ListReplicas => "ListReplicas",
            Self::ClusterStatus => "ClusterStatus",
            Self::CordonNode => "CordonNode",
            Self::UncordonNode => "UncordonNode",
            Self::DrainNode => "DrainNode",
            Self::Events => "GET /v1/events",
        }
    }

    /// The roles that may call it (admin may call everything).
    pub fn roles(self) -> &'static [Role] {
        use Role::{Admin, Read, Router, Worker};
        match self {
            Self::WorkerSession => &[Admin, Worker],
            Self::WatchRoutes => &[Admin, Read, Router],
            Self::ReportDemand => &[Admin, Router],
            Self::ListDeployments | Self::ListNodes | Self::ListReplicas | Self::ClusterStatus | Self::Events => {
                &[Admin, Read]
            }
            Self::ApplyDeployment
            | Self::DeleteDeployment
            | Self::ScaleDeployment
            | Self::CordonNode
            | Self::UncordonNode
            | Self::DrainNode => &[Admin],
        }
    }

    /// True when `role` may call it.
    pub fn allows(self, role: Role) -> bool {
        self.roles().contains(&role)
    }

    /// True for the calls that change the cluster (each leaves an audit line).
    pub fn is_admin_action(self) -> bool {
        self.roles() == [Role::Admin]
    }
}

/// One accepted token.
#[derive(Clone)]
struct TokenEntry {
    secret: Vec<u8>,
    role: Role,
    name: String,
}

/// A token file that cannot be used; the message names the line, never the token.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    /// The file cannot be read.
    #[error("cannot read --auth-token-file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A line is malformed.
    #[error("--auth-token-file {path} line {line}: {reason}")]
    Line {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong (never the token).
        reason: String,
    },
    /// The file holds no token (that would refuse every caller).
    #[error("--auth-token-file {0} holds no token (expected lines `TOKEN role=admin|read|worker|router [name=LABEL]`)")]
    Empty(String),
}

/// Who called: a token's label and role, or `anonymous` on an open head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The token's `name=` (else `ROLE-lineN`), or `anonymous`.
    pub name: String,
    /// The token's role (`None` on an open head).
    pub role: Option<Role>,
}

impl Caller {
    fn anonymous() -> Self {
        Self { name: "anonymous".to_owned(), role: None }
    }
}

/// The head's accepted tokens; cheap `Clone`; `Debug` shows only the count. Empty
/// (`HeadAuth::open`) means no authentication.
#[derive(Clone, Default)]
pub struct HeadAuth {
    tokens: Option<Arc<Vec<TokenEntry>>>,
}

impl std::fmt::Debug for HeadAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.tokens {
            None => f.write_str("HeadAuth(open)"),
            Some(t) => write!(f, "HeadAuth({} tokens)", t.len()),
        }
    }
}

fn valid_label(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.@:".contains(&b))
}

impl HeadAuth {
    /// No authentication: every call is allowed and audited as `anonymous`.
    pub fn open() -> Self {
        Self::default()
    }

    /// True when a token file was given.
    pub fn enabled(&self) -> bool {
        self.tokens.is_some()
    }

    /// Reads and parses `path` (see [`HeadAuth::parse`]).
    ///
    /// # Errors
    /// [`TokenFileError`] naming the file and line.
    pub fn from_file(path: &Path) -> Result<Self, TokenFileError> {
        let shown = path.display().to_string();
        let text =
            std::fs::read_to_string(path).map_err(|source| TokenFileError::Read { path: shown.clone(), source })?;
        Self::parse(&text, &shown)
    }

    /// Parses a token file: one `TOKEN role=admin|read|worker|router [name=LABEL]` per line;
    /// blank lines and lines starting with `#` are skipped. A token is at least
    /// [`MIN_TOKEN_LEN`] visible ASCII characters and appears once; a label is 1–64 of
    /// `[A-Za-z0-9-_.@:]`. `path` names the file in errors.
    ///
    /// # Errors
    /// [`TokenFileError::Line`] for the first malformed line (the reason never contains the
    /// token), [`TokenFileError::Empty`] when no line holds a token.
    pub fn parse(text: &str, path: &str) -> Result<Self, TokenFileError> {
        let mut tokens: Vec<TokenEntry> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let bad = |reason: String| TokenFileError::Line { path: path.to_owned(), line, reason };
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let mut fields = l.split_ascii_whitespace();
            let secret = fields.next().unwrap_or_default();
            if secret.contains('=') && Role::parse(secret.split_once('=').map_or("", |(_, v)| v)).is_some() {
                return Err(bad("the token is missing (expected `TOKEN role=ROLE [name=LABEL]`)".into()));
            }
            if secret.len() < MIN_TOKEN_LEN || !secret.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(bad(format!("the token must be at least {MIN_TOKEN_LEN} visible ASCII characters")));
            }
            let (mut role, mut name) = (None, None);
            for f in fields {
                match f.split_once('=') {
                    Some(("role", v)) => {
                        let r = Role::parse(v)
                            .ok_or_else(|| bad(format!("role {v:?} is not one of admin, read, worker, router")))?;
                        if role.replace(r).is_some() {
                            return Err(bad("role is given twice".into()));
                        }
                    }
                    Some(("name", v)) => {
                        if !valid_label(v) {
                            return Err(bad(format!("name {v:?} must be 1-64 of A-Z a-z 0-9 - _ . @ :")));
                        }
                        if name.replace(v.to_owned()).is_some() {
                            return Err(bad("name is given twice".into()));
                        }
                    }
                    Some((k, _)) => return Err(bad(format!("unknown field {k:?} (expected role= and name=)"))),
                    None => return Err(bad("expected `TOKEN role=ROLE [name=LABEL]`: one token per line".into())),
                }
            }
            let role = role.ok_or_else(|| bad("role= is missing (admin, read, worker or router)".into()))?;
            if let Some(other) = tokens.iter().find(|t| ct_eq(&t.secret, secret.as_bytes())) {
                return Err(bad(format!("the same token is already given to {:?}", other.name)));
            }
            let name = name.unwrap_or_else(|| format!("{}-line{line}", role.as_str()));
            tokens.push(TokenEntry { secret: secret.as_bytes().to_vec(), role, name });
        }
        if tokens.is_empty() {
            return Err(TokenFileError::Empty(path.to_owned()));
        }
        Ok(Self { tokens: Some(Arc::new(tokens)) })
    }

    /// Identifies the caller of `rpc` from its `authorization` value and checks its role.
    ///
    /// # Errors
    /// `UNAUTHENTICATED` when the head has tokens and the value is missing, not `Bearer`, or
    /// an unknown token; `PERMISSION_DENIED` naming the roles that may call `rpc` when the
    /// token's role may not (the error carries the caller for the audit log).
    pub fn authorize(&self, authorization: Option<&[u8]>, rpc: Rpc) -> Result<Caller, Refused> {
        let Some(tokens) = &self.tokens else { return Ok(Caller::anonymous()) };
        let Some(presented) = authorization.and_then(bearer_token) else {
            return Err(Refused {
                caller: Caller::anonymous(),
                status: Status::unauthenticated(format!(
                    "{} needs a token: send `authorization: Bearer TOKEN` (prism --token / PRISM_TOKEN)",
                    rpc.name()
                )),
            });
        };
        // Every entry is compared, so the time taken does not say which one matched.
        let found = tokens.iter().fold(None, |found, t| if ct_eq(&t.secret, presented) { Some(t) } else { found });
        let Some(t) = found else {
            return Err(Refused {
                caller: Caller::anonymous(),
                status: Status::unauthenticated(format!("{}: the token is not known to this head", rpc.name())),
            });
        };
        let caller = Caller { name: t.name.clone(), role: Some(t.role) };
        if rpc.allows(t.role) {
            return Ok(caller);
        }
        let roles: Vec<&str> = rpc.roles().iter().map(|r| r.as_str()).collect();
        let status = Status::permission_denied(format!(
            "{} needs role {}; the token {:?} has role {}",
            rpc.name(),
            roles.join(" or "),
            t.name,
            t.role.as_str()
        ));
        Err(Refused { caller, status })
    }
}

/// A refused call: who it was (for the audit log) and the status answered.
#[derive(Debug)]
pub struct Refused {
    /// The caller as far as known (`anonymous` for a missing or unknown token).
    pub caller: Caller,
    /// `UNAUTHENTICATED` or `PERMISSION_DENIED`.
    pub status: Status,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    const ADMIN: &str = "admin-token-0123456789";
    const READ: &str = "read-token-0123456789";

    fn auth() -> HeadAuth {
        let file = format!(
            "# the operators\n{ADMIN} role=admin name=ops\n\n  {READ}   role=read\nworker-token-0123456789 role=worker name=pool-a\n"
        );
        HeadAuth::parse(&file, "tokens").expect("valid file")
    }

    fn line_error(text: &str) -> (usize, String) {
        match HeadAuth::parse(text, "tokens") {
            Err(TokenFileError::Line { line, reason, .. }) => (line, reason),
            other => panic!("expected a line error, got {other:?}"),
        }
    }

    #[test]
    fn parses_roles_labels_and_comments() {
        let a = auth();
        assert!(a.enabled());
        assert_eq!(format!("{a:?}"), "HeadAuth(3 tokens)");
        let who = |t: &str| a.authorize(Some(format!("Bearer {t}").as_bytes()), Rpc::ClusterStatus);
        assert_eq!(who(ADMIN).expect("admin").name, "ops");
        assert_eq!(who(READ).expect("read"), Caller { name: "read-line4".into(), role: Some(Role::Read) });
        // The scheme in any case, extra whitespace.
        let lower = a.authorize(Some(format!("bearer   {ADMIN} ").as_bytes()), Rpc::DrainNode);
        assert_eq!(lower.expect("admin").role, Some(Role::Admin));
    }

    #[test]
    fn malformed_lines_name_the_line_never_the_token() {
        let secret = "never-shown-0123456789";
        let cases = [
            (format!("{secret}\n"), 1, "role= is missing"),
            (format!("# c\n{secret} role=root\n"), 2, "role \"root\""),
            (format!("{secret} role=admin owner=me\n"), 1, "unknown field \"owner\""),
            (format!("{secret} role=admin name=a b\n"), 1, "one token per line"),
            (format!("{secret} role=admin role=read\n"), 1, "role is given twice"),
            (format!("{secret} role=admin name=bad/label\n"), 1, "name \"bad/label\""),
            ("short role=admin\n".to_owned(), 1, "at least 16"),
            ("role=admin name=x\n".to_owned(), 1, "the token is missing"),
            (format!("{secret} role=admin name=a\n{secret} role=read\n"), 2, "already given to \"a\""),
        ];
        for (text, want_line, want) in cases {
            let (line, reason) = line_error(&text);
            assert_eq!(line, want_line, "{text:?}");
            assert!(reason.contains(want), "{text:?}: {reason}");
            let shown = HeadAuth::parse(&text, "tokens").err().map(|e| e.to_string()).unwrap_or_default();
            assert!(!shown.contains(secret), "{shown}");
            assert!(shown.starts_with(&format!("--auth-token-file tokens line {want_line}: ")), "{shown}");
        }
        assert!(matches!(HeadAuth::parse("# nothing\n\n", "tokens"), Err(TokenFileError::Empty(_))));
    }

    #[test]
    fn the_role_table() {
        use Role::{Admin, Read, Router, Worker};
        let admin_actions = [
            Rpc::ApplyDeployment,
            Rpc::DeleteDeployment,
            Rpc::ScaleDeployment,
            Rpc::CordonNode,
            Rpc::UncordonNode,
            Rpc::DrainNode,
        ];
        for rpc in Rpc::ALL {
            assert!(rpc.allows(Admin), "admin may call {}", rpc.name());
            assert_eq!(rpc.is_admin_action(), admin_actions.contains(&rpc), "{}", rpc.name());
            let read = matches!(
                rpc,
                Rpc::ClusterStatus
                    | Rpc::ListDeployments
                    | Rpc::ListNodes
                    | Rpc::ListReplicas
                    | Rpc::WatchRoutes
                    | Rpc::Events
            );
            assert_eq!(rpc.allows(Read), read, "read and {}", rpc.name());
            assert_eq!(rpc.allows(Worker), rpc == Rpc::WorkerSession, "worker and {}", rpc.name());
            assert_eq!(
                rpc.allows(Router),
                matches!(rpc, Rpc::WatchRoutes | Rpc::ReportDemand),
                "router and {}",
                rpc.name()
            );
        }
    }

    #[test]
    fn refusals_carry_the_right_code() {
        let a = auth();
        let code = |v: Option<&str>, rpc| a.authorize(v.map(str::as_bytes), rpc).map_err(|r| r.status.code());
        assert_eq!(code(None, Rpc::ClusterStatus), Err(Code::Unauthenticated));
        assert_eq!(code(Some("Basic abc"), Rpc::ClusterStatus), Err(Code::Unauthenticated));
        assert_eq!(code(Some("Bearer "), Rpc::ClusterStatus), Err(Code::Unauthenticated));
        assert_eq!(code(Some("Bearer admin-token-012345678"), Rpc::ClusterStatus), Err(Code::Unauthenticated));
        let r = a.authorize(Some(format!("Bearer {READ}").as_bytes()), Rpc::DrainNode).expect_err("read cannot drain");
        assert_eq!(r.status.code(), Code::PermissionDenied);
        assert_eq!(r.status.message(), "DrainNode needs role admin; the token \"read-line4\" has role read");
        assert_eq!(r.caller.name, "read-line4");
        let w = a.authorize(Some(b"Bearer worker-token-0123456789"), Rpc::WatchRoutes).expect_err("worker");
        assert_eq!(
            w.status.message(),
            "WatchRoutes needs role admin or read or router; the token \"pool-a\" has role worker"
        );
        // An open head lets everyone in, as `anonymous`.
        assert_eq!(HeadAuth::open().authorize(None, Rpc::DrainNode).expect("open").name, "anonymous");
    }
}

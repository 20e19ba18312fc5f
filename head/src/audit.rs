//! The audit log: one `tracing` line (target [`AUDIT_TARGET`], level info, message `audit`)
//! per admin action — deploy, delete, scale, cordon, uncordon, drain — whether it succeeded,
//! failed or was refused (`UNAUTHENTICATED` / `PERMISSION_DENIED`). Fields: `who` (the
//! token's label, or `anonymous`), `role`, `rpc`, `args` (the key arguments, strings quoted
//! so a hostile name cannot forge a line), `outcome` (`ok` or the gRPC code, e.g.
//! `PERMISSION_DENIED`) and, on failure, `error` (quoted). The timestamp is the log line's.
//! Tokens never appear: callers are named by label. In the default text format:
//!
//! ```text
//! 2026-12-01T19:46:17.493300Z  INFO audit who=ops role=admin rpc=DrainNode args="node=\"w1\" deadline_ms=5000 reason=\"maintenance\"" outcome=ok
//! ```

use tonic::{Code, Status};

use crate::auth::{Caller, Rpc};

/// The `tracing` target of audit lines (`RUST_LOG=prism::audit=info` keeps only them).
pub const AUDIT_TARGET: &str = "prism::audit";

/// The canonical gRPC name of `code` (`PERMISSION_DENIED`), as `grpc-status` documents it.
pub fn code_name(code: Code) -> String {
    let camel = format!("{code:?}");
    let mut out = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Logs one admin action by `caller` with its arguments and its outcome.
pub fn record(caller: &Caller, rpc: Rpc, args: &str, outcome: Result<(), &Status>) {
    let role = caller.role.map_or("none", crate::auth::Role::as_str);
    match outcome {
        Ok(()) => tracing::info!(
            target: AUDIT_TARGET,
            who = %caller.name,
            role = %role,
            rpc = %rpc.name(),
            args,
            outcome = %"ok",
            "audit"
        ),
        Err(s) => tracing::info!(
            target: AUDIT_TARGET,
            who = %caller.name,
            role = %role,
            rpc = %rpc.name(),
            args,
            outcome = %code_name(s.code()),
            error = s.message(),
            "audit"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_in_their_canonical_spelling() {
        assert_eq!(code_name(Code::PermissionDenied), "PERMISSION_DENIED");
        assert_eq!(code_name(Code::Unauthenticated), "UNAUTHENTICATED");
        assert_eq!(code_name(Code::NotFound), "NOT_FOUND");
        assert_eq!(code_name(Code::Ok), "OK");
    }
}

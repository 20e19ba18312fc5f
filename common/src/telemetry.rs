//! Logging set-up shared by every binary: `tracing` to stderr, filtered by `RUST_LOG`
//! (default `info`), in colour only when stderr is a terminal ([`use_colour`]), so logs
//! redirected to a file, a pipe or a container runtime carry no ANSI escape codes. The usual
//! variables decide before the terminal does, in this order: `NO_COLOR` (never),
//! `CLICOLOR_FORCE` (always), `CLICOLOR=0` or `TERM=dumb` (never). Never log prompts or
//! generated text at info level.

use std::ffi::OsString;
use std::io::IsTerminal;

/// Set to a non-empty value: never colour (<https://no-color.org>).
pub const NO_COLOR_ENV: &str = "NO_COLOR";
/// Set to a non-empty value other than `0`: colour even when stderr is not a terminal
/// (<https://bixense.com/clicolors/>).
pub const CLICOLOR_FORCE_ENV: &str = "CLICOLOR_FORCE";
/// Set to `0`: no colour, unless `CLICOLOR_FORCE` asks for it (<https://bixense.com/clicolors/>).
pub const CLICOLOR_ENV: &str = "CLICOLOR";
/// The terminal type; `dumb` means one that understands no escape codes (Emacs shells, some CI
/// log viewers), so no colour unless `CLICOLOR_FORCE` asks for it.
pub const TERM_ENV: &str = "TERM";

/// Installs the global subscriber once; later calls are ignored.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = use_colour(std::io::stderr().is_terminal(), |name| std::env::var_os(name));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_target(false)
        .try_init();
}

/// Whether log lines carry ANSI colour codes, the first rule that applies deciding:
/// 1. `NO_COLOR` set (non-empty): never;
/// 2. `CLICOLOR_FORCE` set (non-empty, not `0`): always, even on a pipe or a dumb terminal;
/// 3. `CLICOLOR=0` or `TERM=dumb`: never;
/// 4. else only when the log stream is a `terminal`.
///
/// `env` reads an environment variable (`std::env::var_os` outside tests), so the decision is
/// a pure function of its inputs.
pub fn use_colour(terminal: bool, env: impl Fn(&str) -> Option<OsString>) -> bool {
    if env(NO_COLOR_ENV).is_some_and(|v| !v.is_empty()) {
        return false;
    }
    if env(CLICOLOR_FORCE_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
        return true;
    }
    if env(CLICOLOR_ENV).is_some_and(|v| v == "0") || env(TERM_ENV).is_some_and(|v| v == "dumb") {
        return false;
    }
    terminal
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`use_colour`] with `vars` as the whole environment.
    fn colour(terminal: bool, vars: &[(&str, &str)]) -> bool {
        use_colour(terminal, |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| OsString::from(v)))
    }

    #[test]
    fn colour_only_on_a_terminal_by_default() {
        assert!(colour(true, &[]));
        assert!(!colour(false, &[]), "a file or pipe gets no escape codes");
        assert!(!colour(false, &[("TERM", "xterm-256color")]), "TERM says nothing about where stderr goes");
    }

    #[test]
    fn no_color_turns_colour_off_even_on_a_terminal() {
        assert!(!colour(true, &[("NO_COLOR", "1")]));
        assert!(!colour(true, &[("NO_COLOR", "false")]), "any non-empty value counts");
        assert!(colour(true, &[("NO_COLOR", "")]), "an empty NO_COLOR is unset (no-color.org)");
        assert!(!colour(false, &[("NO_COLOR", "1"), ("CLICOLOR_FORCE", "1")]), "NO_COLOR wins");
    }

    #[test]
    fn clicolor_force_turns_colour_on_when_redirected() {
        assert!(colour(false, &[("CLICOLOR_FORCE", "1")]));
        assert!(!colour(false, &[("CLICOLOR_FORCE", "0")]));
        assert!(!colour(false, &[("CLICOLOR_FORCE", "")]));
    }

    #[test]
    fn clicolor_zero_turns_colour_off_on_a_terminal() {
        assert!(!colour(true, &[("CLICOLOR", "0")]));
        assert!(colour(true, &[("CLICOLOR", "1")]), "CLICOLOR=1 keeps the terminal's answer");
        assert!(!colour(false, &[("CLICOLOR", "1")]), "CLICOLOR=1 does not colour a pipe");
        assert!(colour(true, &[("CLICOLOR", "")]));
    }

    #[test]
    fn a_dumb_terminal_gets_no_colour() {
        assert!(!colour(true, &[("TERM", "dumb")]));
        assert!(colour(true, &[("TERM", "xterm-256color")]));
    }

    #[test]
    fn precedence_no_color_then_force_then_clicolor_and_term_then_terminal() {
        // CLICOLOR_FORCE beats CLICOLOR=0 and TERM=dumb...
        assert!(colour(true, &[("CLICOLOR_FORCE", "1"), ("CLICOLOR", "0")]));
        assert!(colour(false, &[("CLICOLOR_FORCE", "1"), ("TERM", "dumb")]));
        // ...and NO_COLOR beats everything.
        assert!(!colour(true, &[("NO_COLOR", "1"), ("CLICOLOR_FORCE", "1"), ("CLICOLOR", "1")]));
        // CLICOLOR=0 and TERM=dumb each win over a terminal on their own.
        assert!(!colour(true, &[("CLICOLOR", "0"), ("TERM", "xterm")]));
        assert!(!colour(true, &[("CLICOLOR", "1"), ("TERM", "dumb")]));
    }
}

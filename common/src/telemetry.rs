//! Logging set-up shared by every binary: `tracing` to stderr, filtered by `RUST_LOG`
//! (default `info`), in colour only when stderr is a terminal ([`use_colour`]), so logs
//! redirected to a file, a pipe or a container runtime carry no ANSI escape codes. Never log
//! prompts or generated text at info level.

use std::ffi::OsString;
use std::io::IsTerminal;

/// Set to a non-empty value: never colour (<https://no-color.org>).
pub const NO_COLOR_ENV: &str = "NO_COLOR";
/// Set to a non-empty value other than `0`: colour even when stderr is not a terminal
/// (<https://bixense.com/clicolors/>).
pub const CLICOLOR_FORCE_ENV: &str = "CLICOLOR_FORCE";

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

/// Whether log lines carry ANSI colour codes: never with `NO_COLOR` set (non-empty), always
/// with `CLICOLOR_FORCE` set (non-empty, not `0`), else only when the log stream is a
/// `terminal`. `env` reads an environment variable (`std::env::var_os` outside tests).
pub fn use_colour(terminal: bool, env: impl Fn(&str) -> Option<OsString>) -> bool {
    if env(NO_COLOR_ENV).is_some_and(|v| !v.is_empty()) {
        return false;
    }
    if env(CLICOLOR_FORCE_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
        return true;
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
}

//! What the commands write to stdout: written through a locked handle so that a reader
//! that goes (`prism status | head -1`) is an error the caller handles, never a panic.

use anyhow::Result;

/// Writes `text` to stdout and flushes it, returning the error (`BrokenPipe` when the
/// reader has gone) where `print!` would panic.
///
/// # Errors
/// Writing to stdout failed.
pub fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// Whether `error` comes from writing to a pipe whose reader has gone.
pub fn broken_pipe(error: &anyhow::Error) -> bool {
    error
        .chain()
        .any(|e| e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe))
}

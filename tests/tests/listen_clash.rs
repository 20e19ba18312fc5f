//! A binary started on a port another process listens on exits non-zero saying which flag gave
//! the address, the address, and that it is in use: each listener of `prism-head`,
//! `prism-worker` and `prism-router` (its `--port` too). None needs the model or a cluster.

use anyhow::{Result, bail, ensure};
use prism_tests::bin_path;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `bin args` to its exit (within 30 s) and returns its stderr; fails when it succeeds.
fn stderr_of_failed_start(bin: &str, args: &[&str]) -> Result<String> {
    let mut child = Command::new(bin_path(bin)?)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let until = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{bin} {} kept running on a taken port", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        std::io::Read::read_to_string(&mut pipe, &mut err)?;
    }
    ensure!(!status.success(), "{bin} {} started on a taken port: {err}", args.join(" "));
    Ok(err)
}

#[test]
fn each_listener_names_its_flag_when_its_port_is_taken() -> Result<()> {
    let taken = TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let port = taken.local_addr()?.port().to_string();
    let dir = tempfile::tempdir()?;
    let store = format!("embedded:{}", dir.path().join("state.json").display());
    let any = "127.0.0.1:0";
    let route = ["--static-route", "m=http://127.0.0.1:1"];
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        ("prism-head", vec!["--store", &store, "--listen", &addr, "--http-listen", any], "--listen"),
        ("prism-head", vec!["--store", &store, "--listen", any, "--http-listen", &addr], "--http-listen"),
        ("prism-worker", vec!["--listen", &addr, "--http-listen", any], "--listen"),
        ("prism-worker", vec!["--listen", any, "--http-listen", &addr], "--http-listen"),
        ("prism-router", [&route[..], &["--http-listen", &addr, "--grpc-listen", any]].concat(), "--http-listen"),
        (
            "prism-router",
            [&route[..], &["--http-listen", any, "--port", &port, "--grpc-listen", any]].concat(),
            "--port",
        ),
        ("prism-router", [&route[..], &["--http-listen", any, "--grpc-listen", &addr]].concat(), "--grpc-listen"),
    ];
    for (bin, args, flag) in cases {
        let err = stderr_of_failed_start(bin, &args)?;
        let want = format!("{flag} {addr} is already in use (another process is listening); pick another with {flag}");
        ensure!(err.contains(&want), "{bin} {}: want {want:?} in:\n{err}", args.join(" "));
    }
    Ok(())
}

//! Helpers shared by the end-to-end tests: finding the built binaries and the bundled
//! model, starting `prism up` (or any Prism process) as a child on free ports, reading the
//! endpoints it prints, OpenAI HTTP and gRPC calls, and checking for orphaned processes.
//!
//! Binaries are the ones next to the test executable (`target/debug/`); `.ci/run` builds
//! them with `cargo build --workspace --bins` before `cargo test`.

#![allow(dead_code)]

use anyhow::{Context, Result, anyhow, bail};
use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The repository root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// A Prism binary built next to this test executable (`target/debug/NAME`).
///
/// # Errors
/// Fails (naming the command that builds it) when the binary is missing.
pub fn bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().and_then(Path::parent).context("test executable has no target dir")?;
    let path = dir.join(name);
    if !path.exists() {
        bail!("{} is not built: run `cargo build --workspace --bins` first (.ci/run does)", path.display());
    }
    Ok(path)
}

/// The bundled model, or `None` (test skipped) when it is absent and `PRISM_REQUIRE_MODEL`
/// is not set. With `PRISM_REQUIRE_MODEL=1` a missing model fails the test.
pub fn model() -> Option<PathBuf> {
    let path = workspace_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Some(path);
    }
    let required = std::env::var("PRISM_REQUIRE_MODEL").is_ok_and(|v| v == "1");
    assert!(!required, "{} is missing and PRISM_REQUIRE_MODEL=1: run scripts/fetch-model.sh", path.display());
    eprintln!("skipped: {} is missing (run scripts/fetch-model.sh)", path.display());
    None
}

/// A child process whose stdout lines are readable and whose stderr is kept for diagnostics.
/// Dropping it kills the process.
pub struct Proc {
    /// What it is (for messages).
    pub name: String,
    child: Child,
    stdout: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Proc {
    /// Starts `program args` with `envs`, stdout and stderr piped.
    ///
    /// # Errors
    /// Fails when the process cannot be started.
    pub fn spawn(name: &str, program: &Path, args: &[String], envs: &[(&str, &str)]) -> Result<Self> {
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.current_dir(workspace_root());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().with_context(|| format!("cannot start {}", program.display()))?;
        let (tx, stdout) = std::sync::mpsc::channel();
        let out = child.stdout.take().context("stdout")?;
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let err = child.stderr.take().context("stderr")?;
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Ok(mut s) = sink.lock() {
                    if s.len() > 256 * 1024 {
                        let cut = s.len() - 128 * 1024;
                        let cut = (cut..s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(0);
                        s.drain(..cut);
                    }
                    s.push_str(&line);
                    s.push('\n');
                }
            }
        });
        Ok(Self { name: name.to_owned(), child, stdout, stderr })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process wrote to stderr so far (tail).
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Reads stdout lines until `pred` matches one (returned) or `timeout` passes.
    ///
    /// # Errors
    /// Fails on timeout or when the process exits first; stderr is in the message.
    pub fn wait_for_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(line) => {
                    if pred(&line) {
                        return Ok(line);
                    }
                    seen.push(line);
                }
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(e) => {
                    let status = self.child.try_wait().ok().flatten();
                    bail!(
                        "{}: no expected line ({e:?}; exit {status:?}); stdout:\n{}\nstderr:\n{}",
                        self.name,
                        seen.join("\n"),
                        self.stderr()
                    );
                }
            }
        }
    }

    /// Lines printed since the last read (non-blocking).
    pub fn drain_stdout(&mut self) -> Vec<String> {
        self.stdout.try_iter().collect()
    }

    /// Sends `signal` to the process.
    ///
    /// # Errors
    /// Fails when the signal cannot be delivered.
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> Result<()> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid())?);
        nix::sys::signal::kill(pid, signal).with_context(|| format!("kill -{signal} {}", self.name))
    }

    /// Waits for the exit, at most `limit`.
    ///
    /// # Errors
    /// Fails when the process is still running after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("{} still running {limit:?} after the signal; stderr:\n{}", self.name, self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.exited() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Process ids of every descendant of `pid` (children, their children, …), from `/proc`.
pub fn descendants(pid: u32) -> HashSet<u32> {
    let mut parent_of = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(p) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
            // "pid (comm) state ppid …": comm may contain spaces, so split after the last ')'.
            let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parent_of.push((p, ppid));
            }
        }
    }
    let mut found = HashSet::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for (child, _) in parent_of.iter().filter(|(_, pp)| *pp == parent) {
            if found.insert(*child) {
                frontier.push(*child);
            }
        }
    }
    found
}

/// Whether process `pid` is alive (a zombie counts as gone).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// Endpoints printed by `prism up`.
#[derive(Debug, Clone)]
pub struct UpEndpoints {
    /// Router HTTP base, e.g. `http://127.0.0.1:41234` (the OpenAI API is under `/v1`).
    pub http: String,
    /// Router gRPC, e.g. `http://127.0.0.1:41235`.
    pub grpc: String,
    /// Head gRPC.
    pub head: String,
    /// Worker `/metrics` URL (vLLM metric names).
    pub worker_metrics: String,
}

/// A running `prism up` on free ports.
pub struct PrismUp {
    /// The process.
    pub proc: Proc,
    /// Where it serves.
    pub endpoints: UpEndpoints,
}

fn field_after(line: &str, label: &str) -> Option<String> {
    line.trim_start().strip_prefix(label)?.split_whitespace().next().map(str::to_owned)
}

impl PrismUp {
    /// Starts `prism up --model MODEL` on free ports (plus `extra` flags) and waits until
    /// it prints its endpoints (the replica is Ready and the router lists the model).
    ///
    /// # Errors
    /// Fails when it does not come up within 300 s.
    pub fn start(model: &Path, extra: &[&str]) -> Result<Self> {
        let mut args: Vec<String> = ["up", "--model"].iter().map(|s| (*s).to_owned()).collect();
        args.push(model.to_string_lossy().into_owned());
        for flag in ["--port", "--grpc-port", "--head-port", "--head-http-port", "--worker-port", "--worker-http-port"]
        {
            args.push(flag.to_owned());
            args.push("0".to_owned());
        }
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut proc = Proc::spawn("prism up", &bin("prism")?, &args, &[("RUST_LOG", "info")])?;
        let mut http = None;
        let mut grpc = None;
        let mut head = None;
        let mut worker_metrics = None;
        while http.is_none() || grpc.is_none() || head.is_none() || worker_metrics.is_none() {
            let line = proc.wait_for_line(Duration::from_secs(300), |l| {
                ["OpenAI API:", "gRPC:", "Head:", "Metrics:"].iter().any(|p| l.trim_start().starts_with(p))
            })?;
            if let Some(rest) = line.trim_start().strip_prefix("Metrics:") {
                // router, worker, head: the worker's is the second.
                worker_metrics = rest.split_whitespace().nth(1).map(str::to_owned);
                continue;
            }
            if let Some(v) = field_after(&line, "OpenAI API:") {
                http = Some(v.trim_end_matches("/v1").to_owned());
            } else if let Some(v) = field_after(&line, "gRPC:") {
                grpc = Some(format!("http://{v}"));
            } else if let Some(v) = field_after(&line, "Head:") {
                head = Some(v);
            }
        }
        let endpoints = UpEndpoints {
            http: http.context("http")?,
            grpc: grpc.context("grpc")?,
            head: head.context("head")?,
            worker_metrics: worker_metrics.context("worker metrics")?,
        };
        Ok(Self { proc, endpoints })
    }

    /// Sends SIGINT and checks the exit: status 0 within `limit`, and no process it started
    /// is left behind. Returns the time it took.
    ///
    /// # Errors
    /// Fails on a late or non-zero exit or an orphaned descendant.
    pub fn interrupt(&mut self, limit: Duration) -> Result<Duration> {
        let children = descendants(self.proc.pid());
        let started = Instant::now();
        self.proc.signal(nix::sys::signal::Signal::SIGINT)?;
        let status = self.proc.wait_exit(limit)?;
        let took = started.elapsed();
        if !status.success() {
            bail!("prism up exited with {status} after SIGINT; stderr:\n{}", self.proc.stderr());
        }
        let left: Vec<u32> = children.into_iter().filter(|p| alive(*p)).collect();
        if !left.is_empty() {
            bail!("processes left behind by prism up: {left:?}");
        }
        Ok(took)
    }
}

/// Polls `check` every 100 ms until it returns `Ok(Some(v))`, or fails after `timeout`
/// with the last error.
///
/// # Errors
/// The last error (or "timed out") when `timeout` passes.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = anyhow!("timed out");
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = e,
        }
        if Instant::now() > deadline {
            return Err(last.context(format!("{what}: not reached within {timeout:?}")));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// POSTs JSON and returns (status, parsed body).
///
/// # Errors
/// Fails on transport errors or a body that is not JSON.
pub async fn post_json(url: &str, body: &serde_json::Value) -> Result<(u16, serde_json::Value)> {
    let response = reqwest::Client::new().post(url).json(body).send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let json = serde_json::from_str(&text).with_context(|| format!("not JSON ({status}): {text}"))?;
    Ok((status, json))
}

/// POSTs a `stream: true` request and returns the JSON payload of every SSE `data:` event
/// before `[DONE]` (an error if `[DONE]` never comes).
///
/// # Errors
/// Fails on transport errors, a non-200 status, malformed events or a missing `[DONE]`.
pub async fn post_sse(url: &str, body: &serde_json::Value) -> Result<Vec<serde_json::Value>> {
    let response = reqwest::Client::new().post(url).json(body).send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    if status != 200 {
        bail!("stream request got {status}: {text}");
    }
    let mut events = Vec::new();
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data:") else { continue };
        let data = data.trim();
        if data == "[DONE]" {
            return Ok(events);
        }
        events.push(serde_json::from_str(data).with_context(|| format!("bad SSE event {data}"))?);
    }
    bail!("stream ended without data: [DONE]:\n{text}")
}

/// Runs the `prism` CLI with `args` and returns its stdout.
///
/// # Errors
/// Fails when it exits non-zero (stderr in the message).
pub fn prism_cli(args: &[&str]) -> Result<String> {
    let out = Command::new(bin("prism")?).args(args).current_dir(workspace_root()).output()?;
    if !out.status.success() {
        bail!("prism {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One greedy case of the engine's reference fixture.
#[derive(Debug)]
pub struct ReferenceCase {
    /// Prompt token ids.
    pub prompt_ids: Option<Vec<u32>>,
    /// Prompt text.
    pub prompt: Option<String>,
    /// Expected greedy ids.
    pub output_ids: Vec<u32>,
}

fn ids(v: &serde_json::Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

/// Reads `tests/fixtures/smollm2_reference.json` (written by the engine's reference script).
/// Accepts a top-level array or an object with a `cases`/`prompts` array; each case has
/// `prompt_ids` (or `input_ids`) and/or a text `prompt`/`text`, and `greedy_ids` (or
/// `output_ids`/`generated_ids`/`completion_ids`). The reference does not stop at EOS, so
/// neither does the request (`ignore_eos`).
pub fn reference_cases() -> Result<Vec<ReferenceCase>> {
    let path = workspace_root().join("tests/fixtures/smollm2_reference.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let doc: serde_json::Value = serde_json::from_str(&text)?;
    let list = doc
        .as_array()
        .or_else(|| ["prompts", "cases"].iter().find_map(|k| doc.get(*k)?.as_array()))
        .context("reference fixture: no list of cases")?;
    let mut cases = Vec::new();
    for case in list {
        let pick = |keys: &[&str]| keys.iter().find_map(|k| case.get(*k).and_then(ids));
        let Some(output_ids) = pick(&["greedy_ids", "output_ids", "generated_ids", "completion_ids"]) else {
            continue;
        };
        cases.push(ReferenceCase {
            prompt_ids: pick(&["prompt_ids", "input_ids", "prompt_token_ids"]),
            prompt: ["prompt", "text"].iter().find_map(|k| case.get(*k)?.as_str()).map(str::to_owned),
            output_ids,
        });
    }
    if cases.is_empty() {
        bail!("reference fixture {} has no usable case", path.display());
    }
    Ok(cases)
}

/// Greedy generations through the router at `grpc` equal the reference fixture's ids.
///
/// # Errors
/// Fails on a gRPC error; a mismatch panics with both sequences.
pub async fn check_reference_greedy(grpc: &str, served: &str) -> Result<()> {
    let mut client =
        prism_common::proto::v1::inference_service_client::InferenceServiceClient::connect(grpc.to_owned()).await?;
    for (i, case) in reference_cases()?.into_iter().enumerate() {
        let prompt = match (&case.prompt_ids, &case.prompt) {
            (Some(ids), _) => {
                prism_common::proto::v1::generate_request::Prompt::TokenIds(prism_common::proto::v1::TokenIds {
                    ids: ids.clone(),
                })
            }
            (None, Some(text)) => prism_common::proto::v1::generate_request::Prompt::Text(text.clone()),
            (None, None) => continue,
        };
        let request = prism_common::proto::v1::GenerateRequest {
            model: served.into(),
            prompt: Some(prompt),
            sampling: Some(prism_common::proto::v1::SamplingParams {
                temperature: Some(0.0),
                max_tokens: Some(i64::try_from(case.output_ids.len())?),
                ignore_eos: true,
                skip_special_tokens: Some(true),
                ..prism_common::proto::v1::SamplingParams::default()
            }),
            ..prism_common::proto::v1::GenerateRequest::default()
        };
        let mut stream = client.generate(request).await?.into_inner();
        let mut got = Vec::new();
        while let Some(message) = stream.message().await? {
            got.extend(message.token_ids);
        }
        assert_eq!(got, case.output_ids, "reference case {i} ({:?})", case.prompt);
    }
    Ok(())
}

/// `GET /v1/models` lists exactly `served`.
///
/// # Errors
/// Fails on transport errors or a body without `data`.
pub async fn check_models(http: &str, served: &str) -> Result<()> {
    let models: serde_json::Value = reqwest::get(format!("{http}/v1/models")).await?.json().await?;
    let listed: Vec<&str> =
        models["data"].as_array().context("data")?.iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(listed, [served], "/v1/models: {models}");
    Ok(())
}

/// The sum of every sample of `metric` (all label sets) in Prometheus text `body`.
pub fn metric_sum(body: &str, metric: &str) -> Option<f64> {
    let mut found = None;
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if &line[..name_end] != metric {
            continue;
        }
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())?;
        found = Some(found.unwrap_or(0.0) + value);
    }
    found
}

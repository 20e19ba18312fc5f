//! `prism-loadgen`: a closed-loop HTTP/1.1 load generator for the router benchmark
//! (`bench/router/run.sh`). Each of `--concurrency` workers keeps one keep-alive connection
//! and sends the same POST back to back for `--duration` seconds after a warm-up; prints
//! one JSON line: requests/s, p50/p90/p99 latency in ms, errors. Hand-rolled over
//! `TcpStream` so the client adds as little as possible to what is measured.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Flags of the load generator.
#[derive(Parser, Clone)]
#[command(name = "prism-loadgen", about = "Closed-loop HTTP load generator (router benchmark)")]
struct Args {
    /// Target, e.g. http://127.0.0.1:8000/v1/completions (plain HTTP only).
    #[arg(long)]
    url: String,
    /// JSON body to POST.
    #[arg(long, default_value = r#"{"model":"mock","prompt":"hi","max_tokens":1}"#)]
    body: String,
    /// Concurrent connections (closed loop: one request in flight each).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Measured seconds.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Warm-up seconds (not measured).
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Label printed with the result.
    #[arg(long, default_value = "")]
    label: String,
}

fn find(h: &[u8], pat: &[u8]) -> Option<usize> {
    h.windows(pat.len()).position(|w| w == pat)
}

/// Reads one HTTP/1.1 response (Content-Length or chunked); returns the status code.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> anyhow::Result<u16> {
    let mut tmp = [0u8; 16384];
    let head_end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            bail!("connection closed");
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).context("header not utf-8")?.to_ascii_lowercase();
    let status: u16 = head.get(9..12).context("short status line")?.parse()?;
    let chunked = head.contains("transfer-encoding: chunked");
    let len =
        head.lines().find_map(|l| l.strip_prefix("content-length:")).map(|v| v.trim().parse::<usize>()).transpose()?;
    if chunked {
        loop {
            if let Some(i) = find(&buf[head_end..], b"0\r\n\r\n")
                && (i == 0 || buf[head_end + i - 1] == b'\n')
            {
                buf.drain(..head_end + i + 5);
                return Ok(status);
            }
            let n = s.read(&mut tmp).await?;
            if n == 0 {
                bail!("connection closed");
            }
            buf.extend_from_slice(&tmp[..n]);
        }
    }
    let len = len.unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            bail!("connection closed");
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    buf.drain(..head_end + len);
    Ok(status)
}

async fn worker(a: Args, host: String, path: String, start: Instant, end: Instant) -> anyhow::Result<(Vec<u32>, u64)> {
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
        a.body.len(),
        a.body
    );
    let mut s = TcpStream::connect(&host).await?;
    s.set_nodelay(true)?;
    let mut buf = Vec::with_capacity(16384);
    let mut lat_us = Vec::new();
    let mut errors = 0u64;
    loop {
        let t = Instant::now();
        if t >= end {
            break;
        }
        let sent = s.write_all(req.as_bytes()).await;
        let got = match sent {
            Ok(()) => read_response(&mut s, &mut buf).await,
            Err(e) => Err(e.into()),
        };
        let ok = match got {
            Ok(st) => st == 200,
            Err(_) => {
                s = TcpStream::connect(&host).await?;
                s.set_nodelay(true)?;
                buf.clear();
                false
            }
        };
        if t >= start {
            if ok {
                lat_us.push(u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX));
            } else {
                errors += 1;
            }
        }
    }
    Ok((lat_us, errors))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let rest = a.url.strip_prefix("http://").context("only http:// URLs")?;
    let (host, path) = match rest.find('/') {
        Some(i) => (rest[..i].to_owned(), rest[i..].to_owned()),
        None => (rest.to_owned(), "/".to_owned()),
    };
    let start = Instant::now() + Duration::from_secs_f64(a.warmup);
    let end = start + Duration::from_secs_f64(a.duration);
    let tasks: Vec<_> =
        (0..a.concurrency).map(|_| tokio::spawn(worker(a.clone(), host.clone(), path.clone(), start, end))).collect();
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await??;
        all.extend(l);
        errors += e;
    }
    all.sort_unstable();
    let pct = |p: f64| -> f64 {
        if all.is_empty() {
            return f64::NAN;
        }
        let i = ((all.len() as f64 - 1.0) * p).round() as usize;
        f64::from(all[i]) / 1000.0
    };
    let rps = all.len() as f64 / a.duration;
    println!(
        "{{\"label\":\"{}\",\"concurrency\":{},\"requests\":{},\"errors\":{},\"rps\":{:.1},\"p50_ms\":{:.3},\"p90_ms\":{:.3},\"p99_ms\":{:.3}}}",
        a.label,
        a.concurrency,
        all.len(),
        errors,
        rps,
        pct(0.5),
        pct(0.9),
        pct(0.99)
    );
    Ok(())
}

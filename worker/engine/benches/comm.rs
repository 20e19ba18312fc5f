//! Host communicator benchmark: ranks as threads of one process over loopback TCP (the
//! transport is the same between processes). All-reduce latency (p50/p99) for 2, 3 and 4
//! ranks with both algorithms at the sizes a step moves: 576 f32 (SmolLM2-135M's hidden state,
//! batch 1), 576x32 (batch 32), 4096 (Llama-3-8B, batch 1), 4096x64 and 16 MiB; then send/recv
//! latency (ping-pong, half the round trip) and bandwidth, and barrier latency; last, the
//! default all-reduce with ranks 1.. as processes of their own (this binary run again).
//!
//! Run: `cargo bench -p prism-engine --bench comm` (or `--profile dev`, whose engine and
//! dependencies are optimised too). Env: `PRISM_BENCH_COMM_SCALE` multiplies the iteration
//! counts (default 1).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::thread;
use std::time::{Duration, Instant};

use prism_engine::parallel::comm::{AllReduceAlgorithm, Communicator, HostComm, HostCommListener};

const ROUNDS: usize = 5;

fn mesh(n: usize) -> Vec<HostComm> {
    let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let listeners: Vec<_> = (0..n).map(|_| HostCommListener::bind(ip, "127.0.0.1").expect("bind")).collect();
    let addresses: Vec<String> = listeners.iter().map(|l| l.address().to_string()).collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addresses = addresses.clone();
            thread::spawn(move || l.connect(rank, &addresses, Duration::from_secs(60)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("setup").expect("mesh")).collect()
}

/// The operation timed: a communicator and a buffer allocated once per rank (outside the
/// timed calls).
type Op = fn(&mut HostComm, &mut [f32]);

/// Runs `op` `iters` times on every rank at once (after 3 warm-up calls) on a buffer of `len`
/// values; rank 0's per-call times.
fn run(comms: Vec<HostComm>, iters: usize, len: usize, op: Op) -> (Vec<HostComm>, Vec<Duration>) {
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            thread::spawn(move || {
                let mut buf = vec![1.0f32; len];
                for _ in 0..3 {
                    op(&mut c, &mut buf);
                }
                let mut times = Vec::with_capacity(iters);
                for _ in 0..iters {
                    let start = Instant::now();
                    op(&mut c, &mut buf);
                    times.push(start.elapsed());
                }
                (c, times)
            })
        })
        .collect();
    let mut comms = Vec::new();
    let mut rank0 = Vec::new();
    for (i, h) in handles.into_iter().enumerate() {
        let (c, times) = h.join().expect("rank thread");
        comms.push(c);
        if i == 0 {
            rank0 = times;
        }
    }
    (comms, rank0)
}

fn percentile(times: &mut [Duration], p: f64) -> f64 {
    times.sort();
    let i = ((times.len() as f64 - 1.0) * p).round() as usize;
    times[i].as_secs_f64() * 1e6
}

fn scale() -> f64 {
    std::env::var("PRISM_BENCH_COMM_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0)
}

fn iters_for(values: usize) -> usize {
    let base = match values {
        0..=4096 => 3000,
        4097..=32_768 => 1000,
        32_769..=300_000 => 100,
        _ => 12,
    };
    ((base as f64 * scale()) as usize).max(5)
}

fn all_reduce(c: &mut HostComm, buf: &mut [f32]) {
    let group: Vec<usize> = (0..c.world_size()).collect();
    c.all_reduce_sum(&group, buf).expect("all-reduce");
    // Keep the values bounded: 1.0 on every rank sums to n, so rescale to 1.0.
    let n = group.len() as f32;
    buf.iter_mut().for_each(|v| *v /= n);
}

fn row(op: &str, ranks: usize, values: &str, algorithm: &str, times: &mut [Duration], bytes_per_op: Option<usize>) {
    let p50 = percentile(times, 0.5);
    let p99 = percentile(times, 0.99);
    let rate = bytes_per_op.map_or("".to_string(), |b| format!("{:.0}", b as f64 / p50));
    println!("| {op} | {ranks} | {values} | {algorithm} | {p50:.1} | {p99:.1} | {rate} | {} |", times.len());
}

fn main() {
    if let Ok(spec) = std::env::var(RANK_ENV) {
        return rank_process(&spec);
    }
    println!("| operation | ranks | f32 values | algorithm | p50 µs | p99 µs | MB/s (p50) | iterations |");
    println!("|---|---|---|---|---|---|---|---|");
    let sizes = [("576", 576), ("576x32", 576 * 32), ("4096", 4096), ("4096x64", 4096 * 64), ("16 MiB", 4 << 20)];
    for n in 2..=4 {
        let mut comms = mesh(n);
        for (label, len) in sizes {
            // Five rounds alternating the two algorithms, so drift in the machine's load
            // (other work on its cores) falls on both alike.
            let algorithms = [
                ("gather-all", AllReduceAlgorithm::GatherAll),
                ("reduce-broadcast", AllReduceAlgorithm::ReduceBroadcast),
            ];
            let mut pooled = [Vec::new(), Vec::new()];
            for _ in 0..ROUNDS {
                for (i, (_, algorithm)) in algorithms.iter().enumerate() {
                    comms.iter_mut().for_each(|c| c.set_all_reduce_algorithm(*algorithm));
                    let (back, times) = run(comms, iters_for(len).div_ceil(ROUNDS), len, all_reduce);
                    comms = back;
                    pooled[i].extend(times);
                }
            }
            for ((name, _), times) in algorithms.iter().zip(&mut pooled) {
                row("all-reduce", n, label, name, times, Some(len * 4));
            }
        }
        let (back, mut times) = run(comms, iters_for(0), 0, |c, _| {
            let group: Vec<usize> = (0..c.world_size()).collect();
            c.barrier(&group).expect("barrier");
        });
        row("barrier", n, "0", "", &mut times, None);
        drop(back);
    }
    let mut comms = mesh(2);
    for (label, len) in [("576", 576), ("4096", 4096), ("16 MiB", 4 << 20)] {
        let (back, mut times) = run(comms, iters_for(len), len, ping_pong);
        comms = back;
        // A ping-pong moves the buffer twice: half the round trip is one send + recv.
        times.iter_mut().for_each(|t| *t /= 2);
        row("send/recv (half round trip)", 2, label, "", &mut times, Some(len * 4));
    }
    process_rows();
}

const RANK_ENV: &str = "PRISM_BENCH_COMM_RANK";
/// The all-reduces timed between processes: (label, values), default algorithm.
const PROCESS_CELLS: [(&str, usize); 3] = [("576", 576), ("576x32", 576 * 32), ("4096", 4096)];

/// Times the default all-reduce with ranks 1.. as processes of their own (this binary again);
/// rank 0 is this process.
fn process_rows() {
    for n in 2..=4 {
        let mut children: Vec<_> = (1..n)
            .map(|rank| {
                std::process::Command::new(std::env::current_exe().expect("bench binary"))
                    .env(RANK_ENV, format!("{rank}"))
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .expect("start a rank process")
            })
            .collect();
        let listener = HostCommListener::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), "127.0.0.1").expect("bind");
        let mut addresses = vec![listener.address().to_string()];
        for child in &mut children {
            let mut line = String::new();
            BufRead::read_line(&mut BufReader::new(child.stdout.as_mut().expect("stdout")), &mut line)
                .expect("address");
            addresses.push(line.trim().to_string());
        }
        for child in &mut children {
            let stdin = child.stdin.as_mut().expect("stdin");
            writeln!(stdin, "{}", addresses.join(",")).expect("send addresses");
        }
        let mut comm = listener.connect(0, &addresses, Duration::from_secs(60)).expect("mesh");
        for (label, len) in PROCESS_CELLS {
            let mut times = timed_all_reduces(&mut comm, len);
            row("all-reduce, rank processes", n, label, "auto", &mut times, Some(len * 4));
        }
        for mut child in children {
            let _ = child.wait();
        }
    }
}

/// A rank process of [`process_rows`]: prints its address, reads everyone's, runs the cells.
fn rank_process(rank: &str) {
    let rank: usize = rank.parse().expect("rank");
    let listener = HostCommListener::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), "127.0.0.1").expect("bind");
    println!("{}", listener.address());
    std::io::stdout().flush().expect("flush");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("addresses");
    let addresses: Vec<String> = line.trim().split(',').map(str::to_string).collect();
    let mut comm = listener.connect(rank, &addresses, Duration::from_secs(60)).expect("mesh");
    for (_, len) in PROCESS_CELLS {
        timed_all_reduces(&mut comm, len);
    }
}

fn timed_all_reduces(comm: &mut HostComm, len: usize) -> Vec<Duration> {
    let mut buf = vec![1.0f32; len];
    for _ in 0..3 {
        all_reduce(comm, &mut buf);
    }
    (0..iters_for(len))
        .map(|_| {
            let start = Instant::now();
            all_reduce(comm, &mut buf);
            start.elapsed()
        })
        .collect()
}

/// Rank 0 sends its buffer to rank 1, which sends it back.
fn ping_pong(c: &mut HostComm, buf: &mut [f32]) {
    if c.rank() == 0 {
        c.send(1, buf).expect("send");
        c.recv(1, buf).expect("recv");
    } else {
        c.recv(0, buf).expect("recv");
        c.send(0, buf).expect("send");
    }
}

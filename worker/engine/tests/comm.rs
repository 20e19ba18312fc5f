//! The host communicator between ranks running as threads of one process over loopback:
//! all-reduce results (right, and bitwise equal on every member), sub-groups, all-gather,
//! send/recv of large buffers both ways at once, and failures (a frozen peer times out, a
//! dead one is gone at once, abort, mismatched lengths, a failed communicator stays failed).

use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use prism_engine::parallel::comm::{AllReduceAlgorithm, CommError, Communicator, HostComm, HostCommListener};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A mesh of `n` ranks (index = rank), formed from `n` threads as rank processes would.
fn mesh(n: usize, timeout: Duration) -> Vec<HostComm> {
    let listeners: Vec<HostCommListener> =
        (0..n).map(|_| HostCommListener::bind(LOOPBACK, "127.0.0.1").expect("bind")).collect();
    let addresses: Vec<String> = listeners.iter().map(|l| l.address().to_string()).collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, listener)| {
            let addresses = addresses.clone();
            thread::spawn(move || listener.connect(rank, &addresses, timeout))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("setup thread").expect("mesh forms")).collect()
}

/// Runs `f(comm)` for every rank on a thread of its own; results in rank order.
fn on_ranks<T: Send + 'static>(
    comms: Vec<HostComm>,
    f: impl Fn(&mut HostComm) -> T + Send + Sync + Clone + 'static,
) -> Vec<(HostComm, T)> {
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut comm| {
            let f = f.clone();
            thread::spawn(move || {
                let out = f(&mut comm);
                (comm, out)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

/// Rank `rank`'s contribution: values of very different magnitudes, so the order of the
/// sum shows in the last bits.
fn contribution(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = ((i * 7919 + rank * 104_729) % 1000) as f32 / 997.0;
            if (i + rank).is_multiple_of(3) { x * 1.0e7 } else { x * 1.0e-3 - 0.5 }
        })
        .collect()
}

#[test]
fn all_reduce_sums_in_rank_order_bitwise_equal_on_every_member() {
    for algorithm in [AllReduceAlgorithm::GatherAll, AllReduceAlgorithm::ReduceBroadcast] {
        for n in 2..=4 {
            let mut comms = mesh(n, Duration::from_secs(20));
            comms.iter_mut().for_each(|c| c.set_all_reduce_algorithm(algorithm));
            for len in [1usize, 576, 1_000_000] {
                let mut expected = contribution(0, len);
                for rank in 1..n {
                    expected.iter_mut().zip(contribution(rank, len)).for_each(|(e, v)| *e += v);
                }
                let group: Vec<usize> = (0..n).collect();
                let results = on_ranks(comms, move |c| {
                    let mut buf = contribution(c.rank(), len);
                    c.all_reduce_sum(&group, &mut buf).expect("all-reduce");
                    buf
                });
                for (rank, (_, got)) in results.iter().enumerate() {
                    let same = got.iter().zip(&expected).all(|(g, e)| g.to_bits() == e.to_bits());
                    assert!(
                        same,
                        "{algorithm:?}, {n} ranks, {len} values: rank {rank} differs from the ascending-order sum"
                    );
                }
                comms = results.into_iter().map(|(c, _)| c).collect();
            }
        }
    }
}

#[test]
fn sub_groups_reduce_concurrently_then_all_gather_over_everyone() {
    let comms = mesh(4, Duration::from_secs(10));
    let results = on_ranks(comms, |c| {
        let rank = c.rank();
        let group = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
        let mut buf = vec![rank as f32 + 1.0; 576];
        c.all_reduce_sum(&group, &mut buf).expect("sub-group all-reduce");
        let mut gathered = vec![0.0; 4 * 2];
        c.all_gather(&[0, 1, 2, 3], &[rank as f32, buf[0]], &mut gathered).expect("all-gather");
        let mut odd = vec![0.0; 2 * 3];
        if rank % 2 == 1 {
            c.all_gather(&[1, 3], &[rank as f32; 3], &mut odd).expect("all-gather of ranks 1 and 3");
        }
        c.barrier(&[0, 1, 2, 3]).expect("barrier");
        (buf, gathered, odd)
    });
    for (rank, (_, (buf, gathered, odd))) in results.iter().enumerate() {
        let want = if rank < 2 { 3.0 } else { 7.0 };
        assert!(buf.iter().all(|&v| v == want), "rank {rank}: sub-group sum {} != {want}", buf[0]);
        assert_eq!(gathered, &vec![0.0, 3.0, 1.0, 3.0, 2.0, 7.0, 3.0, 7.0], "rank {rank}: all-gather in group order");
        if rank % 2 == 1 {
            assert_eq!(odd, &vec![1.0, 1.0, 1.0, 3.0, 3.0, 3.0], "rank {rank}: all-gather of {{1, 3}}");
        }
    }
}

#[test]
fn sixteen_mib_both_ways_at_once_does_not_deadlock() {
    let len = 4 << 20; // 16 MiB of f32
    let comms = mesh(2, Duration::from_secs(20));
    let results = on_ranks(comms, move |c| {
        let rank = c.rank();
        let peer = 1 - rank;
        let mine = contribution(rank, len);
        c.send(peer, &mine).expect("send 16 MiB while the peer sends too");
        let mut theirs = vec![0.0; len];
        c.recv(peer, &mut theirs).expect("recv 16 MiB");
        // A small message after a large one on the same connection.
        c.send(peer, &[rank as f32]).expect("small send");
        let mut small = [0.0];
        c.recv(peer, &mut small).expect("small recv");
        (theirs, small[0])
    });
    for (rank, (_, (theirs, small))) in results.iter().enumerate() {
        assert!(theirs == &contribution(1 - rank, len), "rank {rank} received the peer's 16 MiB intact");
        assert_eq!(*small, (1 - rank) as f32);
    }
}

#[test]
fn a_peer_that_stops_calling_times_out_naming_it_and_the_comm_stays_failed() {
    let timeout = Duration::from_millis(300);
    let mut comms = mesh(2, timeout);
    let idle = comms.pop().expect("rank 1");
    let mut comm = comms.pop().expect("rank 0");
    let start = Instant::now();
    let err = comm.all_reduce_sum(&[0, 1], &mut [1.0; 576]).expect_err("rank 1 never calls");
    let took = start.elapsed();
    assert!(matches!(err, CommError::Timeout { peer: 1, .. }), "got {err:?}");
    assert!(took >= timeout && took < timeout + Duration::from_millis(150), "timed out after {took:?}");
    // Rank 1 now takes part, but rank 0 failed: it must not carry on half-synchronised.
    let start = Instant::now();
    let again = comm.barrier(&[0, 1]).expect_err("a failed communicator stays failed");
    assert!(matches!(again, CommError::Timeout { peer: 1, .. }), "got {again:?}");
    assert!(start.elapsed() < Duration::from_millis(50), "the later call fails at once");
    drop(idle);
}

#[test]
fn a_peer_whose_comm_is_dropped_is_gone_at_once() {
    let mut comms = mesh(3, Duration::from_secs(10));
    drop(comms.pop()); // rank 2
    let mut comm = comms.remove(0);
    let start = Instant::now();
    let err = comm.recv(2, &mut [0.0; 8]).expect_err("rank 2 is gone");
    assert!(matches!(err, CommError::PeerGone { peer: 2, .. }), "got {err:?}");
    assert!(start.elapsed() < Duration::from_millis(200), "noticed after {:?}", start.elapsed());
    let err = comm.send(1, &[1.0]).expect_err("failed stays failed");
    assert!(matches!(err, CommError::PeerGone { peer: 2, .. }), "got {err:?}");
}

#[test]
fn abort_from_another_thread_ends_a_blocked_operation() {
    let mut comms = mesh(2, Duration::from_secs(30));
    let _idle = comms.pop();
    let mut comm = comms.pop().expect("rank 0");
    let handle = comm.abort_handle();
    let aborter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        handle.abort();
        Instant::now()
    });
    let err = comm.all_reduce_sum(&[0, 1], &mut [0.0; 576]).expect_err("aborted");
    let returned = Instant::now();
    let aborted_at = aborter.join().expect("aborter");
    assert!(matches!(err, CommError::Aborted), "got {err:?}");
    let lag = returned.duration_since(aborted_at);
    assert!(lag < Duration::from_millis(100), "returned {lag:?} after the abort");
    assert!(matches!(comm.barrier(&[0, 1]), Err(CommError::Aborted)), "later operations fail at once");
}

#[test]
fn a_recv_of_another_length_is_invalid_and_fails_the_comm() {
    let comms = mesh(2, Duration::from_secs(10));
    let results = on_ranks(comms, |c| {
        if c.rank() == 1 {
            c.send(0, &[1.0; 10]).map(|_| None)
        } else {
            let first = c.recv(1, &mut [0.0; 11]).err();
            Ok(Some((first, c.send(1, &[0.0]).err())))
        }
    });
    let mut results = results.into_iter().map(|(_, r)| r);
    let rank0 = results.next().expect("rank 0").expect("rank 0 never errs itself");
    let (first, later) = rank0.expect("rank 0 result");
    assert!(matches!(first, Some(CommError::Invalid(_))), "got {first:?}");
    assert!(matches!(later, Some(CommError::Invalid(_))), "the comm stays failed, got {later:?}");
}

#[test]
fn bad_groups_and_peers_are_invalid() {
    let mut comms = mesh(3, Duration::from_secs(10));
    type Case = Box<dyn Fn(&mut HostComm) -> Result<(), CommError>>;
    let cases: Vec<(&str, Case)> = vec![
        ("group without this rank", Box::new(|c| c.all_reduce_sum(&[1, 2], &mut [0.0]))),
        ("rank outside the world", Box::new(|c| c.barrier(&[0, 3]))),
        ("unsorted group", Box::new(|c| c.all_gather(&[1, 0], &[0.0], &mut [0.0; 2]))),
        ("peer outside the world", Box::new(|c| c.send(7, &[0.0]))),
        ("peer is this rank", Box::new(|c| c.recv(0, &mut [0.0]))),
        ("all-gather output of the wrong size", Box::new(|c| c.all_gather(&[0, 1], &[0.0; 2], &mut [0.0; 3]))),
    ];
    for (what, case) in cases {
        // Each case on a fresh rank-0 communicator: an invalid call fails the one it was made on.
        let mut fresh = mesh(3, Duration::from_secs(10));
        let err = case(&mut fresh[0]).expect_err(what);
        assert!(matches!(err, CommError::Invalid(_)), "{what}: got {err:?}");
    }
    let err = comms.remove(0).all_reduce_sum(&[0, 5], &mut [0.0]).expect_err("out of range");
    assert!(matches!(err, CommError::Invalid(_)));
}

#[test]
fn setup_refuses_a_stray_connection_and_still_forms() {
    let listeners: Vec<HostCommListener> =
        (0..2).map(|_| HostCommListener::bind(LOOPBACK, "127.0.0.1").expect("bind")).collect();
    let addresses: Vec<String> = listeners.iter().map(|l| l.address().to_string()).collect();
    // A connection claiming to be rank 5 of a two-rank world: refused, rank 0 keeps waiting.
    let mut stray = TcpStream::connect(&addresses[0]).expect("stray connect");
    let mut hello = Vec::new();
    hello.extend_from_slice(&0x5052_4d43u32.to_le_bytes());
    hello.extend_from_slice(&5u32.to_le_bytes());
    hello.extend_from_slice(&2u32.to_le_bytes());
    std::io::Write::write_all(&mut stray, &hello).expect("stray hello");
    let mut it = listeners.into_iter();
    let (l0, l1) = (it.next().expect("0"), it.next().expect("1"));
    let a = addresses.clone();
    let r0 = thread::spawn(move || l0.connect(0, &a, Duration::from_secs(5)));
    thread::sleep(Duration::from_millis(100));
    let mut c1 = l1.connect(1, &addresses, Duration::from_secs(5)).expect("rank 1 joins");
    let mut c0 = r0.join().expect("rank 0").expect("rank 0 forms the mesh");
    let t = thread::spawn(move || {
        let mut b = [2.0f32];
        c1.all_reduce_sum(&[0, 1], &mut b).map(|_| b[0])
    });
    let mut b = [1.0f32];
    c0.all_reduce_sum(&[0, 1], &mut b).expect("rank 0 all-reduce");
    assert_eq!(b[0], 3.0);
    assert_eq!(t.join().expect("rank 1").expect("rank 1 all-reduce"), 3.0);
    let mut buf = [0u8; 1];
    let refused = std::io::Read::read(&mut stray, &mut buf);
    assert!(matches!(refused, Ok(0) | Err(_)), "the stray connection was closed, got {refused:?}");
    // A rank index outside the addresses is a clear error, not a panic.
    let l = HostCommListener::bind(LOOPBACK, "127.0.0.1").expect("bind");
    assert!(matches!(l.connect(2, &addresses, Duration::from_secs(1)), Err(CommError::Invalid(_))));
}

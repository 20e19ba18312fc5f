//! Host communicator micro-benchmark (filled in next).

fn main() {}

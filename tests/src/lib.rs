//! Test fixtures: etcd, clusters of real processes on loopback ports.

//! Replicas bigger than one device: tensor parallelism (Megatron-LM) and pipeline
//! parallelism (GPipe-style micro-batches within a step), with each rank beyond the driver's
//! own running as a process of its own (vLLM's multiprocessing executor).
//!
//! - [`layout`]: `tensor_parallel_size × pipeline_parallel_size`, vLLM's rank order
//!   (`rank = pp_rank · tp + tp_rank`), each stage's layers, and the checks against a model.
//! - [`comm`]: the [`comm::Communicator`] trait (all-reduce, all-gather, send/recv, barrier,
//!   abort; every operation bounded by a timeout) and its host implementation over TCP
//!   (the CPU backend's collectives, and rendezvous for NCCL on CUDA).
//! - [`stage`]: [`stage::StageBackend`], one rank's part of a forward step (its TP shard of
//!   its stage's layers), and [`stage::InitSpec`], what the driver tells every rank.
//! - [`rank`]: the rank process (`main_from_env`, called first thing by every Prism binary)
//!   and the driver's [`rank::Rendezvous`] listener.
//! - [`spawn`]: starting and supervising rank processes (killed with their parent).
//! - [`wire`]: the control protocol's frames between the driver and each rank.
//! - [`group`]: the driver's side of the control connections (joins, per-rank links).
//! - [`driver`]: [`driver::ParallelBackend`], the `Backend` the step loop drives: it
//!   broadcasts each step's batch to the ranks, runs rank 0's shard itself and returns the
//!   last stage's logits.

pub mod comm;
pub mod driver;
pub mod group;
pub mod layout;
pub mod rank;
pub mod spawn;
pub mod stage;
pub mod wire;

pub use driver::{ParallelBackend, ParallelConfig, StepTiming};
pub use layout::ParallelSizes;

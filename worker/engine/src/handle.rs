//! [`EngineHandle`]: the cloneable front door of one engine replica. `submit` validates
//! and tokenizes on the caller's thread, then hands the request to the step thread
//! (`step_loop.rs`) through a channel; outputs come back on a bounded stream whose
//! drop aborts the request at the next step boundary.
//!
//! Each replica runs its compute on its own rayon pool (built here, `install`ed around every
//! forward pass), so one replica's long step cannot starve another replica's steps in a
//! shared global pool; the pool's threads exit when the step thread does.

use super::backend::{Backend, StepControl, StopKind};
use super::codec::{ChatVars, CodecExport, TextCodec, prompt_ids_with};
use super::kv_cache::BlockPool;
use super::kv_cache::CacheEvents;
use super::metrics::{EngineStats, StatsRecorder};
use super::request::{EngineError, EngineOutput, EngineRequest, MAX_CACHE_SALT_BYTES, check_lengths, check_token_ids};
use super::scheduler::{Scheduler, SchedulerConfig};
use super::step_loop::{Command, EngineCore, Fault, NewRequest};
use super::structured::GrammarCompiler;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::mpsc;

/// Scheduler and admission limits (vLLM's names and defaults where it has them).
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Served model name (reported in [`ModelInfo`]).
    pub served_model_name: String,
    /// Context window; `None` = the model's, capped at the KV cache's capacity. A value given
    /// is served as given or the engine does not start (see [`EngineHandle::start_with_parts`]).
    pub max_model_len: Option<usize>,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens per step (prefill chunks + decodes).
    pub max_num_batched_tokens: usize,
    /// Most requests accepted and unfinished before `submit` answers `Overloaded`.
    pub max_pending_requests: usize,
    /// Capacity of each request's output channel (outputs are merged when it is full).
    pub output_buffer: usize,
    /// Threads of this replica's compute pool; `None` = one per core
    /// (`std::thread::available_parallelism`).
    pub engine_threads: Option<usize>,
    /// Automatic prefix caching (vLLM's `enable_prefix_caching`, on by default): full KV
    /// blocks are kept, keyed by their chained hash, and reused by later requests.
    pub enable_prefix_caching: bool,
    /// The model identity folded into the first block's hash (see
    /// [`crate::kv_cache::prefix_hash`]), so routers never match one model's blocks for another.
    pub cache_namespace: u64,
    /// Parse special-token text inside chat messages as special tokens (off by default: only
    /// the chat template makes special tokens; see [`crate::codec`]). Completion prompts
    /// always parse it.
    pub chat_content_special_tokens: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            served_model_name: "model".to_owned(),
            max_model_len: None,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_pending_requests: 4096,
            output_buffer: 64,
            engine_threads: None,
            enable_prefix_caching: true,
            cache_namespace: 0,
            chat_content_special_tokens: false,
        }
    }
}

/// A backend and a codec, ready to run: what [`EngineHandle::start_with_parts`] takes
/// (the model loader builds it; tests can build one from doubles).
pub struct EngineParts {
    /// The backend with its KV-cache memory allocated.
    pub backend: Box<dyn Backend>,
    /// Tokenizer and chat template.
    pub codec: Arc<dyn TextCodec>,
    /// End-of-sequence token ids.
    pub eos_ids: Vec<u32>,
    /// The model's own context window (tokens).
    pub model_max_len: usize,
    /// Stop requests and progress shared with the backend (a backend that polls it between
    /// layers stops within a layer; others at the end of their step).
    pub control: StepControl,
}

/// Static facts about the served model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// Name clients use.
    pub served_model_name: String,
    /// Effective context window (tokens): prompt + completion never exceed it.
    pub max_model_len: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// End-of-sequence ids.
    pub eos_ids: Vec<u32>,
    /// KV-cache block size (tokens).
    pub block_size: usize,
    /// KV-cache blocks.
    pub num_kv_blocks: usize,
    /// KV-cache bytes per token (all layers, K and V).
    pub kv_bytes_per_token: usize,
    /// Backend name ("cpu", "cuda").
    pub backend: &'static str,
    /// Whether the prefix cache is on.
    pub prefix_caching: bool,
    /// The hash namespace of the prefix cache ([`RuntimeConfig::cache_namespace`]).
    pub cache_namespace: u64,
}

/// The context window to serve: `configured` when given and it fits, else the model's own
/// (`model_max_len`) capped to the KV cache's capacity (blocks × block size: the longest
/// sequence that fits alone).
///
/// # Errors
/// [`EngineError::InvalidRequest`] (`max_model_len`) when `configured` exceeds the model's
/// context length or the capacity: the message says what fits and which knob gives the
/// cache more memory.
fn effective_max_model_len(
    configured: Option<usize>,
    model_max_len: usize,
    backend: &dyn Backend,
) -> Result<usize, EngineError> {
    let capacity = backend.num_kv_blocks() * backend.block_size();
    let Some(wanted) = configured else {
        if capacity < model_max_len {
            tracing::info!(
                model_max_len,
                capacity,
                "max_model_len not set: the model's context length capped to what the KV cache holds"
            );
        }
        return Ok(model_max_len.min(capacity));
    };
    if wanted > model_max_len {
        return Err(EngineError::InvalidRequest {
            field: "max_model_len",
            message: format!(
                "max_model_len {wanted} is larger than the model's context length {model_max_len}; \
                 set it to at most {model_max_len}, or leave it unset to use the model's"
            ),
        });
    }
    if wanted > capacity {
        let memory_knob = if backend.name() == "cpu" { "kv_cache_bytes" } else { "gpu_memory_utilization" };
        return Err(EngineError::InvalidRequest {
            field: "max_model_len",
            message: format!(
                "max_model_len {wanted} does not fit in the KV cache, which holds {capacity} tokens ({} \
                 blocks of {}); lower max_model_len to at most {capacity}, leave it unset to fit the \
                 cache, or give the cache more memory ({memory_knob})",
                backend.num_kv_blocks(),
                backend.block_size()
            ),
        });
    }
    Ok(wanted)
}

struct Inner {
    tx: Mutex<Option<Sender<Command>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stats: Arc<StatsRecorder>,
    pool: BlockPool,
    codec: Arc<dyn TextCodec>,
    info: ModelInfo,
    cfg: RuntimeConfig,
    /// The model's grammar compiler, built by the first request with a grammar.
    grammars: OnceLock<Result<Arc<GrammarCompiler>, String>>,
}

/// Cloneable handle to one running engine. The step thread stops on
/// [`EngineHandle::shutdown`], or when every handle is dropped and no request is left.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("model", &self.inner.info).finish_non_exhaustive()
    }
}

impl EngineHandle {
    /// Starts the step thread over ready-made parts.
    ///
    /// The context window served is `cfg.max_model_len` when given, else the model's own
    /// capped to what the KV cache holds (vLLM's auto-fit: one sequence of that length fits).
    ///
    /// # Errors
    /// [`EngineError::Internal`] when the thread cannot be spawned or the backend has no
    /// KV-cache blocks; [`EngineError::InvalidRequest`] (field `max_model_len`) when
    /// `cfg.max_model_len` exceeds the model's context length or the KV cache's capacity
    /// (vLLM refuses to start then too, rather than serve a shorter context than asked for).
    pub fn start_with_parts(parts: EngineParts, cfg: RuntimeConfig) -> Result<Self, EngineError> {
        let block_size = parts.backend.block_size();
        let num_blocks = parts.backend.num_kv_blocks();
        if num_blocks == 0 || block_size == 0 {
            return Err(EngineError::Internal("the KV cache has no blocks; raise kv_cache_bytes".into()));
        }
        let max_model_len = effective_max_model_len(cfg.max_model_len, parts.model_max_len, &*parts.backend)?;
        let info = ModelInfo {
            served_model_name: cfg.served_model_name.clone(),
            max_model_len,
            vocab_size: parts.codec.vocab_size(),
            eos_ids: parts.eos_ids.clone(),
            block_size,
            num_kv_blocks: num_blocks,
            kv_bytes_per_token: parts.backend.kv_bytes_per_token(),
            backend: parts.backend.name(),
            prefix_caching: cfg.enable_prefix_caching,
            cache_namespace: cfg.cache_namespace,
        };
        let pool = BlockPool::new(num_blocks);
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs.max(1),
            max_num_batched_tokens: cfg.max_num_batched_tokens.max(1),
            block_size,
        };
        let stats = Arc::new(StatsRecorder::with_control(parts.control.clone()));
        let threads = cfg
            .engine_threads
            .filter(|n| *n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get));
        let compute = build_compute_pool(threads, &stats)?;
        let mut sched = Scheduler::new(sched_cfg, pool.clone());
        if cfg.enable_prefix_caching {
            sched = sched.with_prefix_caching(cfg.cache_namespace);
        }
        if let Some(w) = parts.backend.kv_sliding_window() {
            sched = sched.with_sliding_window(w);
        }
        let core = EngineCore::new(
            sched,
            parts.backend,
            parts.codec.clone(),
            &parts.eos_ids,
            max_model_len,
            stats.clone(),
            compute,
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("prism-engine".into())
            .spawn(move || core.run(rx))
            .map_err(|e| EngineError::Internal(format!("spawn engine thread: {e}")))?;
        tracing::info!(
            model = %info.served_model_name,
            backend = info.backend,
            max_model_len,
            num_blocks,
            block_size,
            compute_threads = threads,
            "engine started"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                tx: Mutex::new(Some(tx)),
                thread: Mutex::new(Some(thread)),
                stats,
                pool,
                codec: parts.codec,
                info,
                cfg,
                grammars: OnceLock::new(),
            }),
        })
    }

    /// Validates, tokenizes and enqueues a request (tokenization runs on the caller's
    /// thread: cheap for normal prompts).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (see `request` for the rules), `Overloaded` when
    /// `max_pending_requests` are in flight, `Unavailable` when the engine has stopped.
    pub fn submit(&self, req: EngineRequest) -> Result<OutputStream, EngineError> {
        let inner = &self.inner;
        if !self.is_alive() {
            return Err(EngineError::Unavailable("engine is not running".into()));
        }
        let sampling = req.params.validate()?;
        let cache_salt = check_cache_salt(req.cache_salt.as_deref())?;
        let codec = &inner.codec;
        let content_special = inner.cfg.chat_content_special_tokens;
        let prompt = prompt_ids_with(
            &req.prompt,
            |t, special| codec.encode(t, special),
            |m| {
                let vars =
                    ChatVars { tools: req.tools.as_deref(), template_kwargs: req.chat_template_kwargs.as_deref() };
                codec.encode_chat_with_vars(m, vars, content_special)
            },
        )?;
        check_token_ids(&prompt, inner.info.vocab_size, "prompt")?;
        check_token_ids(&req.prior_output_ids, inner.info.vocab_size, "prior_output_ids")?;
        if req.params.n > 1 && !req.prior_output_ids.is_empty() {
            return Err(EngineError::InvalidRequest {
                field: "prior_output_ids",
                message: "prior_output_ids require n = 1".into(),
            });
        }
        let max_new =
            check_lengths(prompt.len(), req.prior_output_ids.len(), req.params.max_tokens, inner.info.max_model_len)?;
        let logit_bias = check_logit_bias(&req.params.logit_bias, inner.info.vocab_size)?;
        // A stop id outside the vocabulary could never match: refused as `logit_bias` is.
        check_token_ids(&req.params.stop_token_ids, inner.info.vocab_size, "stop_token_ids")?;
        // Compiled here, on the caller's thread: the step thread never compiles a grammar.
        let grammar = match &req.params.structured {
            None => None,
            Some(spec) => {
                let compiler = self.grammar_compiler()?;
                let matcher = Box::new(compiler.compile(spec, &req.prior_output_ids)?);
                let field = crate::structured::field_of(spec);
                Some(crate::step_loop::NewGrammar { matcher, mask_eos: compiler.eos(), field })
            }
        };
        let in_flight = inner.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        if in_flight >= inner.cfg.max_pending_requests {
            inner.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err(EngineError::Overloaded(format!("{in_flight} requests in flight")));
        }
        let (tx, rx) = mpsc::channel(inner.cfg.output_buffer.max(1));
        let p = req.params;
        let new = NewRequest {
            id: req.id,
            prompt,
            prior: req.prior_output_ids,
            sampling,
            seed: p.seed,
            n: p.n,
            stop: p.stop,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            skip_special: p.skip_special_tokens,
            include_stop_str: p.include_stop_str_in_output,
            logit_bias,
            min_tokens: p.min_tokens as usize,
            grammar,
            max_new,
            deadline: req.deadline,
            arrival: Instant::now(),
            cache_salt,
            tx,
        };
        let sent = {
            let guard = inner.tx.lock().unwrap_or_else(PoisonError::into_inner);
            guard.as_ref().is_some_and(|t| t.send(Command::Submit(Box::new(new))).is_ok())
        };
        if !sent {
            inner.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err(EngineError::Unavailable("engine is shutting down".into()));
        }
        Ok(OutputStream { rx })
    }

    /// The model's grammar compiler, built on first use (the token trie and llguidance's
    /// lexer tables over the whole vocabulary).
    fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>, EngineError> {
        let inner = &self.inner;
        let built = inner.grammars.get_or_init(|| {
            let eos = inner.info.eos_ids.first().copied().unwrap_or(0);
            GrammarCompiler::new(inner.codec.clone(), eos).map(Arc::new)
        });
        built.clone().map_err(|e| EngineError::Internal(format!("structured outputs are unavailable: {e}")))
    }

    /// A snapshot of load, counters and latency histograms.
    pub fn stats(&self) -> EngineStats {
        self.inner.stats.snapshot(self.inner.pool.num_free(), self.inner.pool.num_blocks())
    }

    /// Most sequences the scheduler runs at once (`max_num_seqs`, at least 1): the batch
    /// limit routers size their admission from.
    pub fn max_num_seqs(&self) -> usize {
        self.inner.cfg.max_num_seqs.max(1)
    }

    /// Static model facts.
    pub fn model_info(&self) -> ModelInfo {
        self.inner.info.clone()
    }

    /// The tokenizer/chat codec (for callers that count tokens or render templates).
    pub fn codec(&self) -> Arc<dyn TextCodec> {
        self.inner.codec.clone()
    }

    /// The encoding half of the codec for routers (`None` for codecs that cannot be exported).
    pub fn codec_export(&self) -> Option<CodecExport> {
        let mut export = self.inner.codec.export()?;
        export.chat_content_special_tokens = self.inner.cfg.chat_content_special_tokens;
        Some(export)
    }

    /// Changes to the set of cached block hashes after sequence number `after` (0 = from the
    /// start: a snapshot). A reader too far behind gets a snapshot. Empty when prefix
    /// caching is off.
    pub fn prefix_cache_events(&self, after: u64) -> CacheEvents {
        if !self.inner.cfg.enable_prefix_caching {
            return CacheEvents::default();
        }
        self.inner.pool.events(after)
    }

    /// Why the step thread died, once it has after a failed step: the step's error (for a
    /// parallel replica, which rank exited or did not answer).
    pub fn failure(&self) -> Option<String> {
        self.inner.stats.failure()
    }

    /// Whether the step thread is running and its last step succeeded.
    pub fn is_alive(&self) -> bool {
        self.inner.stats.alive.load(Ordering::Relaxed)
            && self
                .inner
                .thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .is_some_and(|t| !t.is_finished())
    }

    /// Injects `fault` into the step thread (tests and chaos drills only).
    ///
    /// # Errors
    /// [`EngineError::Unavailable`] when the engine has already stopped.
    pub fn inject_fault(&self, fault: Fault) -> Result<(), EngineError> {
        let guard = self.inner.tx.lock().unwrap_or_else(PoisonError::into_inner);
        let sent = guard.as_ref().is_some_and(|t| t.send(Command::Fault(fault)).is_ok());
        if sent { Ok(()) } else { Err(EngineError::Unavailable("engine is not running".into())) }
    }

    /// Stops a failed replica's engine without waiting (callable from async code): a
    /// running forward pass ends at its next layer (CPU backend) or step boundary, every
    /// stream ends without a finish reason (callers retry or migrate), the step thread exits
    /// and the replica's compute threads with it. Later `submit`s get `Unavailable`.
    /// [`EngineHandle::shutdown`] afterwards only waits for the thread.
    pub fn stop(&self) {
        self.inner.stats.control.request_stop(StopKind::Fail);
        self.inner.stats.alive.store(false, Ordering::Relaxed);
        let tx = self.inner.tx.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(tx) = tx {
            // Wakes an idle step loop; it sees the stop request first.
            let _ = tx.send(Command::Shutdown);
        }
    }

    /// Whether the step thread has exited (after [`EngineHandle::stop`], a shutdown, or a
    /// backend failure). Its compute pool's threads exit right after it
    /// ([`EngineStats::compute_threads_alive`]).
    pub fn step_thread_finished(&self) -> bool {
        self.inner.thread.lock().unwrap_or_else(PoisonError::into_inner).as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Aborts every request (finish_reason `abort`) and stops the step thread, waiting
    /// for it (never call from the step thread); a running forward pass is interrupted at
    /// its next layer (CPU backend). Later `submit`s get `Unavailable`.
    pub fn shutdown(&self) {
        self.inner.stats.control.request_stop(StopKind::Shutdown);
        let tx = self.inner.tx.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(tx) = tx {
            let _ = tx.send(Command::Shutdown);
        }
        let thread = self.inner.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(t) = thread
            && t.join().is_err()
        {
            tracing::error!("engine thread panicked");
        }
        self.inner.stats.alive.store(false, Ordering::Relaxed);
    }
}

/// Checks `logit_bias` token ids against the vocabulary (values were checked by
/// `SamplingParams::validate`); a token named twice keeps its last bias.
fn check_logit_bias(bias: &[(u32, f32)], vocab_size: usize) -> Result<Arc<[(u32, f32)]>, EngineError> {
    if let Some(&(bad, _)) = bias.iter().find(|(t, _)| *t as usize >= vocab_size) {
        return Err(EngineError::InvalidRequest {
            field: "logit_bias",
            message: format!("logit_bias names token {bad}, outside the vocabulary (size {vocab_size})"),
        });
    }
    // Reversed, then a stable sort: the first of each token is the last given.
    let mut unique: Vec<(u32, f32)> = bias.iter().rev().copied().collect();
    unique.sort_by_key(|&(t, _)| t);
    unique.dedup_by_key(|&mut (t, _)| t);
    Ok(unique.into())
}

/// Checks a request's `cache_salt`: not empty, at most [`MAX_CACHE_SALT_BYTES`] bytes.
fn check_cache_salt(salt: Option<&str>) -> Result<Option<Arc<str>>, EngineError> {
    match salt {
        None => Ok(None),
        Some("") => Err(EngineError::InvalidRequest {
            field: "cache_salt",
            message: "cache_salt must not be empty (omit it to share the cache)".into(),
        }),
        Some(s) if s.len() > MAX_CACHE_SALT_BYTES => Err(EngineError::InvalidRequest {
            field: "cache_salt",
            message: format!("cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, got {}", s.len()),
        }),
        Some(s) => Ok(Some(Arc::from(s))),
    }
}

/// The replica's compute pool: `threads` threads named `prism-compute-N`, counted live in
/// `stats.compute_threads` so tests and operators can see them exit.
fn build_compute_pool(threads: usize, stats: &Arc<StatsRecorder>) -> Result<rayon::ThreadPool, EngineError> {
    let (up, down) = (Arc::clone(stats), Arc::clone(stats));
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("prism-compute-{i}"))
        .start_handler(move |_| {
            up.compute_threads.fetch_add(1, Ordering::SeqCst);
        })
        .exit_handler(move |_| {
            down.compute_threads.fetch_sub(1, Ordering::SeqCst);
        })
        .build()
        .map_err(|e| EngineError::Internal(format!("build the engine's compute pool: {e}")))
}

/// The outputs of one request. Dropping it aborts the request at the next step
/// boundary (its KV blocks are freed). The stream ends after the output carrying
/// `usage`; a stream that ends without a `finish_reason` means the engine failed (the
/// request may be retried or migrated elsewhere).
#[derive(Debug)]
pub struct OutputStream {
    rx: mpsc::Receiver<EngineOutput>,
}

impl OutputStream {
    /// The next output, or `None` at the end.
    pub async fn recv(&mut self) -> Option<EngineOutput> {
        self.rx.recv().await
    }

    /// Blocking variant for non-async callers (benchmarks, tests); never call inside a
    /// tokio runtime thread.
    pub fn blocking_recv(&mut self) -> Option<EngineOutput> {
        self.rx.blocking_recv()
    }

    /// The underlying receiver (dropping it aborts just the same).
    pub fn into_inner(self) -> mpsc::Receiver<EngineOutput> {
        self.rx
    }
}

impl futures::Stream for OutputStream {
    type Item = EngineOutput;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<EngineOutput>> {
        self.rx.poll_recv(cx)
    }
}

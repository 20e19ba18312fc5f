//! What the router knows of each replica's prefix cache, for cache-aware routing
//! (`balance/prefix.rs`):
//!
//! - [`ReplicaCodec`]: the replica's prompt codec (`WorkerService.GetPromptCodec`: tokenizer,
//!   chat template) with its block size and hash namespace, shared by every replica with the
//!   same codec fingerprint (`prefix/codec.rs` fetches and builds them).
//! - [`ReplicaCache`]: per replica, that codec (none: the replica is routed by load alone)
//!   and its [`PrefixIndex`] (`prefix/index.rs`), kept current by `crate::prefix_watch`.
//! - [`PrefixKeys`]: one request's prompt token ids and chained block hashes
//!   (`prism_engine::kv_cache::prefix_hash::block_hashes`), computed once per distinct codec
//!   among the model's replicas, exactly as the replica's engine computes them
//!   (`PromptCodec::prompt_ids`), off the async runtime ([`prompt_keys`]).

pub mod codec;
pub mod index;

use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use prism_common::proto::v1::{GenerateRequest, generate_request};
use prism_engine::codec::{ChatVars, PromptCodec};
use prism_engine::kv_cache::prefix_hash::block_hashes;
use prism_engine::{ChatMessage, Prompt, ToolCall};

pub use index::PrefixIndex;

/// What makes two replicas' block hashes of one prompt equal: the tokenizer (codec
/// fingerprint), the block size and the hash namespace (the model identity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HashKey {
    /// `PromptCodec.fingerprint` (equal fingerprints, equal token ids).
    pub fingerprint: u64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// `PromptCodec.cache_namespace`.
    pub namespace: u64,
}

/// A replica's prompt codec as the router uses it.
#[derive(Debug)]
pub struct ReplicaCodec {
    /// Which hashes it gives.
    pub key: HashKey,
    /// The tokenizer and chat template (shared between replicas of one fingerprint).
    pub codec: Arc<PromptCodec>,
}

/// Per replica: its codec and prefix index (shared across route-table versions, like
/// `routes::ReplicaStats`).
#[derive(Debug, Default)]
pub struct ReplicaCache {
    codec: RwLock<Option<Arc<ReplicaCodec>>>,
    index: Mutex<PrefixIndex>,
}

impl ReplicaCache {
    /// The replica's codec; `None` while unknown (not fetched yet, the worker has none, or
    /// its engine caches no prefixes): the replica is routed by load alone.
    pub fn codec(&self) -> Option<Arc<ReplicaCodec>> {
        match self.codec.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Installs (or clears) the replica's codec.
    pub fn set_codec(&self, codec: Option<Arc<ReplicaCodec>>) {
        match self.codec.write() {
            Ok(mut g) => *g = codec,
            Err(p) => *p.into_inner() = codec,
        }
    }

    /// The replica's prefix index (held only for a lookup or an update).
    pub fn index(&self) -> MutexGuard<'_, PrefixIndex> {
        self.index.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Leading blocks of the request present on this replica; `None` when the request has no
    /// hashes for this replica's codec (or the replica has none).
    pub fn matched_blocks<'k>(&self, keys: &'k PrefixKeys, now: Instant) -> Option<(usize, &'k CodecKeys)> {
        let codec = self.codec()?;
        let k = keys.get(&codec.key)?;
        Some((self.index().matched(&k.hashes, now), k))
    }
}

/// The request as seen through one codec.
#[derive(Debug)]
pub struct CodecKeys {
    /// Which codec.
    pub key: HashKey,
    /// The prompt's token ids (what the engine will prefill).
    pub ids: Vec<u32>,
    /// Chained hashes of its full blocks.
    pub hashes: Vec<u64>,
}

/// One request's token ids and block hashes, per distinct codec of its model's replicas.
#[derive(Debug, Default)]
pub struct PrefixKeys {
    per_codec: Vec<CodecKeys>,
    /// Whether the router tokenized (text or chat): then the ids are worth forwarding.
    tokenized: bool,
}

impl PrefixKeys {
    /// Keys from their parts: the request under each codec, and whether the router
    /// tokenized it (text or chat) rather than receiving ids.
    pub fn new(per_codec: Vec<CodecKeys>, tokenized: bool) -> Self {
        Self { per_codec, tokenized }
    }

    /// The request under codec `key`.
    pub fn get(&self, key: &HashKey) -> Option<&CodecKeys> {
        self.per_codec.iter().find(|k| k.key == *key)
    }

    /// Prompt tokens under the first codec (all codecs of one fingerprint agree).
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.per_codec.first().map(|k| k.ids.len() as u64)
    }

    /// The token ids to forward to a replica whose codec has `fingerprint`
    /// (`WorkerGenerateRequest.prompt_token_ids`); `None` when the prompt was ids already or
    /// no codec of that fingerprint tokenized it.
    pub fn ids_for(&self, fingerprint: u64) -> Option<&[u32]> {
        if !self.tokenized {
            return None;
        }
        self.per_codec.iter().find(|k| k.key.fingerprint == fingerprint).map(|k| k.ids.as_slice())
    }
}

/// The engine's view of a proto prompt (as the worker converts it: `worker::service`).
fn engine_prompt(p: &generate_request::Prompt) -> Prompt {
    match p {
        generate_request::Prompt::Text(t) => Prompt::Text(t.clone()),
        generate_request::Prompt::TokenIds(t) => Prompt::TokenIds(t.ids.clone()),
        generate_request::Prompt::Chat(c) => Prompt::Chat(
            c.messages
                .iter()
                .map(|m| ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                    tool_calls: m
                        .tool_calls
                        .iter()
                        .map(|c| ToolCall { id: c.id.clone(), name: c.name.clone(), arguments: c.arguments.clone() })
                        .collect(),
                    tool_call_id: m.tool_call_id.clone(),
                    name: m.name.clone(),
                })
                .collect(),
        ),
    }
}

/// Token ids and hashes of `prompt` under each codec of `codecs` (distinct fingerprints are
/// tokenized once). A codec that fails on the prompt (a chat its template rejects) is left
/// out: the replica reports the error itself.
fn keys_blocking(prompt: &Prompt, vars: ChatVars<'_>, salt: Option<&str>, codecs: &[Arc<ReplicaCodec>]) -> PrefixKeys {
    let mut per_codec: Vec<CodecKeys> = Vec::new();
    let mut failed: Vec<u64> = Vec::new();
    for c in codecs {
        if per_codec.iter().any(|k| k.key == c.key) || failed.contains(&c.key.fingerprint) {
            continue;
        }
        let ids = match per_codec.iter().find(|k| k.key.fingerprint == c.key.fingerprint) {
            Some(k) => k.ids.clone(),
            None => match c.codec.prompt_ids_with_vars(prompt, vars) {
                Ok(ids) => ids,
                Err(e) => {
                    tracing::debug!(error = %e, "prompt not tokenized for routing; by load alone");
                    failed.push(c.key.fingerprint);
                    continue;
                }
            },
        };
        let hashes = block_hashes(c.key.namespace, salt, &ids, c.key.block_size as usize);
        per_codec.push(CodecKeys { key: c.key, ids, hashes });
    }
    PrefixKeys { per_codec, tokenized: !matches!(prompt, Prompt::TokenIds(_)) }
}

/// The request's [`PrefixKeys`] under `codecs` (the codecs of its model's replicas);
/// `None` without codecs or prompt. Text and chat prompts are tokenized on the blocking
/// pool (a long prompt takes milliseconds); token-id prompts are only hashed, in place.
pub async fn prompt_keys(req: &GenerateRequest, codecs: Vec<Arc<ReplicaCodec>>) -> Option<Arc<PrefixKeys>> {
    if codecs.is_empty() {
        return None;
    }
    let prompt = engine_prompt(req.prompt.as_ref()?);
    let salt = req.cache_salt.clone();
    // The tools and template variables the worker renders into a chat prompt
    // (`EngineRequest::tools`, `chat_template_kwargs`): the ids forwarded to a replica
    // (`ids_for`) replace its own tokenization, so they must be rendered with both.
    let tools = Some(req.tools_json.clone()).filter(|t| !t.is_empty());
    let kwargs = Some(req.chat_template_kwargs_json.clone()).filter(|k| !k.is_empty());
    if matches!(prompt, Prompt::TokenIds(_)) {
        return Some(Arc::new(keys_blocking(&prompt, ChatVars::default(), salt.as_deref(), &codecs)));
    }
    let keys = tokio::task::spawn_blocking(move || {
        let vars = ChatVars { tools: tools.as_deref(), template_kwargs: kwargs.as_deref() };
        keys_blocking(&prompt, vars, salt.as_deref(), &codecs)
    })
    .await
    .ok()?;
    Some(Arc::new(keys))
}

#[cfg(test)]
#[path = "prefix/tests.rs"]
pub(crate) mod tests;

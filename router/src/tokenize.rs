//! The model's prompt codec in the router (tokenizer and chat template, as its replicas
//! encode prompts), for `/tokenize`, `/detokenize`, their gRPC twins and `echo` on
//! completions: [`ModelCodecs`] takes it from a ready replica — the codec cache-aware routing
//! already holds, else one fetched with `WorkerService.GetPromptCodec` and kept per replica
//! (built once per fingerprint) — or, with no replica Ready (an autoscaled model at zero), the
//! last codec the router had for the model while the head's codec id for it is unchanged
//! (`routes::served`); [`tokenize`] / [`detokenize`] do the work, the same for HTTP and gRPC
//! (vLLM's request and response shapes).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use prism_engine::codec::PromptCodec;
use prism_engine::{ChatMessage, EngineError};
use tonic::Status;
use tonic::transport::Endpoint;

use crate::dispatch::DispatchError;
use crate::prefix::codec::{CodecCache, MAX_CODEC_BYTES};
use crate::routes::Routes;
use crate::validate::{CHAT_ROLES, Invalid};

/// Codecs by replica, fetched on demand.
pub struct ModelCodecs {
    routes: Routes,
    built: CodecCache,
    by_replica: Mutex<HashMap<String, Arc<PromptCodec>>>,
}

/// A model's codec and context length.
#[derive(Clone)]
pub struct ModelCodec {
    /// Tokenizer and chat template.
    pub codec: Arc<PromptCodec>,
    /// Largest context length of the model's replicas, else its deployment's configured one;
    /// 0 = unknown.
    pub max_model_len: u32,
}

impl ModelCodecs {
    /// Codecs of the models in `routes`.
    pub fn new(routes: Routes) -> Self {
        Self { routes, built: CodecCache::default(), by_replica: Mutex::new(HashMap::new()) }
    }

    /// The codec of `model`, from one of its Ready replicas, else the one kept for it while
    /// its codec id is unchanged (also for a model the head lists as unavailable: the codec
    /// is what its next replica loads).
    ///
    /// # Errors
    /// [`DispatchError::NoRouteTable`] (503) before the head's first table,
    /// [`DispatchError::UnknownModel`] (404) for a model no route lists,
    /// [`DispatchError::Unavailable`] (503 naming why, `Retry-After` by cause) for a model the
    /// head lists as unavailable (failed, scaled to 0, no node can run it) and
    /// [`DispatchError::NoReplica`] (503) when none of its replicas is Ready otherwise, both
    /// only with no codec kept; [`DispatchError::Worker`] (UNAVAILABLE, 503) when no replica
    /// gives its codec.
    pub async fn get(&self, model: &str) -> Result<ModelCodec, DispatchError> {
        let snap = self.routes.snapshot();
        if !snap.loaded {
            return Err(DispatchError::NoRouteTable);
        }
        let replicas = snap.models.get(model).ok_or_else(|| DispatchError::UnknownModel(model.to_owned()))?;
        let max_model_len = snap.max_model_len(model);
        let ready: Vec<_> = replicas.iter().filter(|r| r.is_ready()).collect();
        let kept = || self.routes.kept_codec(&snap, model).map(|codec| ModelCodec { codec, max_model_len });
        if ready.is_empty() {
            if let Some(k) = kept() {
                return Ok(k);
            }
            // A model no replica is coming to gets the answer its chat requests get.
            return Err(snap.unavailable(model).map_or_else(
                || DispatchError::NoReplica(model.to_owned()),
                |why| DispatchError::unavailable(model, &why),
            ));
        }
        {
            let mut by = self.by_replica.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // Replicas that left the table take their codec along.
            by.retain(|id, _| snap.models.values().flatten().any(|r| r.replica_id == *id));
            for r in &ready {
                let codec = r.cache.codec().map(|c| Arc::clone(&c.codec)).or_else(|| by.get(&r.replica_id).cloned());
                if let Some(codec) = codec {
                    self.routes.keep_codec(model, r.codec_id, &codec);
                    return Ok(ModelCodec { codec, max_model_len });
                }
            }
        }
        let mut last = String::from("no replica answered");
        for r in ready {
            let Ok(ep) = Endpoint::from_shared(r.endpoint.clone()) else { continue };
            let ch = prism_common::tls::client::channel_lazy(
                ep.connect_timeout(Duration::from_secs(2)).timeout(Duration::from_secs(30)),
            );
            let mut client = WorkerServiceClient::new(ch).max_decoding_message_size(MAX_CODEC_BYTES);
            match self.built.fetch_codec(&mut client, &r.replica_id).await {
                Ok(codec) => {
                    let mut by = self.by_replica.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    by.insert(r.replica_id.clone(), Arc::clone(&codec));
                    self.routes.keep_codec(model, r.codec_id, &codec);
                    return Ok(ModelCodec { codec, max_model_len });
                }
                Err(e) => {
                    tracing::debug!(replica = %r.replica_id, error = %e, "prompt codec not fetched");
                    last = e.to_string();
                }
            }
        }
        // Ready replicas that do not answer (stopping, unreachable): a codec kept under the
        // model's current codec id is the one its replicas load.
        kept().ok_or_else(|| {
            DispatchError::Worker(Status::unavailable(format!("the tokenizer of `{model}` is not available: {last}")))
        })
    }
}

/// What to tokenize.
#[derive(Debug, Clone)]
pub enum TokenizeInput {
    /// A completion prompt.
    Text(String),
    /// Chat messages, rendered through the model's template.
    Chat(Vec<ChatMessage>),
}

/// How to tokenize (vLLM's `/tokenize` fields).
#[derive(Debug, Clone, Default)]
pub struct TokenizeOptions {
    /// Chat: `chat_template_kwargs` as JSON object text, extra template variables (`None` =
    /// none; refused with a text input).
    pub template_kwargs: Option<String>,
    /// Text: add BOS when the model does (unset = true); chat: unset = false.
    pub add_special_tokens: Option<bool>,
    /// Chat: append the assistant turn header (unset = true; only true is supported).
    pub add_generation_prompt: Option<bool>,
    /// Also return each token's vocabulary string.
    pub return_token_strs: bool,
}

/// `/tokenize`'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Each token's vocabulary string, when asked for.
    pub token_strs: Option<Vec<String>>,
}

/// A rejected tokenize / detokenize request, or a failure of the tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// 400 / INVALID_ARGUMENT naming the field.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// The tokenizer failed (500 / INTERNAL).
    #[error("{0}")]
    Internal(String),
}

impl From<EngineError> for TokenizeError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidRequest { field, message } => Self::Invalid(Invalid { param: field, message }),
            e => Self::Internal(e.to_string()),
        }
    }
}

/// Tokenizes as the replicas do (vLLM's defaults: `add_special_tokens` true for text and
/// false for chat; `add_generation_prompt` true, and only true is supported, as on chat
/// completions).
///
/// # Errors
/// [`TokenizeError::Invalid`]: `messages` empty or with an unknown role, or rejected by the
/// template; `add_generation_prompt: false`; `chat_template_kwargs` with a text input, not a
/// JSON object, or naming a standard template variable.
pub fn tokenize(
    codec: &PromptCodec,
    input: &TokenizeInput,
    opts: &TokenizeOptions,
) -> Result<Tokenized, TokenizeError> {
    let add_special_tokens = opts.add_special_tokens;
    let tokens = match input {
        TokenizeInput::Text(_) if opts.template_kwargs.is_some() => {
            return Err(invalid("chat_template_kwargs", "chat_template_kwargs applies to chat messages only"));
        }
        TokenizeInput::Text(t) => codec.encode_text(t, add_special_tokens.unwrap_or(true))?,
        TokenizeInput::Chat(messages) => {
            if opts.add_generation_prompt == Some(false) {
                return Err(invalid("add_generation_prompt", "add_generation_prompt: false is not supported"));
            }
            if messages.is_empty() {
                return Err(invalid("messages", "messages must not be empty"));
            }
            if let Some(i) = messages.iter().position(|m| !CHAT_ROLES.contains(&m.role.as_str())) {
                return Err(invalid(
                    "messages",
                    format!("messages[{i}].role must be one of {}", CHAT_ROLES.join(", ")),
                ));
            }
            codec.encode_messages(messages, opts.template_kwargs.as_deref(), add_special_tokens.unwrap_or(false))?
        }
    };
    let token_strs = opts.return_token_strs.then(|| tokens.iter().map(|&t| codec.token_str(t)).collect());
    Ok(Tokenized { tokens, token_strs })
}

/// The text of `tokens` (special tokens' text kept, as vLLM's `/detokenize`).
///
/// # Errors
/// [`TokenizeError::Invalid`] (`tokens`) for an id outside the vocabulary.
pub fn detokenize(codec: &PromptCodec, tokens: &[u32]) -> Result<String, TokenizeError> {
    Ok(codec.decode(tokens, false)?)
}

fn invalid(param: &'static str, message: impl Into<String>) -> TokenizeError {
    TokenizeError::Invalid(Invalid { param, message: message.into() })
}

/// What `echo` puts before a completion's output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Echo {
    /// The prompt's text: a text prompt as given, token ids decoded (special tokens' text kept).
    pub text: String,
    /// Each prompt token's text, when logprobs are wanted (their logprobs are null: the engine
    /// computes none for prompt tokens).
    pub tokens: Vec<String>,
    /// Prompt tokens, when the codec was needed (`max_tokens: 0` answers without a replica).
    pub prompt_tokens: Option<u32>,
}

/// Why the prompt of an `echo` request could not be read.
#[derive(Debug, thiserror::Error)]
pub enum EchoError {
    /// The model's codec is not available (404 / 503).
    #[error(transparent)]
    Lookup(#[from] DispatchError),
    /// The prompt does not tokenize or decode.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
}

/// The echo of `req`'s prompt (text or token ids). The codec is fetched only when needed: for
/// token ids, for the prompt tokens' texts (`with_tokens`), or for the prompt's length
/// (`max_tokens: 0`).
///
/// # Errors
/// [`EchoError`]; a chat prompt is refused earlier (`validate::check_request`).
pub async fn echo_of(
    codecs: &ModelCodecs,
    req: &prism_common::proto::v1::GenerateRequest,
    with_tokens: bool,
) -> Result<Echo, EchoError> {
    use prism_common::proto::v1::generate_request::Prompt as P;
    let zero = req.sampling.as_ref().and_then(|s| s.max_tokens) == Some(0);
    let prompt = req.prompt.clone();
    if let Some(P::Text(t)) = &prompt
        && !with_tokens
        && !zero
    {
        return Ok(Echo { text: t.clone(), ..Echo::default() });
    }
    let codec = codecs.get(&req.model).await?.codec;
    let echo = tokio::task::spawn_blocking(move || -> Result<Echo, TokenizeError> {
        let (text, ids) = match prompt {
            Some(P::Text(t)) => {
                let ids = codec.encode_text(&t, true)?;
                (t, ids)
            }
            Some(P::TokenIds(t)) => (codec.decode(&t.ids, false).map_err(|e| prompt_field(e.into()))?, t.ids),
            _ => return Err(invalid("echo", "echo is supported on completion prompts (text or token ids) only")),
        };
        let tokens = if with_tokens {
            ids.iter().map(|&id| codec.decode(&[id], false)).collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        Ok(Echo { text, tokens, prompt_tokens: Some(u32::try_from(ids.len()).unwrap_or(u32::MAX)) })
    })
    .await
    .map_err(|e| TokenizeError::Internal(format!("tokenizer task failed: {e}")))??;
    Ok(echo)
}

/// An id outside the vocabulary in a prompt is the prompt's fault.
fn prompt_field(e: TokenizeError) -> TokenizeError {
    match e {
        TokenizeError::Invalid(i) => {
            TokenizeError::Invalid(Invalid { param: "prompt", message: i.message.replace("tokens[", "prompt[") })
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::prefix::{HashKey, ReplicaCodec};
    use prism_common::proto::v1::{ReplicaState, RouteEntry, RouteTable, ServedModel};

    /// A table of model `m` (codec id `codec_id`, configured length 1024) with the Ready
    /// replicas `ready`, each carrying `codec_id`.
    fn table(version: u64, codec_id: u64, ready: &[&str]) -> RouteTable {
        RouteTable {
            version,
            models: vec!["m".into()],
            served: vec![ServedModel { model: "m".into(), deployment: "d".into(), max_model_len: 1024, codec_id }],
            routes: ready
                .iter()
                .map(|id| RouteEntry {
                    replica_id: (*id).into(),
                    model: "m".into(),
                    endpoint: format!("http://{id}:1"),
                    state: ReplicaState::Ready as i32,
                    codec_id,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    /// The codec cache-aware routing fetched from a replica answers `/tokenize` once the
    /// replica has left (scaled to zero) while the model's codec id is unchanged; a new id
    /// (the engine config changed) leaves no known tokenizer: 503 as before.
    #[tokio::test]
    async fn a_model_at_zero_is_tokenized_with_the_codec_of_its_last_replica_until_its_spec_changes() {
        let routes = Routes::new(4, Metrics::new());
        let codecs = ModelCodecs::new(routes.clone());
        routes.apply(table(1, 7, &[]));
        assert!(matches!(codecs.get("m").await, Err(DispatchError::NoReplica(_))), "never had a replica");
        routes.apply(table(2, 7, &["r0"]));
        let codec = crate::prefix::tests::tiny_codec();
        let key = HashKey { fingerprint: 1, block_size: 16, namespace: 0 };
        routes.snapshot().models["m"][0].cache.set_codec(Some(Arc::new(ReplicaCodec { key, codec: codec.clone() })));
        routes.apply(table(3, 7, &[]));
        let at_zero = codecs.get("m").await.map_err(|e| e.to_string()).expect("the kept codec");
        assert!(Arc::ptr_eq(&at_zero.codec, &codec));
        assert_eq!(at_zero.max_model_len, 1024, "no replica: the configured length");
        let ids = tokenize(&at_zero.codec, &TokenizeInput::Text("a b c".into()), &TokenizeOptions::default());
        assert_eq!(ids.map(|t| t.tokens).map_err(|e| e.to_string()), Ok(vec![0, 1, 2]));
        routes.apply(table(4, 8, &[]));
        assert!(matches!(codecs.get("m").await, Err(DispatchError::NoReplica(_))), "a new spec: unknown");
        routes.apply(table(5, 7, &[]));
        assert!(codecs.get("m").await.is_err(), "a dropped codec is not revived by an old id");
    }
}

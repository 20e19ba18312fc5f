//! Fetching a replica's prompt codec (`WorkerService.GetPromptCodec`) and building it once
//! per fingerprint: replicas of one model share one tokenizer in the router's memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use prism_common::proto::v1::{GetPromptCodecRequest, PromptCodec as PbPromptCodec};
use prism_engine::codec::{CodecExport, PromptCodec};
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::{HashKey, ReplicaCodec};

/// Largest `PromptCodec` message accepted (a Llama 3 tokenizer.json is about 9 MB).
pub const MAX_CODEC_BYTES: usize = 64 * 1024 * 1024;

/// Why a replica has no codec in the router.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The worker has no `GetPromptCodec` (an older worker): routed by load alone.
    #[error("the worker does not serve prompt codecs")]
    Unimplemented,
    /// The replica's tokenizer cannot be exported (FAILED_PRECONDITION): routed by load alone.
    #[error("the replica's prompt codec cannot be exported")]
    NotExportable,
    /// The call failed (worker starting, unreachable, ...).
    #[error("GetPromptCodec failed: {0}")]
    Rpc(Status),
    /// The codec JSON does not parse or its tokenizer / template does not build.
    #[error("the replica's prompt codec does not load: {0}")]
    Invalid(String),
}

/// Codecs built so far, by fingerprint (weak: a codec no replica uses any more is freed).
#[derive(Debug, Default)]
pub struct CodecCache {
    built: Mutex<HashMap<u64, Weak<PromptCodec>>>,
}

impl CodecCache {
    fn cached(&self, fingerprint: u64) -> Option<Arc<PromptCodec>> {
        let mut built = self.built.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        built.retain(|_, w| w.strong_count() > 0);
        built.get(&fingerprint).and_then(Weak::upgrade)
    }

    fn insert(&self, fingerprint: u64, codec: &Arc<PromptCodec>) {
        let mut built = self.built.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        built.insert(fingerprint, Arc::downgrade(codec));
    }

    /// The codec of `replica_id` through `client`; `Ok(None)` when its engine caches no
    /// prefixes (nothing to route by). A fingerprint seen before reuses the built codec;
    /// a new one is parsed and built on the blocking pool (hundreds of milliseconds for a
    /// large vocabulary).
    ///
    /// # Errors
    /// [`CodecError`].
    pub async fn fetch(
        &self,
        client: &mut WorkerServiceClient<Channel>,
        replica_id: &str,
    ) -> Result<Option<Arc<ReplicaCodec>>, CodecError> {
        let msg = get(client, replica_id).await?;
        if !msg.prefix_caching || msg.block_size == 0 {
            return Ok(None);
        }
        let key = HashKey { fingerprint: msg.fingerprint, block_size: msg.block_size, namespace: msg.cache_namespace };
        let codec = self.build(msg).await?;
        Ok(Some(Arc::new(ReplicaCodec { key, codec })))
    }

    /// The tokenizer and chat template of `replica_id`, whether or not its engine caches
    /// prefixes (`/tokenize`, `/detokenize`, `echo`).
    ///
    /// # Errors
    /// [`CodecError`].
    pub async fn fetch_codec(
        &self,
        client: &mut WorkerServiceClient<Channel>,
        replica_id: &str,
    ) -> Result<Arc<PromptCodec>, CodecError> {
        self.build(get(client, replica_id).await?).await
    }

    /// The built codec of `msg`'s fingerprint, built now when new.
    async fn build(&self, msg: PbPromptCodec) -> Result<Arc<PromptCodec>, CodecError> {
        if let Some(c) = self.cached(msg.fingerprint) {
            return Ok(c);
        }
        let json = msg.codec_json;
        let built = tokio::task::spawn_blocking(move || {
            let export = CodecExport::from_json(&json).map_err(|e| CodecError::Invalid(e.to_string()))?;
            PromptCodec::from_export(&export).map_err(|e| CodecError::Invalid(e.to_string()))
        })
        .await
        .map_err(|e| CodecError::Invalid(e.to_string()))??;
        let c = Arc::new(built);
        self.insert(msg.fingerprint, &c);
        Ok(c)
    }
}

async fn get(client: &mut WorkerServiceClient<Channel>, replica_id: &str) -> Result<PbPromptCodec, CodecError> {
    Ok(client
        .get_prompt_codec(GetPromptCodecRequest { replica_id: replica_id.to_owned() })
        .await
        .map_err(|s| match s.code() {
            Code::Unimplemented => CodecError::Unimplemented,
            Code::FailedPrecondition => CodecError::NotExportable,
            _ => CodecError::Rpc(s),
        })?
        .into_inner())
}

//! What the head's table says of each served model from its deployment's spec
//! ([`ModelSettings`]: configured context length, codec id), and the last prompt codec
//! (tokenizer, chat template) the router had for each served model ([`KeptCodecs`]),
//! kept while the head's [`ModelSettings::codec_id`] for the model is unchanged, so
//! `/tokenize`, `/detokenize` and `echo` answer with no replica left (an autoscaled model at
//! zero), as vLLM's frontend tokenizes without its engine. A codec is kept only from a
//! replica whose route carries the model's current id (created for the deployment's current
//! spec), and dropped as soon as the id changes (a deploy that changes the engine config,
//! and with it maybe the model) or the model leaves the table. Not kept across router
//! restarts: until a replica is Ready again such a model's tokenizer is unknown (503).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use prism_engine::codec::PromptCodec;

/// What the head's table says of a served model from its deployment's spec
/// (`RouteTable.served`), known also while no replica serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSettings {
    /// The spec's `max_model_len`; 0 = not set (known once a replica reports it).
    pub max_model_len: u32,
    /// Identifies the prompt codec the deployment's next replica loads (never 0 from the
    /// head; 0 = unknown: static routes, a head that predates it).
    pub codec_id: u64,
}

/// Codecs by served model name, each with the codec id it was fetched under.
#[derive(Default)]
pub struct KeptCodecs {
    by_model: Mutex<HashMap<String, (u64, Arc<PromptCodec>)>>,
}

impl KeptCodecs {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, (u64, Arc<PromptCodec>)>> {
        self.by_model.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `codec`, fetched from a replica of `model` whose route carried `codec_id`; an id
    /// of 0 (a replica of an older spec, or a head that predates the ids) keeps nothing.
    pub fn keep(&self, model: &str, codec_id: u64, codec: &Arc<PromptCodec>) {
        if codec_id != 0 {
            self.lock().insert(model.to_owned(), (codec_id, Arc::clone(codec)));
        }
    }

    /// Keeps the codecs listed replicas hold for cache-aware routing, as `(model, codec_id,
    /// codec)` (before they leave the table with their replica).
    pub fn keep_from<'a>(&self, replicas: impl IntoIterator<Item = (&'a str, u64, Option<Arc<PromptCodec>>)>) {
        for (model, codec_id, codec) in replicas {
            if let Some(c) = codec {
                self.keep(model, codec_id, &c);
            }
        }
    }

    /// Forgets the codecs of models whose codec id in `served` (a new table) is not the one
    /// they were kept under, or that it no longer lists.
    pub fn retain_current(&self, served: &BTreeMap<String, ModelSettings>) {
        self.lock().retain(|model, (id, _)| served.get(model).is_some_and(|s| s.codec_id == *id));
    }

    /// The codec kept for `model` when it was kept under `codec_id` (the model's id in the
    /// table in use); `None` for an id of 0.
    pub fn get(&self, model: &str, codec_id: u64) -> Option<Arc<PromptCodec>> {
        let by_model = self.lock();
        by_model.get(model).filter(|(id, _)| codec_id != 0 && *id == codec_id).map(|(_, c)| Arc::clone(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(id: u64) -> BTreeMap<String, ModelSettings> {
        BTreeMap::from([("m".to_owned(), ModelSettings { max_model_len: 0, codec_id: id })])
    }

    /// Kept under the id it came with, given back only for that id, dropped when the id
    /// changes or the model leaves; a replica without an id keeps nothing.
    #[test]
    fn a_codec_is_kept_while_the_models_codec_id_is_unchanged() {
        let kept = KeptCodecs::default();
        let c = crate::prefix::tests::tiny_codec();
        kept.keep("m", 0, &c);
        assert!(kept.get("m", 0).is_none(), "no id: nothing known about the next replica");
        kept.keep("m", 7, &c);
        assert!(kept.get("m", 7).is_some_and(|k| Arc::ptr_eq(&k, &c)));
        assert!(kept.get("m", 8).is_none(), "another spec may load another tokenizer");
        assert!(kept.get("other", 7).is_none());
        kept.retain_current(&served(7));
        assert!(kept.get("m", 7).is_some(), "same id: kept");
        kept.retain_current(&served(8));
        assert!(kept.get("m", 7).is_none(), "a new id drops it");
        kept.keep("m", 8, &c);
        kept.retain_current(&BTreeMap::new());
        assert!(kept.get("m", 8).is_none(), "a model no longer listed drops it");
    }
}

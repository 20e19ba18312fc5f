//! What a router's `/tokenize`, `/detokenize` and `echo` need from a [`PromptCodec`]:
//! encoding with the caller's choice of special tokens, decoding ids, and token strings.

use super::PromptCodec;
use crate::request::{ChatMessage, EngineError, Prompt};

impl PromptCodec {
    /// Ids the model's tokenizer knows (valid ids are `0..vocab_size`).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Token ids of a completion prompt; `add_special_tokens` adds BOS when the model does
    /// (special-token text is parsed either way, as for completion prompts).
    ///
    /// # Errors
    /// [`EngineError::Internal`] when the tokenizer fails.
    pub fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        super::encode_with(&self.tokenizer, self.add_bos, self.bos_id, text, add_special_tokens)
    }

    /// Token ids of a chat prompt as the replica computes them (generation prompt appended);
    /// `add_special_tokens` also puts BOS first when the model adds one and the template did
    /// not print it. `template_kwargs`: the request's `chat_template_kwargs` (JSON object
    /// text), extra template variables.
    ///
    /// # Errors
    /// What [`PromptCodec::prompt_ids_with_vars`] returns for chat.
    pub fn encode_messages(
        &self,
        messages: &[ChatMessage],
        template_kwargs: Option<&str>,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, EngineError> {
        let vars = super::ChatVars { tools: None, template_kwargs };
        let mut ids = self.prompt_ids_with_vars(&Prompt::Chat(messages.to_vec()), vars)?;
        if add_special_tokens
            && self.add_bos
            && let Some(bos) = self.bos_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// The text of `ids` (special tokens' text kept unless `skip_special_tokens`).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `tokens`) for an id outside the vocabulary,
    /// [`EngineError::Internal`] when the tokenizer fails.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, EngineError> {
        let vocab = self.vocab_size();
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
            return Err(EngineError::InvalidRequest {
                field: "tokens",
                message: format!("tokens[{i}] = {id} is not below the vocabulary size {vocab}"),
            });
        }
        self.tokenizer.decode(ids, skip_special_tokens).map_err(|e| EngineError::Internal(format!("tokenizer: {e}")))
    }

    /// The vocabulary's string of a token (`Ġhello` in byte-level BPE: vLLM's `token_strs`);
    /// empty for an id outside the vocabulary.
    pub fn token_str(&self, id: u32) -> String {
        self.tokenizer.id_to_token(id).unwrap_or_default()
    }
}

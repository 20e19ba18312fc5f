//! The gRPC transport (`--backend grpc`): the router's `prism.v1.InferenceService/Generate`
//! server stream on one HTTP/2 channel shared by every request. A message of choice 0 with
//! token ids is a token arrival; the last message's `usage` gives the exact counts
//! (`cached_tokens` included: a proto3 scalar, so a router without prefix caching reports 0, not
//! absence). Errors count as `grpc CODE` (`grpc ResourceExhausted` is the router's 429).

use super::stream::{RequestOptions, Timeline};
use crate::bench::dataset::{BenchRequest, Prompt};
use crate::bench::stats::{Failure, Record};
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{ChatMessage, ChatMessages, GenerateRequest, SamplingParams, TokenIds, generate_request};
use tonic::transport::Channel;

fn failure(status: &tonic::Status) -> Failure {
    Failure { status: format!("grpc {:?}", status.code()), message: status.message().to_owned() }
}

/// The proto request for `req`.
pub fn request(opts: &RequestOptions, req: &BenchRequest) -> GenerateRequest {
    let prompt = match &req.prompt {
        Prompt::TokenIds(ids) => generate_request::Prompt::TokenIds(TokenIds { ids: ids.clone() }),
        Prompt::Text(t) => generate_request::Prompt::Text(t.clone()),
        Prompt::Chat(m) => generate_request::Prompt::Chat(ChatMessages {
            messages: m
                .iter()
                .map(|m| ChatMessage { role: m.role.clone(), content: m.content.clone(), ..Default::default() })
                .collect(),
        }),
    };
    GenerateRequest {
        model: opts.model.clone(),
        prompt: Some(prompt),
        sampling: Some(SamplingParams {
            temperature: Some(opts.temperature),
            max_tokens: Some(i64::from(req.output_len)),
            ignore_eos: opts.ignore_eos,
            ..SamplingParams::default()
        }),
        ..GenerateRequest::default()
    }
}

/// Sends one request on `client` and times its stream.
///
/// # Errors
/// A [`Failure`] with the gRPC code, before or during the stream.
pub async fn send(
    client: &InferenceServiceClient<Channel>,
    opts: &RequestOptions,
    req: &BenchRequest,
) -> Result<Record, Failure> {
    let mut call = tonic::Request::new(request(opts, req));
    if let Some(key) = &opts.api_key {
        let v = format!("Bearer {key}").parse().map_err(|_| Failure {
            status: "config".into(),
            message: "--api-key holds characters not allowed in metadata".into(),
        })?;
        call.metadata_mut().insert("authorization", v);
    }
    let mut client = client.clone();
    let mut timeline = Timeline::start();
    let mut stream = client.generate(call).await.map_err(|s| failure(&s))?.into_inner();
    let (mut tokens, mut usage) = (0usize, None);
    while let Some(message) = stream.message().await.map_err(|s| failure(&s))? {
        if message.usage.is_some() {
            usage = message.usage;
        }
        if message.index == 0 && !message.token_ids.is_empty() {
            timeline.token_chunk();
            tokens += message.token_ids.len();
        }
    }
    let prompt_tokens = usage.map_or(req.prompt_len, |u| u.prompt_tokens as usize);
    let mut record = timeline.finish(prompt_tokens, Some(usage.map_or(tokens, |u| u.completion_tokens as usize)));
    record.cached_tokens = usage.map(|u| u.cached_tokens as usize);
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_and_sampling() {
        let opts = RequestOptions { model: "m".into(), temperature: 0.0, ignore_eos: true, api_key: None };
        let r = request(&opts, &BenchRequest { prompt: Prompt::TokenIds(vec![1, 2]), prompt_len: 2, output_len: 8 });
        assert_eq!(r.model, "m");
        assert_eq!(r.prompt, Some(generate_request::Prompt::TokenIds(TokenIds { ids: vec![1, 2] })));
        let s = r.sampling.unwrap();
        assert_eq!((s.max_tokens, s.ignore_eos, s.temperature), (Some(8), true, Some(0.0)));
    }
}

//! `prism generate "PROMPT"`: streams one answer from a router over gRPC
//! (`InferenceService.Generate`), printing text as it arrives. Also the streaming helper
//! shared by `prism chat`, `prism up --prompt` and `prism bench`.

use crate::client::{self, ModelArg, router_status_error};
use anyhow::{Context, Result};
use clap::Args;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{
    ChatMessage, ChatMessages, FinishReason, GenerateRequest, SamplingParams, Usage, generate_request::Prompt,
};
use std::io::Write;
use tonic::transport::Channel;

/// Sampling flags (vLLM's `SamplingParams` names); unset flags take the engine's defaults.
#[derive(Args, Clone, Debug, Default)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(long, env = "PRISM_TEMPERATURE")]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability sums to this (0, 1].
    #[arg(long, env = "PRISM_TOP_P")]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens (-1 = disabled).
    #[arg(long, env = "PRISM_TOP_K", allow_hyphen_values = true)]
    pub top_k: Option<i32>,
    /// Maximum number of new tokens (default: until EOS or the context limit).
    #[arg(long, env = "PRISM_MAX_TOKENS")]
    pub max_tokens: Option<i64>,
    /// Random seed, for reproducible sampling.
    #[arg(long, env = "PRISM_SEED")]
    pub seed: Option<u64>,
    /// Stop string (repeat the flag for several; a comma is an ordinary character, so `--stop ,`
    /// stops at a comma); never part of the output.
    #[arg(long = "stop", env = "PRISM_STOP")]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    /// The request's `SamplingParams` (special tokens skipped from text, as vLLM does).
    pub fn to_proto(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_tokens: self.max_tokens,
            seed: self.seed,
            stop: self.stop.clone(),
            skip_special_tokens: Some(true),
            ..SamplingParams::default()
        }
    }
}

/// `prism generate` flags.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The prompt. By default it is sent as one user message through the model's chat template.
    pub prompt: String,
    /// `--model`: the served model to ask.
    #[command(flatten)]
    pub model: ModelArg,
    /// Send the prompt as raw text (plain completion, no chat template).
    #[arg(long, env = "PRISM_RAW")]
    pub raw: bool,
    /// Print token counts and the finish reason to stderr at the end.
    #[arg(long, short = 'v', env = "PRISM_VERBOSE")]
    pub verbose: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// `--api-key`: for a router that requires one.
    #[command(flatten)]
    pub key: client::KeyArg,
}

/// What one streamed generation produced.
#[derive(Debug, Default, Clone)]
pub struct Generation {
    /// The concatenated text deltas.
    pub text: String,
    /// Number of generated tokens seen in the stream.
    pub tokens: usize,
    /// The finish reason of choice 0.
    pub finish_reason: Option<FinishReason>,
    /// Usage from the last message, when the server sent it.
    pub usage: Option<Usage>,
    /// Time from sending to the first token.
    pub ttft: Option<std::time::Duration>,
}

/// Runs `prism generate`.
///
/// # Errors
/// Fails when the router is unreachable, rejects the request, or the stream breaks.
pub async fn run(router: &client::RouterTarget, args: GenerateArgs) -> Result<()> {
    let mut client = client::router(router).await?;
    let model = args.model.resolve(&mut client, &args.key).await?;
    let prompt = if args.raw {
        Prompt::Text(args.prompt)
    } else {
        Prompt::Chat(ChatMessages {
            messages: vec![ChatMessage { role: "user".into(), content: args.prompt, ..Default::default() }],
        })
    };
    let request = GenerateRequest {
        model,
        prompt: Some(prompt),
        sampling: Some(args.sampling.to_proto()),
        ..GenerateRequest::default()
    };
    let mut stdout = std::io::stdout();
    let generation = stream(&mut client, args.key.request(request)?, &mut stdout).await?;
    writeln!(stdout)?;
    if args.verbose {
        print_summary(&generation);
    }
    Ok(())
}

/// Prints token counts, TTFT and finish reason to stderr.
pub fn print_summary(g: &Generation) {
    let reason = g.finish_reason.map_or("none", |r| match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
        FinishReason::Unspecified => "none",
    });
    let (prompt, completion, cached) =
        g.usage.map_or((0, g.tokens as u32, 0), |u| (u.prompt_tokens, u.completion_tokens, u.cached_tokens));
    let ttft = g.ttft.map_or_else(|| "-".to_owned(), |t| format!("{:.0} ms", t.as_secs_f64() * 1e3));
    let tokens = |n: u32| prism_common::text::count(u64::from(n), "token", "tokens");
    eprintln!(
        "[prompt {} ({cached} from the prefix cache), completion {}, TTFT {ttft}, finish_reason {reason}]",
        tokens(prompt),
        tokens(completion)
    );
}

/// Sends `request` (a `GenerateRequest`, or a `tonic::Request` of one carrying metadata such
/// as an API key) and writes choice 0's text to `out` as it arrives (flushed per message).
///
/// # Errors
/// Fails on a gRPC error before or during the stream, or when writing fails.
pub async fn stream(
    client: &mut InferenceServiceClient<Channel>,
    request: impl tonic::IntoRequest<GenerateRequest>,
    out: &mut (dyn Write + Send),
) -> Result<Generation> {
    let started = std::time::Instant::now();
    let mut responses = client.generate(request).await.map_err(router_status_error)?.into_inner();
    let mut generation = Generation::default();
    while let Some(message) = responses.message().await.map_err(router_status_error).context("stream broken")? {
        if message.index != 0 {
            continue;
        }
        if generation.ttft.is_none() && !message.token_ids.is_empty() {
            generation.ttft = Some(started.elapsed());
        }
        generation.tokens += message.token_ids.len();
        if !message.text.is_empty() {
            out.write_all(message.text.as_bytes())?;
            out.flush()?;
            generation.text.push_str(&message.text);
        }
        let reason = FinishReason::try_from(message.finish_reason).unwrap_or(FinishReason::Unspecified);
        if reason != FinishReason::Unspecified {
            generation.finish_reason = Some(reason);
        }
        if message.usage.is_some() {
            generation.usage = message.usage;
        }
    }
    Ok(generation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_flags_map_to_vllm_fields() {
        let args = SamplingArgs {
            temperature: Some(0.0),
            top_k: Some(-1),
            max_tokens: Some(32),
            stop: vec!["\n".into()],
            ..SamplingArgs::default()
        };
        let p = args.to_proto();
        assert_eq!(p.temperature, Some(0.0));
        assert_eq!(p.top_k, Some(-1));
        assert_eq!(p.max_tokens, Some(32));
        assert_eq!(p.top_p, None);
        assert_eq!(p.stop, vec!["\n".to_owned()]);
        assert_eq!(p.skip_special_tokens, Some(true));
    }

    #[test]
    fn stop_strings_are_taken_whole_commas_included() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            sampling: SamplingArgs,
        }
        let cli = <Cli as clap::Parser>::try_parse_from(["prism", "--stop", ",", "--stop", "a,b"]).unwrap();
        assert_eq!(cli.sampling.stop, vec![",".to_owned(), "a,b".to_owned()]);
    }

    #[test]
    fn an_auth_failure_names_the_credential_of_the_service_asked() {
        let denied = || tonic::Status::unauthenticated("missing or invalid API key");
        let router = client::router_status_error(denied()).to_string();
        assert!(router.contains("--api-key") && !router.contains("--token"), "{router}");
        let head = client::status_error(denied()).to_string();
        assert!(head.contains("--token") && !head.contains("--api-key"), "{head}");
        let other = client::router_status_error(tonic::Status::invalid_argument("bad")).to_string();
        assert_eq!(other, "invalid request: bad");
    }
}

//! How `prism bench serve` reaches the server: [`Backend`] names the API (vLLM's
//! `--backend` values where they exist), [`Client`] sends one [`BenchRequest`] and returns
//! its [`Record`] or [`Failure`]. `grpc` talks to the router's gRPC address (`--router`, as
//! every `prism` client command), `openai` / `openai-chat` to `--base-url`.

pub mod grpc;
pub mod http;
pub mod stream;

use crate::bench::dataset::{BenchRequest, Prompt};
use crate::bench::stats::{Failure, Record};
use crate::client::{self, ModelArg};
use anyhow::Result;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use stream::RequestOptions;
use tonic::transport::Channel;

/// The API a run loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// OpenAI completions over HTTP (`/v1/completions`, streamed).
    Openai,
    /// OpenAI chat completions over HTTP (`/v1/chat/completions`, streamed).
    OpenaiChat,
    /// The router's gRPC `prism.v1.InferenceService/Generate`.
    Grpc,
}

impl Backend {
    /// The name used on the command line and in the result file.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Openai => "openai",
            Backend::OpenaiChat => "openai-chat",
            Backend::Grpc => "grpc",
        }
    }

    /// The HTTP path requests go to by default.
    pub fn default_endpoint(self) -> &'static str {
        match self {
            Backend::OpenaiChat => "/v1/chat/completions",
            Backend::Openai | Backend::Grpc => "/v1/completions",
        }
    }

    /// Whether this API can carry `prompt`.
    ///
    /// # Errors
    /// What to use instead.
    pub fn accepts(self, prompt: &Prompt) -> Result<(), &'static str> {
        match (self, prompt) {
            (Backend::Openai, Prompt::Chat(_)) => {
                Err("this dataset sends chat messages: use --backend openai-chat or grpc")
            }
            (Backend::OpenaiChat, Prompt::TokenIds(_)) => {
                Err("this dataset sends token ids: use --backend openai or grpc")
            }
            _ => Ok(()),
        }
    }
}

/// Where to send, from the flags.
#[derive(Debug, Clone)]
pub struct Target {
    /// The API.
    pub backend: Backend,
    /// Router gRPC address (`grpc`).
    pub router: client::RouterTarget,
    /// HTTP base URL (`openai`, `openai-chat`).
    pub base_url: String,
    /// HTTP path; `None` = [`Backend::default_endpoint`].
    pub endpoint: Option<String>,
    /// Bearer key.
    pub api_key: Option<String>,
}

/// A connected client.
#[derive(Debug, Clone)]
pub enum Client {
    /// gRPC channel to the router, and the API key its model lookup sends.
    Grpc(InferenceServiceClient<Channel>, client::KeyArg),
    /// OpenAI HTTP client.
    Http(http::HttpClient),
}

impl Client {
    /// Connects (gRPC) or builds the HTTP client.
    ///
    /// # Errors
    /// An invalid address, or a router that does not answer within 5 s.
    pub async fn connect(t: &Target) -> Result<Self> {
        Ok(match t.backend {
            Backend::Grpc => {
                Client::Grpc(client::router(&t.router).await?, client::KeyArg { api_key: t.api_key.clone() })
            }
            b => {
                let endpoint = t.endpoint.as_deref().unwrap_or(b.default_endpoint());
                let base = client::normalize(&t.base_url);
                Client::Http(http::HttpClient::new(&base, endpoint, b == Backend::OpenaiChat, t.api_key.as_deref())?)
            }
        })
    }

    /// `--model`, or the server's only model.
    ///
    /// # Errors
    /// No model served, several and none named, or the server unreachable.
    pub async fn resolve_model(&self, model: ModelArg) -> Result<String> {
        match self {
            Client::Grpc(c, key) => model.resolve(&mut c.clone(), key).await,
            Client::Http(h) => {
                if let Some(name) = model.name {
                    return Ok(name);
                }
                match h.models().await?.as_slice() {
                    [] => anyhow::bail!("the server serves no model yet"),
                    [one] => Ok(one.clone()),
                    many => {
                        anyhow::bail!("the server serves several models ({}); pick one with --model", many.join(", "))
                    }
                }
            }
        }
    }

    /// Sends one request.
    ///
    /// # Errors
    /// The request's [`Failure`].
    pub async fn send(&self, opts: &RequestOptions, req: &BenchRequest) -> Result<Record, Failure> {
        match self {
            Client::Grpc(c, _) => grpc::send(c, opts, req).await,
            Client::Http(h) => h.send(opts, req).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_each_backend_takes() {
        let ids = Prompt::TokenIds(vec![1]);
        let chat = Prompt::Chat(vec![]);
        let text = Prompt::Text("x".into());
        assert!(Backend::Openai.accepts(&ids).is_ok() && Backend::Openai.accepts(&text).is_ok());
        assert!(Backend::Openai.accepts(&chat).is_err());
        assert!(Backend::OpenaiChat.accepts(&ids).is_err());
        assert!(Backend::OpenaiChat.accepts(&chat).is_ok() && Backend::OpenaiChat.accepts(&text).is_ok());
        assert!([ids, chat, text].iter().all(|p| Backend::Grpc.accepts(p).is_ok()));
    }
}

//! The smaller OpenAI / vLLM request fields and routes, end to end through one `prism up`
//! child process serving the bundled model with an API key (one process for every check,
//! the suite running on two cores):
//!
//! - `/tokenize` (text and chat) and `/detokenize` over HTTP and gRPC give exactly the ids and
//!   text of the engine's own codec; unknown model → 404, an id outside the vocabulary → 400
//!   `tokens`, no key → 401; `chat_template_kwargs` is accepted on `/tokenize` and chat
//!   completions, one naming a standard template variable → 400;
//! - `echo` on `/v1/completions` (text and token-id prompts, streamed and not, with logprobs,
//!   with `max_tokens: 0`) and `GenerateRequest.echo` on gRPC: the prompt's text precedes the
//!   greedy output that the same request without echo returns;
//! - `include_stop_str_in_output` keeps a stop string taken from the greedy output, streamed
//!   and not; `"<|im_end|>"` as a stop string stops at that special token with `ignore_eos`,
//!   although `skip_special_tokens` hides it from the text; the EOS token that ends a turn
//!   shows its text with `include_stop_str_in_output` and `skip_special_tokens: false`;
//! - `max_completion_tokens` wins over `max_tokens`; completions without `max_tokens` stop
//!   at 16 tokens; `logit_bias` and `min_tokens` out of range are 400s naming the field.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use prism_common::proto::v1 as pb;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_engine::ChatMessage;
use prism_engine::codec::{ModelCodec, TextCodec};
use prism_engine::model::gguf::{GgufFile, GgufValue};
use prism_engine::model::{ChatTemplate, Tokenizer};
use prism_tests::{PrismUp, model};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

const KEY: &str = "sk-extras-0b6f3c";
const MODEL: &str = "SmolLM2-135M-Instruct";
const PROMPT: &str = "The capital of France is";

fn codec(path: &Path) -> Result<ModelCodec> {
    let file = GgufFile::open(path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let src = file.get("tokenizer.chat_template").and_then(GgufValue::as_str).context("chat template")?;
    let chat_template = Some(ChatTemplate::new(src, tokenizer.bos_text(), tokenizer.eos_text())?);
    Ok(ModelCodec { tokenizer, chat_template })
}

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    async fn post(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        let r = self.http.post(format!("{}{path}", self.base)).bearer_auth(KEY).json(body).send().await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await?))
    }

    async fn ok(&self, path: &str, body: &Value) -> Result<Value> {
        let (status, v) = self.post(path, body).await?;
        ensure!(status == 200, "{path} {body}: {status} {v}");
        Ok(v)
    }

    /// A 400 (or other `status`) naming `param`.
    async fn refused(&self, path: &str, body: &Value, status: u16, param: &str) -> Result<Value> {
        let (got, v) = self.post(path, body).await?;
        ensure!(got == status && v["error"]["param"] == param, "{path} {body}: {got} {v}, wanted {status} {param}");
        Ok(v)
    }

    /// Streamed completion chunks' choices (`data: [DONE]` last).
    async fn stream(&self, path: &str, body: &Value) -> Result<Vec<Value>> {
        let r = self.http.post(format!("{}{path}", self.base)).bearer_auth(KEY).json(body).send().await?;
        ensure!(r.status().as_u16() == 200, "stream {body}: {}", r.status());
        let text = r.text().await?;
        let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
        ensure!(events.last() == Some(&"[DONE]"), "no [DONE]: {text}");
        events[..events.len() - 1].iter().map(|e| Ok(serde_json::from_str(e)?)).collect()
    }
}

/// A gRPC request carrying the API key.
fn req<T>(m: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(m);
    r.metadata_mut().insert("authorization", format!("Bearer {KEY}").parse().expect("header"));
    r
}

fn completion(extra: Value) -> Value {
    let mut v = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": true});
    for (k, x) in extra.as_object().into_iter().flatten() {
        v[k] = x.clone();
    }
    v
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap_or_default().to_owned()
}

async fn tokenize_routes(api: &Api, codec: &ModelCodec, grpc: &str) -> Result<()> {
    let ids = codec.encode(PROMPT, true)?;
    let v = api.ok("/tokenize", &json!({"model": MODEL, "prompt": PROMPT})).await?;
    assert_eq!(v["tokens"], json!(ids));
    assert_eq!(v["count"], ids.len());
    assert!(v["max_model_len"].as_u64().unwrap_or(0) > 0, "{v}");
    assert!(v.get("token_strs").is_none(), "token_strs only when asked: {v}");
    let v = api.ok("/tokenize", &json!({"model": MODEL, "prompt": PROMPT, "return_token_strs": true})).await?;
    let strs: Vec<String> = ids.iter().map(|&i| codec.tokenizer.inner().id_to_token(i).unwrap_or_default()).collect();
    assert_eq!(v["token_strs"], json!(strs));
    // Chat: the ids the replica prefills for the same messages.
    let msgs = vec![ChatMessage { role: "user".into(), content: "Hi <|im_end|> there".into(), ..Default::default() }];
    let chat_ids = codec.encode_chat(&msgs, false)?;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi <|im_end|> there"}]});
    let v = api.ok("/tokenize", &body).await?;
    assert_eq!(v["tokens"], json!(chat_ids));
    let (_, usage) = api
        .post("/v1/chat/completions", &json!({"model": MODEL, "messages": body["messages"], "max_tokens": 1}))
        .await?;
    assert_eq!(usage["usage"]["prompt_tokens"], chat_ids.len(), "the count a chat request reports");
    // chat_template_kwargs reach the template as extra variables; SmolLM2's reads none of them,
    // so the prompt is unchanged. One naming a standard variable is refused.
    let kwargs = json!({"enable_thinking": false});
    let with_kwargs = json!({"model": MODEL, "messages": body["messages"], "chat_template_kwargs": kwargs});
    assert_eq!(api.ok("/tokenize", &with_kwargs).await?["tokens"], json!(chat_ids));
    let v = api
        .ok(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": body["messages"], "max_tokens": 1,
                                            "chat_template_kwargs": kwargs}),
        )
        .await?;
    assert_eq!(v["usage"]["prompt_tokens"], chat_ids.len(), "{v}");
    let forged = json!({"model": MODEL, "messages": body["messages"], "chat_template_kwargs": {"eos_token": "x"}});
    api.refused("/tokenize", &forged, 400, "chat_template_kwargs").await?;
    // Detokenize: the text back, special tokens' text kept.
    let v = api.ok("/detokenize", &json!({"model": MODEL, "tokens": ids})).await?;
    assert_eq!(v["prompt"], codec.tokenizer.decode(&ids, false));
    assert!(v["prompt"].as_str().is_some_and(|p| p.ends_with(PROMPT)), "{v}");
    let v = api.ok("/detokenize", &json!({"model": MODEL, "tokens": chat_ids})).await?;
    assert!(v["prompt"].as_str().unwrap_or_default().starts_with("<|im_start|>"), "{v}");
    // Errors.
    let vocab = codec.vocab_size();
    let e = api.refused("/detokenize", &json!({"model": MODEL, "tokens": [1, vocab]}), 400, "tokens").await?;
    assert!(e["error"]["message"].as_str().unwrap_or_default().contains(&vocab.to_string()), "{e}");
    api.refused("/tokenize", &json!({"model": "nope", "prompt": "x"}), 404, "model").await?;
    api.refused("/detokenize", &json!({"model": "nope", "tokens": [1]}), 404, "model").await?;
    api.refused("/tokenize", &json!({"model": MODEL}), 400, "prompt").await?;
    api.refused("/tokenize", &json!({"model": MODEL, "messages": []}), 400, "messages").await?;
    let r =
        api.http.post(format!("{}/tokenize", api.base)).json(&json!({"model": MODEL, "prompt": "x"})).send().await?;
    assert_eq!(r.status().as_u16(), 401, "the API key guards /tokenize");

    // gRPC twins.
    let mut g = InferenceServiceClient::connect(grpc.to_owned()).await?;
    let t = g
        .tokenize(req(pb::TokenizeRequest {
            model: MODEL.into(),
            input: Some(pb::tokenize_request::Input::Text(PROMPT.into())),
            return_token_strs: true,
            ..Default::default()
        }))
        .await?
        .into_inner();
    assert_eq!((t.tokens.clone(), t.count as usize, t.token_strs), (ids.clone(), ids.len(), strs));
    assert!(t.max_model_len > 0);
    let chat = pb::ChatMessages {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "Hi <|im_end|> there".into(),
            ..Default::default()
        }],
    };
    let t = g
        .tokenize(req(pb::TokenizeRequest {
            model: MODEL.into(),
            input: Some(pb::tokenize_request::Input::Chat(chat)),
            ..Default::default()
        }))
        .await?
        .into_inner();
    assert_eq!(t.tokens, chat_ids);
    let ids_again = ids.clone();
    let d = g.detokenize(req(pb::DetokenizeRequest { model: MODEL.into(), tokens: ids })).await?.into_inner();
    assert_eq!(d.prompt, codec.tokenizer.decode(&ids_again, false));
    let e = g.detokenize(req(pb::DetokenizeRequest { model: MODEL.into(), tokens: vec![vocab as u32] })).await;
    assert_eq!(e.map(|_| ()).map_err(|s| s.code()), Err(tonic::Code::InvalidArgument));
    let e = g.detokenize(req(pb::DetokenizeRequest { model: "nope".into(), tokens: vec![1] })).await;
    assert_eq!(e.map(|_| ()).map_err(|s| s.code()), Err(tonic::Code::NotFound));
    let e = g.detokenize(tonic::Request::new(pb::DetokenizeRequest { model: MODEL.into(), tokens: vec![1] })).await;
    assert_eq!(e.map(|_| ()).map_err(|s| s.code()), Err(tonic::Code::Unauthenticated));
    Ok(())
}

async fn echo(api: &Api, codec: &ModelCodec, grpc: &str) -> Result<()> {
    let plain = text(&api.ok("/v1/completions", &completion(json!({}))).await?);
    ensure!(!plain.is_empty(), "greedy output is empty");
    let v = api.ok("/v1/completions", &completion(json!({"echo": true}))).await?;
    assert_eq!(text(&v), format!("{PROMPT}{plain}"));
    // Token ids: decoded with the model's codec.
    let ids = codec.encode(PROMPT, true)?;
    let v = api.ok("/v1/completions", &completion(json!({"echo": true, "prompt": ids}))).await?;
    assert_eq!(text(&v), format!("{}{plain}", codec.tokenizer.decode(&ids, false)));
    // Streamed: the first chunk starts with the prompt; the deltas add up to the same text.
    let chunks = api.stream("/v1/completions", &completion(json!({"echo": true, "stream": true}))).await?;
    let first = chunks[0]["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(first.starts_with(PROMPT), "first chunk {first:?}");
    let joined: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(joined, format!("{PROMPT}{plain}"));
    // Logprobs: the prompt's tokens first, with null logprobs; offsets from the prompt's start.
    let v = api.ok("/v1/completions", &completion(json!({"echo": true, "logprobs": 1}))).await?;
    let lp = &v["choices"][0]["logprobs"];
    let n = ids.len();
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(n + 6), "{lp}");
    assert!(lp["token_logprobs"].as_array().is_some_and(|a| a[..n].iter().all(Value::is_null)));
    assert!(lp["token_logprobs"].as_array().is_some_and(|a| a[n..].iter().all(Value::is_f64)));
    let joined: String = lp["tokens"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    assert_eq!(joined, text(&v));
    assert_eq!(lp["text_offset"][n], PROMPT.len());
    // max_tokens 0: the prompt alone.
    let v = api.ok("/v1/completions", &completion(json!({"echo": true, "max_tokens": 0}))).await?;
    assert_eq!(text(&v), PROMPT);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        (v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()),
        (Some(n as u64), Some(0))
    );
    let chunks =
        api.stream("/v1/completions", &completion(json!({"echo": true, "max_tokens": 0, "stream": true}))).await?;
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0]["choices"][0]["text"], PROMPT);
    api.refused("/v1/completions", &completion(json!({"max_tokens": 0})), 400, "max_tokens").await?;
    api.refused("/v1/completions", &completion(json!({"echo": true, "model": "nope", "max_tokens": 0})), 404, "model")
        .await?;

    // gRPC: the first message's text starts with the prompt.
    let mut g = InferenceServiceClient::connect(grpc.to_owned()).await?;
    let mut r = tonic::Request::new(pb::GenerateRequest {
        model: MODEL.into(),
        prompt: Some(pb::generate_request::Prompt::Text(PROMPT.into())),
        sampling: Some(pb::SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(6),
            ignore_eos: true,
            ..Default::default()
        }),
        echo: true,
        ..Default::default()
    });
    r.metadata_mut().insert("authorization", format!("Bearer {KEY}").parse()?);
    let mut s = g.generate(r).await?.into_inner();
    let mut all = String::new();
    let mut first = None;
    while let Some(m) = s.next().await {
        let m = m?;
        first.get_or_insert_with(|| m.text.clone());
        all.push_str(&m.text);
    }
    assert!(first.is_some_and(|f| f.starts_with(PROMPT)));
    assert_eq!(all, format!("{PROMPT}{plain}"));
    Ok(())
}

async fn stops_and_fields(api: &Api) -> Result<()> {
    // A stop string from the middle of the greedy output.
    let full = text(&api.ok("/v1/completions", &completion(json!({"max_tokens": 16}))).await?);
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    ensure!(chars.len() > 12, "short output {full:?}");
    let (a, b) = (chars[6].0, chars[9].0);
    let stop = full[a..b].to_owned();
    let cut = full.find(&stop).context("stop occurs")?;
    for stream in [false, true] {
        for include in [false, true] {
            let body = completion(json!({"max_tokens": 16, "stop": [stop], "include_stop_str_in_output": include,
                                         "stream": stream}));
            let (got, finish) = if stream {
                let chunks = api.stream("/v1/completions", &body).await?;
                let deltas: Vec<&str> = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
                if !include {
                    assert!(deltas.iter().all(|d| !d.contains(&stop)), "{deltas:?}");
                }
                let finish =
                    chunks.iter().rev().find_map(|c| c["choices"][0]["finish_reason"].as_str()).map(str::to_owned);
                (deltas.concat(), finish)
            } else {
                let v = api.ok("/v1/completions", &body).await?;
                (text(&v), v["choices"][0]["finish_reason"].as_str().map(str::to_owned))
            };
            let want = if include { &full[..cut + stop.len()] } else { &full[..cut] };
            assert_eq!(got, want, "stop {stop:?} include {include} stream {stream}");
            assert_eq!(finish.as_deref(), Some("stop"));
        }
    }
    // "<|im_end|>" as a stop string: with ignore_eos the EOS token no longer stops, the stop
    // string does, at the same token, though the text never shows it.
    let chat = |extra: Value| {
        let mut v = json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
                           "max_tokens": 48, "temperature": 0.0});
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        v
    };
    let base = api.ok("/v1/chat/completions", &chat(json!({}))).await?;
    ensure!(base["choices"][0]["finish_reason"] == "stop", "the model did not end its turn: {base}");
    let stopped = api.ok("/v1/chat/completions", &chat(json!({"ignore_eos": true, "stop": "<|im_end|>"}))).await?;
    assert_eq!(stopped["choices"][0]["message"]["content"], base["choices"][0]["message"]["content"]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["usage"]["completion_tokens"], base["usage"]["completion_tokens"]);
    let shown = api
        .ok(
            "/v1/chat/completions",
            &chat(json!({"ignore_eos": true, "stop": ["<|im_end|>"], "include_stop_str_in_output": true,
                         "skip_special_tokens": false})),
        )
        .await?;
    let content = shown["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    assert_eq!(content, format!("{}<|im_end|>", base["choices"][0]["message"]["content"].as_str().unwrap_or_default()));
    // The EOS token itself ending the turn (no ignore_eos, no stop string): its text is kept
    // with include_stop_str_in_output and skip_special_tokens false, as vLLM keeps it, on
    // both endpoints, whole and streamed; with either flag off it is not.
    let base_text = base["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned();
    let keep = json!({"include_stop_str_in_output": true, "skip_special_tokens": false});
    let v = api.ok("/v1/chat/completions", &chat(keep.clone())).await?;
    assert_eq!(v["choices"][0]["message"]["content"], format!("{base_text}<|im_end|>"));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut streamed = chat(keep.clone());
    streamed["stream"] = json!(true);
    let chunks = api.stream("/v1/chat/completions", &streamed).await?;
    let joined: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(joined, format!("{base_text}<|im_end|>"));
    let v = api.ok("/v1/chat/completions", &chat(json!({"skip_special_tokens": false}))).await?;
    assert_eq!(v["choices"][0]["message"]["content"], base_text.as_str());
    // The chat's own prompt, as token ids, on /v1/completions.
    let msgs = json!([{"role": "user", "content": "Say hello."}]);
    let templated = api.ok("/tokenize", &json!({"model": MODEL, "messages": msgs})).await?["tokens"].clone();
    let cmpl = |extra: Value| {
        let mut v = json!({"model": MODEL, "prompt": templated, "max_tokens": 48, "temperature": 0.0});
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        v
    };
    let plain = api.ok("/v1/completions", &cmpl(json!({}))).await?;
    ensure!(plain["choices"][0]["finish_reason"] == "stop", "the completion did not end its turn: {plain}");
    let v = api.ok("/v1/completions", &cmpl(keep.clone())).await?;
    assert_eq!(text(&v), format!("{}<|im_end|>", text(&plain)));
    let mut streamed = cmpl(keep);
    streamed["stream"] = json!(true);
    let chunks = api.stream("/v1/completions", &streamed).await?;
    let joined: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(joined, format!("{}<|im_end|>", text(&plain)));

    // max_completion_tokens wins over max_tokens.
    let v = api
        .ok("/v1/chat/completions", &chat(json!({"ignore_eos": true, "max_tokens": 10, "max_completion_tokens": 3})))
        .await?;
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    api.refused("/v1/chat/completions", &chat(json!({"max_completion_tokens": 0})), 400, "max_completion_tokens")
        .await?;
    // Completions without max_tokens: 16 tokens, the legacy API's default (vLLM's too).
    let mut absent = completion(json!({}));
    if let Some(o) = absent.as_object_mut() {
        o.remove("max_tokens");
    }
    let v = api.ok("/v1/completions", &absent).await?;
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()),
        (Some(16), Some("length"))
    );
    // logit_bias / min_tokens validation.
    let e = api.refused("/v1/completions", &completion(json!({"logit_bias": {"12": 101}})), 400, "logit_bias").await?;
    assert!(e["error"]["message"].as_str().unwrap_or_default().contains("\"12\""), "{e}");
    api.refused("/v1/completions", &completion(json!({"logit_bias": {"x1": 1}})), 400, "logit_bias").await?;
    api.refused("/v1/completions", &completion(json!({"min_tokens": 7})), 400, "min_tokens").await?;
    api.refused("/v1/completions", &completion(json!({"min_tokens": -1})), 400, "min_tokens").await?;
    api.ok("/v1/completions", &completion(json!({"min_tokens": 2, "logit_bias": {"12": -5}}))).await?;
    Ok(())
}

/// A 3 MB prompt (about 600,000 tokens: with its token ids, over tonic's 4 MiB default for one
/// gRPC message) reaches the engine through router and worker and gets the context-length
/// 400, on both endpoints, not a message-size error of the internal hop.
async fn huge_prompts(api: &Api) -> Result<()> {
    let words = "word ".repeat(600_000);
    let completion = json!({"model": MODEL, "prompt": words, "max_tokens": 1});
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 1});
    for (path, body, param) in [("/v1/completions", completion, "prompt"), ("/v1/chat/completions", chat, "messages")] {
        let v = api.refused(path, &body, 400, param).await?;
        let message = v["error"]["message"].as_str().unwrap_or_default();
        ensure!(message.contains("maximum context length"), "{path}: {v}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prism_up_serves_tokenize_echo_stop_strings_and_the_smaller_fields() -> Result<()> {
    let Some(path) = model() else { return Ok(()) };
    let codec = codec(&path)?;
    let mut up = PrismUp::start(&path, &["--api-key", KEY]).await?;
    let api = Api {
        http: reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?,
        base: up.endpoints.http.clone(),
    };
    let grpc = up.endpoints.grpc.clone();
    let outcome = async {
        tokenize_routes(&api, &codec, &grpc).await.context("tokenize")?;
        echo(&api, &codec, &grpc).await.context("echo")?;
        stops_and_fields(&api).await.context("stops and fields")?;
        huge_prompts(&api).await.context("huge prompts")
    }
    .await;
    if let Err(e) = outcome {
        bail!("{e:#}\nprism up stderr:\n{}", up.proc.stderr());
    }
    up.interrupt(Duration::from_secs(10)).await?;
    Ok(())
}

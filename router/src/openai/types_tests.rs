//! Unit tests of the OpenAI request bodies ([`super`]): field mapping and 400s.

use super::*;

fn parse(v: serde_json::Value) -> Result<GenerateRequest, ApiError> {
    serde_json::from_value::<CompletionRequest>(v).map_err(|e| ApiError::invalid("body", e.to_string()))?.to_proto()
}

#[test]
fn max_tokens_null_is_unset_and_zero_is_rejected() {
    let r = parse(serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": null})).expect("valid");
    assert_eq!(r.sampling.expect("sampling").max_tokens, None);
    for bad in [0, -1] {
        let e = parse(serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": bad})).expect_err("invalid");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert_eq!(e.status.as_u16(), 400);
    }
}

/// Completions: an absent `max_tokens` is 16 (OpenAI's legacy API and vLLM), `null` is
/// unset, `max_completion_tokens` still wins; chat has no default.
#[test]
fn completions_default_max_tokens_when_absent() {
    let max = |r: GenerateRequest| r.sampling.expect("s").max_tokens;
    assert_eq!(max(parse(serde_json::json!({"model": "m", "prompt": "hi"})).expect("ok")), Some(16));
    let echo = serde_json::json!({"model": "m", "prompt": "hi", "echo": true});
    assert_eq!(max(parse(echo).expect("ok")), Some(16));
    let null = serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": null});
    assert_eq!(max(parse(null).expect("ok")), None);
    let newer = serde_json::json!({"model": "m", "prompt": "hi", "max_completion_tokens": 40});
    assert_eq!(max(parse(newer).expect("ok")), Some(40));
    let newer_null = serde_json::json!({"model": "m", "prompt": "hi", "max_completion_tokens": null});
    assert_eq!(max(parse(newer_null).expect("ok")), Some(16));
    assert_eq!(max(chat(serde_json::json!({})).expect("ok")), None);
    // min_tokens is bounded by the default too, and the message says where 16 came from.
    let e = parse(serde_json::json!({"model": "m", "prompt": "hi", "min_tokens": 17})).expect_err("over 16");
    assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("min_tokens")));
    assert!(e.message.contains("default"), "{}", e.message);
}

#[test]
fn prompt_forms_and_stop() {
    let r = parse(serde_json::json!({"model": "m", "prompt": ["a b"], "stop": "x"})).expect("valid");
    assert!(matches!(r.prompt, Some(generate_request::Prompt::Text(ref t)) if t == "a b"));
    assert_eq!(r.sampling.as_ref().expect("s").stop, vec!["x".to_owned()]);
    let r = parse(serde_json::json!({"model": "m", "prompt": [1, 2, 3], "stop": ["x", "y"]})).expect("valid");
    assert!(matches!(r.prompt, Some(generate_request::Prompt::TokenIds(ref t)) if t.ids == vec![1, 2, 3]));
    assert!(parse(serde_json::json!({"model": "m", "prompt": []})).is_err());
}

fn prompt(v: serde_json::Value) -> Result<PromptSpec, String> {
    serde_json::from_value::<CompletionRequest>(serde_json::json!({"model": "m", "prompt": v}))
        .map(|r| r.prompt)
        .map_err(|e| e.to_string())
}

/// A list of several prompts is a batch, split into one prompt each in order; a list mixing
/// kinds, or holding something that is not a prompt, is refused saying which entry.
#[test]
fn batched_prompts_split_in_order_and_mixed_lists_are_refused() {
    let texts = prompt(serde_json::json!(["a", "b"])).expect("texts");
    assert_eq!(texts.len(), 2);
    assert_eq!(texts.split(), vec![PromptSpec::Text("a".into()), PromptSpec::Text("b".into())]);
    let lists = prompt(serde_json::json!([[1], [2, 3], [4]])).expect("id lists");
    assert_eq!(lists.split(), vec![PromptSpec::Ids(vec![1]), PromptSpec::Ids(vec![2, 3]), PromptSpec::Ids(vec![4])]);
    assert_eq!(prompt(serde_json::json!([5, 6])).expect("ids"), PromptSpec::Ids(vec![5, 6]));
    assert_eq!(prompt(serde_json::json!("x")).expect("text").split(), vec![PromptSpec::Text("x".into())]);
    assert_eq!(prompt(serde_json::json!([])).expect("empty").len(), 1, "an empty id list, refused later");
    for (bad, at) in [
        (serde_json::json!(["a", [1]]), "prompt[1]"),
        (serde_json::json!([[1], "a"]), "prompt[1]"),
        (serde_json::json!([1, "a"]), "prompt[1]"),
        (serde_json::json!([[1], [2, -3]]), "prompt[1][1]"),
        (serde_json::json!([[1], [2, 4294967296_u64]]), "prompt[1][1]"),
    ] {
        let e = prompt(bad.clone()).expect_err("mixed");
        assert!(e.contains(at), "{bad}: {e}");
    }
    for bad in
        [serde_json::json!(5), serde_json::json!({"a": 1}), serde_json::json!([{"a": 1}]), serde_json::json!(null)]
    {
        assert!(prompt(bad.clone()).is_err(), "{bad}");
    }
    // A batch is never one request's prompt: it is split first (`super::super::batch`).
    let e = parse(serde_json::json!({"model": "m", "prompt": ["a", "b"]})).expect_err("batched");
    assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("prompt")));
}

/// `role: tool` messages: `tool_call_id` is passed on when given and optional, as in vLLM.
#[test]
fn tool_messages_need_no_tool_call_id() {
    let msgs = |tool: serde_json::Value| {
        serde_json::json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null,
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            tool,
        ])
    };
    let tool_msg = |r: GenerateRequest| match r.prompt {
        Some(generate_request::Prompt::Chat(c)) => c.messages[2].clone(),
        other => panic!("not a chat prompt: {other:?}"),
    };
    let with = chat(serde_json::json!({"messages": msgs(serde_json::json!(
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}))}));
    let m = tool_msg(with.expect("valid"));
    assert_eq!((m.role.as_str(), m.tool_call_id.as_deref(), m.content.as_str()), ("tool", Some("call_1"), "sunny"));
    let without = chat(serde_json::json!({"messages": msgs(serde_json::json!({"role": "tool", "content": "sunny"}))}));
    let m = tool_msg(without.expect("a tool message without tool_call_id is accepted"));
    assert_eq!((m.tool_call_id, m.content.as_str()), (None, "sunny"));
}

/// A request-supplied chat template is refused by name (vLLM's default); `null` is nothing
/// asked and passes.
#[test]
fn request_chat_templates_are_refused() {
    for extra in [serde_json::json!({"chat_template": "{{ messages }}"}), serde_json::json!({"chat_template": ""})] {
        let e = chat(extra.clone()).expect_err("refused");
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("chat_template")), "{extra}");
    }
    let e = chat(serde_json::json!({"chat_template": "x"})).expect_err("refused");
    assert!(e.message.contains("not accepted"), "{}", e.message);
    chat(serde_json::json!({"chat_template": null})).expect("nothing asked");
}

/// `chat_template_kwargs` (vLLM): a JSON object is carried to the engine as its JSON text
/// (`null` and `{}` as nothing); anything else, or an entry named after a standard template
/// variable, is a 400 naming the field.
#[test]
fn chat_template_kwargs_are_carried_or_refused() {
    let kwargs = |r: GenerateRequest| r.chat_template_kwargs_json;
    let r = chat(serde_json::json!({"chat_template_kwargs": {"enable_thinking": false}})).expect("object");
    let sent: serde_json::Value = serde_json::from_str(&kwargs(r)).expect("JSON text");
    assert_eq!(sent, serde_json::json!({"enable_thinking": false}));
    for nothing in [serde_json::json!(null), serde_json::json!({})] {
        assert_eq!(kwargs(chat(serde_json::json!({"chat_template_kwargs": nothing})).expect("nothing")), "");
    }
    assert_eq!(kwargs(chat(serde_json::json!({})).expect("absent")), "");
    for bad in [
        serde_json::json!("enable_thinking=false"),
        serde_json::json!([{"enable_thinking": false}]),
        serde_json::json!(false),
        serde_json::json!(1),
        serde_json::json!({"add_generation_prompt": false}),
        serde_json::json!({"messages": []}),
        serde_json::json!({"bos_token": "x", "enable_thinking": false}),
    ] {
        let e = chat(serde_json::json!({"chat_template_kwargs": bad.clone()})).expect_err("refused");
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("chat_template_kwargs")), "{bad}");
    }
}

#[test]
fn chat_logprobs_mapping() {
    let c: ChatRequest = serde_json::from_value(serde_json::json!({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "logprobs": true, "top_logprobs": 3, "max_completion_tokens": 5
    }))
    .expect("parse");
    let s = c.to_proto().expect("valid").sampling.expect("s");
    assert_eq!((s.logprobs, s.max_tokens), (Some(3), Some(5)));
}

#[test]
fn cache_salt_reaches_the_request_on_both_endpoints() {
    let r = parse(serde_json::json!({"model": "m", "prompt": "hi", "cache_salt": "tenant-a"})).expect("valid");
    assert_eq!(r.cache_salt.as_deref(), Some("tenant-a"));
    let r = parse(serde_json::json!({"model": "m", "prompt": "hi", "cache_salt": null})).expect("valid");
    assert_eq!(r.cache_salt, None);
    let c: ChatRequest = serde_json::from_value(serde_json::json!({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "s"
    }))
    .expect("parse");
    assert_eq!(c.to_proto().expect("valid").cache_salt.as_deref(), Some("s"));
    let e = parse(serde_json::json!({"model": "m", "prompt": "hi", "cache_salt": ""})).expect_err("empty");
    assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("cache_salt")));
}

fn chat(extra: serde_json::Value) -> Result<GenerateRequest, ApiError> {
    let mut v = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for (k, x) in extra.as_object().expect("object") {
        v[k] = x.clone();
    }
    serde_json::from_value::<ChatRequest>(v).map_err(|e| ApiError::invalid("body", e.to_string()))?.to_proto()
}

/// vLLM's rule: `max_completion_tokens or max_tokens`, the newer name winning; a bad
/// value is named by the field it came in.
#[test]
fn max_completion_tokens_wins_over_max_tokens() {
    let max = |r: GenerateRequest| r.sampling.expect("s").max_tokens;
    assert_eq!(max(chat(serde_json::json!({"max_completion_tokens": 7})).expect("ok")), Some(7));
    assert_eq!(max(chat(serde_json::json!({"max_tokens": 9})).expect("ok")), Some(9));
    let both = serde_json::json!({"max_tokens": 9, "max_completion_tokens": 3});
    assert_eq!(max(chat(both).expect("ok")), Some(3));
    let both = serde_json::json!({"max_tokens": 0, "max_completion_tokens": 3});
    assert_eq!(max(chat(both).expect("the unused max_tokens is not checked")), Some(3));
    let e = chat(serde_json::json!({"max_tokens": 9, "max_completion_tokens": 0})).expect_err("zero");
    assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("max_completion_tokens")));
    let e = chat(serde_json::json!({"max_completion_tokens": 0, "min_tokens": 1})).expect_err("zero");
    assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
}

#[test]
fn logit_bias_min_tokens_and_include_stop_str_are_mapped() {
    let r = parse(serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": 8,
        "logit_bias": {"42": 5, "7": -100, "0": 100.0}, "min_tokens": 3,
        "include_stop_str_in_output": true, "stop": "x"}))
    .expect("valid");
    let s = r.sampling.expect("s");
    let mut bias: Vec<(u32, f32)> = s.logit_bias.into_iter().collect();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, vec![(0, 100.0), (7, -100.0), (42, 5.0)]);
    assert_eq!((s.min_tokens, s.include_stop_str_in_output), (Some(3), true));
    let r = parse(serde_json::json!({"model": "m", "prompt": "hi", "logit_bias": null, "min_tokens": 0})).expect("ok");
    let s = r.sampling.expect("s");
    assert!(s.logit_bias.is_empty() && !s.include_stop_str_in_output);
    assert_eq!(s.min_tokens, Some(0));
    // The same fields on chat.
    let c = chat(serde_json::json!({"logit_bias": {"5": 1.5}, "min_tokens": 2})).expect("ok");
    assert_eq!(c.sampling.expect("s").logit_bias.get(&5), Some(&1.5));
    for (bad, names) in [
        (serde_json::json!({"abc": 1}), "\"abc\""),
        (serde_json::json!({"-1": 1}), "\"-1\""),
        (serde_json::json!({"+3": 1}), "\"+3\""),
        (serde_json::json!({"1.5": 1}), "\"1.5\""),
        (serde_json::json!({"99999999999": 1}), "\"99999999999\""),
        (serde_json::json!({"3": 100.5}), "\"3\""),
        (serde_json::json!({"4": -101}), "\"4\""),
        (serde_json::json!({"5": "high"}), "\"5\""),
        (serde_json::json!([1, 2]), "map"),
    ] {
        let e = parse(serde_json::json!({"model": "m", "prompt": "hi", "logit_bias": bad})).expect_err("bad");
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("logit_bias")), "{bad}");
        assert!(e.message.contains(names), "{bad}: {}", e.message);
    }
    for (bad, max) in [(-1, None), (5, Some(4)), (2, Some(1))] {
        let mut v = serde_json::json!({"model": "m", "prompt": "hi", "min_tokens": bad});
        if let Some(m) = max {
            v["max_tokens"] = serde_json::json!(m);
        }
        let e = parse(v).expect_err("bad min_tokens");
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("min_tokens")), "{bad} {max:?}");
    }
}

#[test]
fn echo_is_forwarded_and_allows_max_tokens_zero() {
    let r = parse(serde_json::json!({"model": "m", "prompt": "hi", "echo": true, "max_tokens": 0})).expect("ok");
    assert!(r.echo);
    assert_eq!(r.sampling.expect("s").max_tokens, Some(0));
    let r = parse(serde_json::json!({"model": "m", "prompt": [1, 2], "echo": true})).expect("ok");
    assert!(r.echo);
    let e = parse(serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": 0})).expect_err("no echo");
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    let e = chat(serde_json::json!({"echo": true})).expect_err("chat echo");
    assert_eq!(e.param.as_deref(), Some("echo"));
}

/// Completions refuse the chat-only template fields (chat completions and /tokenize take
/// `chat_template_kwargs`): one rule, a 400 naming the field, instead of ignoring them.
#[test]
fn completions_refuse_chat_template_fields() {
    for field in ["chat_template", "chat_template_kwargs"] {
        let e = parse(serde_json::json!({"model": "m", "prompt": "hi", field: {"a": 1}})).expect_err("chat only");
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(field)));
        assert!(e.message.contains("chat messages only"), "{}", e.message);
        parse(serde_json::json!({"model": "m", "prompt": "hi", field: null})).expect("null is absent");
    }
}

/// vLLM's rule: a non-empty `stream_options` needs `stream: true` (400 naming it otherwise),
/// `{}` and `null` pass; unknown keys inside are ignored, as vLLM's models ignore extras.
#[test]
fn stream_options_need_stream_true() {
    let with = |extra: serde_json::Value| {
        let completion = {
            let mut v = serde_json::json!({"model": "m", "prompt": "hi"});
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            parse(v)
        };
        (completion, chat(extra))
    };
    for off in [serde_json::json!({}), serde_json::json!({"stream": false}), serde_json::json!({"stream": null})] {
        for options in [serde_json::json!({"include_usage": true}), serde_json::json!({"continuous_usage_stats": true})]
        {
            let mut body = off.clone();
            body["stream_options"] = options;
            let (c, ch) = with(body.clone());
            for e in [c.expect_err("completions"), ch.expect_err("chat")] {
                assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("stream_options")), "{body}");
            }
        }
    }
    for ok in [
        serde_json::json!({"stream_options": {}}),
        serde_json::json!({"stream": false, "stream_options": null}),
        serde_json::json!({"stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true,
                                                               "include_obfuscation": false, "unknown": 1}}),
    ] {
        let (c, ch) = with(ok.clone());
        assert!(c.is_ok() && ch.is_ok(), "{ok}: {c:?} {ch:?}");
    }
}

/// `use_beam_search: true` is refused as `best_of` is (beam search is not implemented);
/// `false` and `null` pass.
#[test]
fn beam_search_is_refused_by_name() {
    let e = parse(serde_json::json!({"model": "m", "prompt": "hi", "use_beam_search": true})).expect_err("beam");
    assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("use_beam_search")));
    assert!(chat(serde_json::json!({"use_beam_search": true})).is_err());
    for ok in [serde_json::json!(false), serde_json::Value::Null] {
        assert!(parse(serde_json::json!({"model": "m", "prompt": "hi", "use_beam_search": ok})).is_ok());
    }
}

/// Too many chat `top_logprobs` names `top_logprobs`, the field the client sent.
#[test]
fn top_logprobs_over_the_limit_names_top_logprobs() {
    let e = chat(serde_json::json!({"logprobs": true, "top_logprobs": 25})).expect_err("over 20");
    assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("top_logprobs")));
    assert!(chat(serde_json::json!({"logprobs": true, "top_logprobs": 20})).is_ok());
}

/// A prompt entry that is not a token id says which entry and what it holds.
#[test]
fn negative_prompt_token_id_is_named_with_its_value() {
    let e = prompt(serde_json::json!([-1])).expect_err("negative id");
    assert!(e.contains("prompt[0]") && e.contains("-1"), "{e}");
    let e = prompt(serde_json::json!([[1], [2, 1.5]])).expect_err("fraction");
    assert!(e.contains("prompt[1][1]") && e.contains("1.5"), "{e}");
}

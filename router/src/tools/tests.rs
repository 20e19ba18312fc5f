use super::parse::{ParsedCall, Piece, ToolParser, parse_whole};
use super::*;
use prism_common::proto::v1::{ChatMessage, ChatMessages, SamplingParams};
use serde_json::json;

fn tools_json() -> String {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    ])
    .to_string()
}

fn chat_req(tools: &str, choice: &str) -> GenerateRequest {
    GenerateRequest {
        model: "m".into(),
        prompt: Some(generate_request::Prompt::Chat(ChatMessages {
            messages: vec![ChatMessage { role: "user".into(), content: "hi".into(), ..Default::default() }],
        })),
        tools_json: tools.into(),
        tool_choice: choice.into(),
        ..Default::default()
    }
}

fn grammar_of(req: &GenerateRequest) -> Option<String> {
    match req.sampling.as_ref()?.structured_output.as_ref()?.constraint.as_ref()? {
        structured_output::Constraint::Grammar(g) => Some(g.clone()),
        _ => None,
    }
}

#[test]
fn tool_definitions_are_checked_naming_the_element() {
    assert_eq!(parse_tools(&tools_json()).expect("valid").len(), 2);
    let cases = [
        ("{}", "list"),
        (r#"[1]"#, "tools[0] must be an object"),
        (r#"[{"type": "retrieval", "function": {"name": "f"}}]"#, "tools[0].type"),
        (r#"[{"type": "function"}]"#, "tools[0].function must be"),
        (r#"[{"type": "function", "function": {"name": "bad name"}}]"#, "tools[0].function.name"),
        (r#"[{"type": "function", "function": {"name": ""}}]"#, "tools[0].function.name"),
        (
            r#"[{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]"#,
            "given twice",
        ),
        (r#"[{"type": "function", "function": {"name": "f", "parameters": "x"}}]"#, "parameters must be"),
        ("not json", "not valid JSON"),
    ];
    for (text, want) in cases {
        let e = parse_tools(text).expect_err(text);
        assert_eq!(e.param, "tools");
        assert!(e.message.contains(want), "{text}: {}", e.message);
    }
    let long = "x".repeat(MAX_TOOL_NAME + 1);
    assert!(!valid_name(&long) && valid_name(&long[1..]) && valid_name("a-b_C9"));
    // Parameters absent: any object.
    let t = parse_tools(r#"[{"type": "function", "function": {"name": "f"}}]"#).expect("valid");
    assert_eq!(t[0].parameters, json!({"type": "object"}));
}

#[test]
fn plan_by_tool_choice() {
    // auto: parsed, not constrained, tools forwarded.
    let mut r = chat_req(&tools_json(), "");
    let p = plan(&mut r, ParserKind::Hermes).expect("ok").expect("parsed");
    assert!(!p.forced && grammar_of(&r).is_none() && !r.tools_json.is_empty());
    // none: tools dropped, nothing parsed.
    let mut r = chat_req(&tools_json(), "none");
    assert!(plan(&mut r, ParserKind::Hermes).expect("ok").is_none());
    assert!(r.tools_json.is_empty());
    // required: a grammar over both tools; named: only that one.
    let mut r = chat_req(&tools_json(), "required");
    assert!(plan(&mut r, ParserKind::Hermes).expect("ok").expect("parsed").forced);
    let g = grammar_of(&r).expect("grammar");
    assert!(g.contains("\\\"get_weather\\\"") && g.contains("\\\"add\\\""), "{g}");
    assert!(g.starts_with("start: call (\"\\n\" call)*\n"), "{g}");
    let mut r = chat_req(&tools_json(), "add");
    plan(&mut r, ParserKind::Hermes).expect("ok");
    let g = grammar_of(&r).expect("grammar");
    assert!(g.starts_with("start: call\n") && !g.contains("get_weather"), "{g}");
    // required without parallel calls: exactly one.
    let mut r = chat_req(&tools_json(), "required");
    r.parallel_tool_calls = Some(false);
    plan(&mut r, ParserKind::Hermes).expect("ok");
    assert!(grammar_of(&r).expect("grammar").starts_with("start: call\n"));
}

#[test]
fn plan_rejections_name_the_field() {
    let e = plan(&mut chat_req(&tools_json(), "nope"), ParserKind::Hermes).expect_err("unknown");
    assert_eq!(e.param, "tool_choice");
    assert!(e.message.contains("nope"));
    for choice in ["required", "auto", "f"] {
        let e = plan(&mut chat_req("", choice), ParserKind::Hermes).expect_err("no tools");
        assert_eq!(e.param, "tool_choice", "{choice}");
    }
    assert!(plan(&mut chat_req("", "none"), ParserKind::Hermes).expect("ok").is_none());
    assert!(plan(&mut chat_req("[]", ""), ParserKind::Hermes).expect("ok").is_none());
    let mut text = chat_req(&tools_json(), "");
    text.prompt = Some(generate_request::Prompt::Text("x".into()));
    assert_eq!(plan(&mut text, ParserKind::Hermes).expect_err("text").param, "tools");
    let mut both = chat_req(&tools_json(), "required");
    both.sampling = Some(SamplingParams {
        structured_output: Some(StructuredOutput { constraint: Some(structured_output::Constraint::JsonObject(true)) }),
        ..Default::default()
    });
    assert_eq!(plan(&mut both, ParserKind::Hermes).expect_err("both").param, "tool_choice");
}

#[test]
fn grammar_embeds_each_schema_in_the_parser_format() {
    let tools = parse_tools(&tools_json()).expect("valid");
    let g = grammar::build(ParserKind::Hermes, &tools, true);
    let want = concat!(
        "start: call (\"\\n\" call)*\n",
        "call: \"<tool_call>\\n\" (body_0 | body_1) \"\\n</tool_call>\"\n",
        "body_0: \"{\\\"name\\\": \\\"get_weather\\\", \\\"arguments\\\": \" args_0 \"}\"\n",
    );
    assert!(g.starts_with(want), "{g}");
    assert!(g.contains("args_0: %json {"), "{g}");
    // The schema is embedded as compact JSON with the compact-output options.
    let line = g.lines().find(|l| l.starts_with("args_1: %json ")).expect("args_1");
    let schema: Value = serde_json::from_str(&line["args_1: %json ".len()..]).expect("schema JSON");
    assert_eq!(schema["properties"]["a"], json!({"type": "integer"}));
    assert_eq!(schema["x-guidance"]["whitespace_flexible"], json!(false));
    assert_eq!(schema["additionalProperties"], json!(false));
    let g = grammar::build(ParserKind::Llama3Json, &tools[..1], false);
    assert_eq!(
        g.lines().take(3).collect::<Vec<_>>(),
        [
            "start: call",
            "call: (body_0)",
            "body_0: \"{\\\"name\\\": \\\"get_weather\\\", \\\"parameters\\\": \" args_0 \"}\""
        ]
    );
}

#[test]
fn parser_is_chosen_by_template_and_flag() {
    assert_eq!(ParserKind::for_template(None), ParserKind::Hermes);
    assert_eq!(ParserKind::for_template(Some("{{ '<tool_call>' }}")), ParserKind::Hermes);
    assert_eq!(ParserKind::for_template(Some("<|python_tag|>{{ x }}<|eom_id|>")), ParserKind::Llama3Json);
    assert_eq!(
        ParserKind::for_template(Some("{\"name\": ..., \"parameters\": ...}<|eot_id|>")),
        ParserKind::Llama3Json
    );
    assert_eq!(ParserKind::for_template(Some("<|im_start|>{{ m.content }}")), ParserKind::Hermes);
    assert_eq!(ParserChoice::Llama3Json.resolve(Some("<tool_call>")), ParserKind::Llama3Json);
    assert_eq!(ParserChoice::Auto.resolve(Some("<|python_tag|>")), ParserKind::Llama3Json);
}

/// Content and calls (without ids) of `text` pushed in pieces cut at `cuts`.
fn run(kind: ParserKind, text: &str, cuts: &[usize]) -> (String, Vec<(String, String)>, usize) {
    let mut p = ToolParser::new(kind);
    let mut pieces = Vec::new();
    let mut at = 0;
    for &c in cuts.iter().chain(std::iter::once(&text.len())) {
        pieces.extend(p.push(&text[at..c]));
        at = c;
    }
    pieces.extend(p.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut n = 0;
    for piece in pieces {
        match piece {
            Piece::Content(c) => content.push_str(&c),
            Piece::Call(ParsedCall { index, id, name, arguments }) => {
                assert_eq!(index as usize, calls.len());
                assert!(id.starts_with("call_") && id.len() > 10, "{id}");
                calls.push((name, arguments));
                n += 1;
            }
        }
    }
    (content, calls, n)
}

/// Every split of `text` at one and at two char boundaries gives the whole-text result.
fn every_split(kind: ParserKind, text: &str) -> (String, Vec<(String, String)>) {
    let whole = run(kind, text, &[]);
    let bounds: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
    for &i in &bounds {
        assert_eq!(run(kind, text, &[i]), whole, "cut at {i} of {text:?}");
    }
    // Every piece one byte (char) long.
    assert_eq!(run(kind, text, &bounds), whole, "byte-by-byte {text:?}");
    (whole.0, whole.1)
}

#[test]
fn hermes_calls_text_around_and_fragments() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n";
    let (content, calls) = every_split(ParserKind::Hermes, text);
    assert_eq!(content, "Let me check.");
    assert_eq!(
        calls,
        [
            ("get_weather".to_owned(), r#"{"city":"Paris"}"#.to_owned()),
            ("add".to_owned(), r#"{"a":1,"b":2}"#.to_owned())
        ]
    );
    // Only calls: no content at all.
    let (content, calls) =
        parse_whole(ParserKind::Hermes, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
    assert_eq!((content, calls.len()), (None, 1));
    // Arguments as JSON text, `parameters`, and an unclosed last call.
    let (content, calls) = every_split(
        ParserKind::Hermes,
        "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call><tool_call>{\"name\": \"g\", \"parameters\": {\"y\": [1]}}",
    );
    assert_eq!(content, "");
    assert_eq!(calls, [("f".to_owned(), r#"{"x":1}"#.to_owned()), ("g".to_owned(), r#"{"y":[1]}"#.to_owned())]);
    // Output cut inside the last call's closing tag, as `max_tokens` leaves it.
    for cut in ["\n</", "\n</tool_call", "</tool_call"] {
        let text = format!("<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}{cut}");
        let (content, calls) = every_split(ParserKind::Hermes, &text);
        assert_eq!(content, "", "{text:?}");
        assert_eq!(calls, [("get_weather".to_owned(), r#"{"city":"Paris"}"#.to_owned())], "{text:?}");
    }
    // Plain text, with things that look like the tag's start.
    let plain = "a < b and <tool or <tool_cal; done <";
    assert_eq!(every_split(ParserKind::Hermes, plain), (plain.to_owned(), vec![]));
    assert_eq!(every_split(ParserKind::Hermes, "héllo wörld ✓ "), ("héllo wörld ✓ ".to_owned(), vec![]));
}

#[test]
fn malformed_calls_stay_content() {
    for bad in [
        "<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>not json</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
        "text <tool_call>{\"name\": \"f\"",
    ] {
        let (content, calls) = every_split(ParserKind::Hermes, bad);
        assert_eq!((content.as_str(), calls.len()), (bad, 0), "{bad}");
    }
    // A good call after a malformed one is still a call.
    let (content, calls) =
        parse_whole(ParserKind::Hermes, "<tool_call>x</tool_call> <tool_call>{\"name\": \"f\"}</tool_call>");
    assert_eq!(content.as_deref(), Some("<tool_call>x</tool_call>"));
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].arguments, "{}");
}

#[test]
fn llama3_json_calls_and_plain_text() {
    let text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2}}";
    let (content, calls) = every_split(ParserKind::Llama3Json, text);
    assert_eq!(content, "");
    assert_eq!(
        calls,
        [
            ("get_weather".to_owned(), r#"{"city":"Oslo"}"#.to_owned()),
            ("add".to_owned(), r#"{"a":1,"b":2}"#.to_owned())
        ]
    );
    let (content, calls) = every_split(ParserKind::Llama3Json, "  {\"name\": \"f\", \"arguments\": {\"k\": \"v\"}}\n");
    assert_eq!((content.as_str(), calls.len()), ("", 1));
    let plain = "The answer is {42}.";
    assert_eq!(every_split(ParserKind::Llama3Json, plain), (plain.to_owned(), vec![]));
    // JSON that is not a call, and a truncated call, are content.
    for bad in ["{\"answer\": 42}", "{\"name\": \"f\", \"parameters\": {\"a\":"] {
        assert_eq!(every_split(ParserKind::Llama3Json, bad), (bad.to_owned(), vec![]), "{bad}");
    }
    assert_eq!(every_split(ParserKind::Llama3Json, "<|py"), ("<|py".to_owned(), vec![]));
}

/// Whether llguidance, given `grammar`, accepts `text` as a whole output (byte-level tokens).
fn accepts(grammar: &str, text: &str) -> bool {
    use llguidance::toktrie::ApproximateTokEnv;
    let env = ApproximateTokEnv::single_byte_env();
    let factory = llguidance::ParserFactory::new_simple(&env).expect("factory");
    let parser = factory.create_parser(llguidance::api::TopLevelGrammar::from_lark(grammar.to_owned()));
    let mut m =
        llguidance::Matcher::new(Ok(parser.unwrap_or_else(|e| panic!("grammar does not compile: {e}\n{grammar}"))));
    let toks = env.tokenize_bytes(text.as_bytes());
    m.consume_tokens(&toks).is_ok() && m.is_accepting().unwrap_or(false)
}

/// The grammars compile in llguidance and accept exactly well-formed calls of the offered
/// functions with arguments valid for their schemas, in the parser's format.
#[test]
fn grammars_accept_only_valid_calls() {
    let tools = parse_tools(&tools_json()).expect("valid");
    let weather = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let add = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": -2}}\n</tool_call>";
    let g = grammar::build(ParserKind::Hermes, &tools, true);
    assert!(accepts(&g, weather), "{g}");
    assert!(accepts(&g, add));
    assert!(accepts(&g, &format!("{weather}\n{add}")), "parallel calls");
    for bad in [
        "",
        "Sure! {weather}",
        "<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": \"1\", \"b\": 2}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2, \"c\": 3}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
    ] {
        let bad = bad.replace("{weather}", weather);
        assert!(!accepts(&g, &bad), "accepted {bad:?}");
    }
    let one = grammar::build(ParserKind::Hermes, &tools, false);
    assert!(accepts(&one, add) && !accepts(&one, &format!("{weather}\n{add}")), "exactly one call");
    let g = grammar::build(ParserKind::Llama3Json, &tools, true);
    assert!(
        accepts(
            &g,
            "{\"name\": \"add\", \"parameters\": {\"a\": 3, \"b\": 4}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}"
        ),
        "{g}"
    );
    assert!(!accepts(&g, "{\"name\": \"add\", \"arguments\": {\"a\": 3, \"b\": 4}}"));
    // What the grammar accepts, the parser reads back as the same calls.
    let (content, calls) = parse_whole(ParserKind::Hermes, &format!("{weather}\n{add}"));
    assert_eq!(content, None);
    assert_eq!(calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["get_weather", "add"]);
}

use super::*;
use crate::openai::types::SamplingFields;
use serde_json::json;

fn constraint(v: Value) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    let fields: SamplingFields = serde_json::from_value(v).expect("sampling fields");
    Ok(structured(&fields.structured_fields())?.map(|(s, src)| (s.constraint.expect("set"), src.param)))
}

#[test]
fn each_field_maps_onto_one_constraint() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let cases = [
        (json!({"response_format": {"type": "text"}}), None),
        (json!({"response_format": null}), None),
        (json!({"response_format": {"type": "json_object"}}), Some((Constraint::JsonObject(true), "response_format"))),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            Some((Constraint::JsonSchema(schema.to_string()), "response_format.json_schema.schema")),
        ),
        (json!({"guided_json": schema}), Some((Constraint::JsonSchema(schema.to_string()), "guided_json"))),
        (json!({"guided_json": schema.to_string()}), Some((Constraint::JsonSchema(schema.to_string()), "guided_json"))),
        (json!({"guided_regex": "[0-9]+"}), Some((Constraint::Regex("[0-9]+".into()), "guided_regex"))),
        (
            json!({"guided_choice": ["yes", "no"]}),
            Some((Constraint::Choice(Choices { choices: vec!["yes".into(), "no".into()] }), "guided_choice")),
        ),
        (
            json!({"guided_grammar": "start: \"a\""}),
            Some((Constraint::Grammar("start: \"a\"".into()), "guided_grammar")),
        ),
        (
            json!({"structured_outputs": {"regex": "a+"}}),
            Some((Constraint::Regex("a+".into()), "structured_outputs.regex")),
        ),
        (
            json!({"structured_outputs": {"json": schema}}),
            Some((Constraint::JsonSchema(schema.to_string()), "structured_outputs.json")),
        ),
        (
            json!({"structured_outputs": {"json_object": true}}),
            Some((Constraint::JsonObject(true), "structured_outputs.json_object")),
        ),
        (
            json!({"structured_outputs": {"choice": ["a"], "regex": null}}),
            Some((Constraint::Choice(Choices { choices: vec!["a".into()] }), "structured_outputs.choice")),
        ),
        (json!({"guided_json": null, "response_format": {"type": "text"}}), None),
    ];
    for (body, want) in cases {
        assert_eq!(constraint(body.clone()).expect("valid"), want, "{body}");
    }
}

#[test]
fn rejections_name_the_openai_field() {
    let cases = [
        (json!({"response_format": {"type": "xml"}}), "response_format.type"),
        (json!({"response_format": {}}), "response_format.type"),
        (json!({"response_format": "json"}), "response_format"),
        (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{bad"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}),
            "response_format.json_schema.strict",
        ),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (json!({"guided_json": 5}), "guided_json"),
        (json!({"guided_json": "[1, 2]"}), "guided_json"),
        (json!({"guided_regex": ""}), "guided_regex"),
        (json!({"guided_regex": 5}), "guided_regex"),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_choice": ["a", 1]}), "guided_choice"),
        (json!({"guided_grammar": ""}), "guided_grammar"),
        (json!({"structured_outputs": {"structural_tag": "x"}}), "structured_outputs"),
        (json!({"structured_outputs": {"json": 3}}), "structured_outputs.json"),
        (json!({"structured_outputs": {"json_object": "yes"}}), "structured_outputs.json_object"),
        (json!({"structured_outputs": 1}), "structured_outputs"),
    ];
    for (body, param) in cases {
        let e = constraint(body.clone()).expect_err("rejected");
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}: {}", e.message);
    }
}

#[test]
fn more_than_one_constraint_is_400_naming_them() {
    for (body, names) in [
        (json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}), ["response_format", "guided_regex"]),
        (json!({"guided_json": {}, "guided_choice": ["a"]}), ["guided_json", "guided_choice"]),
        (
            json!({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}),
            ["structured_outputs.regex", "structured_outputs.grammar"],
        ),
    ] {
        let e = constraint(body.clone()).expect_err("two");
        assert_eq!(e.status.as_u16(), 400);
        for n in names {
            assert!(e.message.contains(n), "{body}: {}", e.message);
        }
        assert_eq!(e.param.as_deref(), Some(names[1]));
    }
}

#[test]
fn worker_errors_name_the_clients_field_in_param_and_message() {
    let worker = |param: &str, message: &str| ApiError::invalid(param, message);
    let fields = ErrorFields { structured: Some("response_format.json_schema.schema"), tools: None };
    let e = fields.client_error(
        true,
        worker(
            "structured_output.json_schema",
            "structured_output.json_schema: Unsatisfiable schema: minimum > maximum",
        ),
    );
    assert_eq!(e.param.as_deref(), Some("response_format.json_schema.schema"));
    assert_eq!(e.message, "response_format.json_schema.schema: Unsatisfiable schema: minimum > maximum");
    assert_eq!(e.status.as_u16(), 400);
    // A chat request's `prompt` is its `messages`; a message without the prefix is kept.
    let e = fields.client_error(true, worker("prompt", "the prompt is empty"));
    assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("messages"), "the prompt is empty"));
    // Fields the router does not rename stay as the worker named them.
    let e = fields.client_error(false, worker("prompt", "prompt: too long"));
    assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("prompt"), "prompt: too long"));
    let e = fields.client_error(true, worker("max_tokens", "max_tokens: too large"));
    assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("max_tokens"), "max_tokens: too large"));
}

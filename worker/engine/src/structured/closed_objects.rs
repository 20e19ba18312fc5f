//! Closed objects: a JSON schema's objects that list their `properties` but say nothing of
//! others get `"additionalProperties": false` before llguidance compiles them.
//!
//! JSON Schema lets an object without `additionalProperties` carry any further keys, and
//! llguidance follows the letter of it: a small model then invents keys
//! (`"hobbies_by_job": [["…", …`) whose values nothing bounds, and runs into `max_tokens`
//! with an unfinished object. Constrained decoding elsewhere closes such objects: OpenAI's
//! strict mode requires `additionalProperties: false` on every object, xgrammar (vLLM's
//! default backend) compiles with `strict_mode` (no properties the schema does not name), and
//! vLLM's llguidance backend offers the same as `disable-additional-properties`. Every output
//! of the closed schema is valid for the original one; a schema that wants free keys says
//! so with `additionalProperties` (or `unevaluatedProperties`), which is kept as written.
//!
//! Only self-contained objects are closed: one combined with sibling keywords that may
//! declare more properties (`allOf`/`anyOf`/`oneOf`/`$ref`/`if`/`dependentSchemas` beside
//! its `properties`, or a member of a multi-member `allOf`, or a member of a combinator
//! whose parent lists properties) is left open, since closing it could forbid a property
//! the other part requires.

use serde_json::{Map, Value};

/// Keywords whose presence beside `properties` means other parts of the schema may declare
/// properties of the same object.
const COMPOSING: &[&str] =
    &["allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "dependentSchemas"];

/// Keywords whose value is one subschema.
const ONE_SCHEMA: &[&str] = &[
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
];

/// Keywords whose value maps names to subschemas.
const SCHEMA_MAPS: &[&str] = &["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];

/// Closes the objects of `schema` (a JSON Schema) that name their properties and leave the
/// rest unsaid, in place; see the module header for which ones.
pub fn close_objects(schema: &mut Value) {
    // First the definitions that some `$ref` extends (a `$ref` beside properties or in a
    // composed part): those stay open. Then the closing, with that list.
    let mut probe = Walk { close: false, open_refs: Vec::new() };
    probe.schema(&mut schema.clone(), true);
    Walk { close: true, open_refs: probe.open_refs }.schema(schema, true);
}

/// One pass over a schema: `close` false only collects `open_refs`.
struct Walk {
    close: bool,
    /// `$ref` targets used where the referring schema is not self-contained.
    open_refs: Vec<String>,
}

impl Walk {
    /// `closable`: whether this schema stands alone (no sibling part of the same instance
    /// may declare properties it does not list).
    fn schema(&mut self, schema: &mut Value, closable: bool) {
        let Value::Object(obj) = schema else { return };
        let declares = obj.contains_key("properties") || obj.contains_key("patternProperties");
        let composed = COMPOSING.iter().any(|k| obj.contains_key(*k));
        if let Some(Value::String(target)) = obj.get("$ref")
            && (declares || !closable || composed_besides_ref(obj))
            && !self.close
        {
            self.open_refs.push(target.clone());
        }
        if self.close
            && closable
            && declares
            && !composed
            && !obj.contains_key("additionalProperties")
            && !obj.contains_key("unevaluatedProperties")
        {
            obj.insert("additionalProperties".to_owned(), Value::Bool(false));
        }
        self.children(obj, declares);
    }

    fn children(&mut self, obj: &mut Map<String, Value>, declares: bool) {
        for key in ONE_SCHEMA {
            if let Some(sub) = obj.get_mut(*key) {
                match sub {
                    // Draft-7 tuple form of `items`.
                    Value::Array(list) => list.iter_mut().for_each(|s| self.schema(s, true)),
                    // `if`/`then`/`else` describe the same object as their parent.
                    s => self.schema(s, !matches!(*key, "if" | "then" | "else")),
                }
            }
        }
        for key in SCHEMA_MAPS {
            let defs = matches!(*key, "$defs" | "definitions");
            if let Some(Value::Object(map)) = obj.get_mut(*key) {
                for (name, s) in map.iter_mut() {
                    let extended = defs && self.open_refs.iter().any(|r| r == &format!("#/{key}/{name}"));
                    self.schema(s, !extended);
                }
            }
        }
        if let Some(Value::Array(list)) = obj.get_mut("prefixItems") {
            list.iter_mut().for_each(|s| self.schema(s, true));
        }
        for key in ["anyOf", "oneOf", "allOf"] {
            if let Some(Value::Array(list)) = obj.get_mut(key) {
                // Members are one whole alternative each, unless the parent adds properties
                // of its own or (allOf) several members describe the same object together.
                let alone = !declares && (key != "allOf" || list.len() == 1);
                list.iter_mut().for_each(|s| self.schema(s, alone));
            }
        }
    }
}

/// Whether a schema with a `$ref` also has other parts that may declare properties.
fn composed_besides_ref(obj: &Map<String, Value>) -> bool {
    COMPOSING.iter().any(|k| *k != "$ref" && obj.contains_key(*k))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn closed(mut v: Value) -> Value {
        close_objects(&mut v);
        v
    }

    #[test]
    fn objects_with_properties_are_closed_at_every_depth() {
        let got = closed(json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "pet": {"type": "object", "properties": {"kind": {"type": "string"}}},
                "tags": {"type": "array", "items": {"properties": {"t": {}}}},
            },
            "$defs": {"D": {"properties": {"x": {}}}},
        }));
        assert_eq!(got["additionalProperties"], false);
        assert_eq!(got["properties"]["pet"]["additionalProperties"], false);
        assert_eq!(got["properties"]["tags"]["items"]["additionalProperties"], false);
        assert_eq!(got["$defs"]["D"]["additionalProperties"], false);
        // A property map is not a schema: a property called `properties` gains no key.
        let got = closed(json!({"properties": {"properties": {"type": "string"}}}));
        assert_eq!(got["properties"].as_object().map(Map::len), Some(1));
    }

    #[test]
    fn what_the_schema_says_is_kept() {
        for own in [
            json!({"properties": {"a": {}}, "additionalProperties": true}),
            json!({"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}),
            json!({"properties": {"a": {}}, "unevaluatedProperties": false}),
            // Objects that name no properties (json_object's `{"type": "object"}`) stay free.
            json!({"type": "object"}),
            // Data, not schemas.
            json!({"const": {"properties": {"a": 1}}, "enum": [{"properties": {}}]}),
        ] {
            assert_eq!(closed(own.clone()), own);
        }
    }

    #[test]
    fn objects_composed_with_other_parts_stay_open() {
        let got = closed(json!({
            "properties": {"kind": {}},
            "oneOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}],
        }));
        assert!(got.get("additionalProperties").is_none());
        assert!(got["oneOf"][0].get("additionalProperties").is_none());
        let got = closed(json!({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}));
        assert!(got["allOf"][0].get("additionalProperties").is_none());
        // Alternatives that stand alone, and a single allOf member, are closed.
        let got = closed(json!({"anyOf": [{"properties": {"a": {}}}], "allOf": [{"properties": {"b": {}}}]}));
        assert_eq!(got["anyOf"][0]["additionalProperties"], false);
        assert_eq!(got["allOf"][0]["additionalProperties"], false);
        // A definition that a `$ref` beside more properties extends stays open with the
        // referring object; one only referred to whole is closed.
        let got = closed(json!({
            "$ref": "#/$defs/P",
            "properties": {"extra": {}, "q": {"$ref": "#/$defs/Q"}},
            "$defs": {"P": {"properties": {"p": {}}}, "Q": {"properties": {"x": {}}}},
        }));
        assert!(got.get("additionalProperties").is_none());
        assert!(got["$defs"]["P"].get("additionalProperties").is_none());
        assert_eq!(got["$defs"]["Q"]["additionalProperties"], false);
    }
}
